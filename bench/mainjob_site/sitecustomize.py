"""bench/mainjob.py's phase stamps in every Python process of a timed run (its launcher, its ranks, a compile
worker): this folder is put on ``PYTHONPATH`` by ``bench/mainjob.py --phases``, and Python imports
``sitecustomize`` at start-up. Without ``FT_MAINJOB_PHASES`` (the folder the stamps go to) it does nothing.

Stamps (``time.time()``, comparable between the processes of one machine): ``process`` (the kernel's record of the
process's creation, ``/proc/self/stat``), ``python`` (the interpreter is up: this file runs), ``torch`` (the first
``import torch`` finished: an import hook that looks at that one name and passes every other by). Written at the
exit, and by :func:`write` when asked, to ``FT_MAINJOB_PHASES/phases-<pid>.json`` with the process's ``RANK`` and
command line; bench/mainjob_phases.py (each rank's entry) adds the program's own phases to the same record.
"""
import time

T_PYTHON = time.time()

import atexit  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

OUT = os.environ.get("FT_MAINJOB_PHASES")
STAMPS: dict = {"python": T_PYTHON}
NOTES: dict = {}  # what a stamp needs said (bench/mainjob_phases.py: the error of a wrapped call that raised)


def process_start() -> float | None:
    """This process's creation time (wall clock, to one clock tick) from the kernel's record: its start in ticks
    after boot (``/proc/self/stat``), against the boot clock now; ``None`` without /proc."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22 (starttime), after the ")" of field 2
        return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - started)
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def stamp(name: str) -> None:
    """Record ``name`` now, the first time only."""
    if name not in STAMPS:
        STAMPS[name] = time.time()


def write() -> None:
    """Write this process's record (atomically: a reader never sees half of it)."""
    if not OUT:
        return
    record = {"pid": os.getpid(), "rank": os.environ.get("RANK"), "argv": sys.argv[:4], "stamps": STAMPS,
              "notes": NOTES}
    path = os.path.join(OUT, f"phases-{os.getpid()}.json")
    try:
        with open(path + ".tmp", "w") as f:
            json.dump(record, f)
        os.replace(path + ".tmp", path)
    except OSError:
        pass  # (the run's results are not at stake: the bench reports the phase as missing)


class _FirstImport:
    """A meta-path finder that answers for no module: it stamps ``torch`` when torch's first import finishes by
    wrapping that one spec's ``exec_module``, and finds nothing itself (the next finders do the work)."""

    def find_spec(self, name, path=None, target=None):
        if name != "torch" or "torch" in STAMPS:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        run = loader.exec_module

        def exec_module(module):
            try:
                run(module)
            finally:
                stamp("torch")

        loader.exec_module = exec_module
        return spec


if OUT:
    start = process_start()
    if start is not None:
        STAMPS["process"] = start
    sys.meta_path.insert(0, _FirstImport())
    atexit.register(write)
