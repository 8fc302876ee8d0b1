"""Run the main job's program (one rank of it) and write when each phase of its launch ended: bench/mainjob.py's
``--phases`` runs every rank through this file, so the programs themselves stay as they are.

    FT_MAINJOB_PHASES=DIR PYTHONPATH=bench/mainjob_site:. python bench/mainjob_phases.py SCRIPT [ARGS...]

The process's record (bench/mainjob_site/sitecustomize.py: ``process``, ``python``, ``torch``, written at the exit
to ``FT_MAINJOB_PHASES``) gets the program's phases, wall-clock timestamps (``time.time()``):

* ``script``: this file starts (functrain's launcher imports torch and functrain in each rank before it runs the
  script, so functrain's own import is ``torch`` -> ``script`` there); ``library``: ``import functrain`` (or
  ``accelerate`` for the anchor) done;
* ``data``, ``model``: the example's ``digits_dataset()`` and the first ``Diffusion()`` returned (this file imports
  the example as the module ``diffusion`` first and wraps the two names there: the functrain example's ``main()``
  and the anchor's ``from diffusion import ...`` both get the wrapped ones);
* ``dist_start``/``dist_init``: ``torch.distributed.init_process_group`` called/returned (wrapped before either library is imported);
* ``loop``: the training loop starts (functrain: the Trainer's ``RunClock`` is made, right before its loop; the
  anchor: its first ``model(x)``), ``first_step``: the first step returned (functrain: the first
  ``RunClock.tick``; the anchor: torch's global optimizer step post-hook, its first call);
* functrain's compile, where it happens: ``compile_imports`` (the compiler's import thread, started by the runner,
  finished), ``trace_start``/``trace`` (``Graphs.trace``), ``load_start``/``load`` (``CountingBackend.load``:
  compiled code read from the caches, the first call only), ``compile_start``/``compile`` (``compile_captured``:
  a blocking compile, or a warm one's cache hits; at a background switch it only wraps the code made elsewhere),
  ``switch_start``/``switch`` (``Graphs.install``: the background compile's code taken into use).

Only a program's functions are wrapped (each call passes its arguments and result through unchanged; a call that
raises raises the same, and ``<phase>_raised`` with the error's first words is recorded); a name this file
expects and does not find is an error (exit 3), not a phase silently missing.
"""
from __future__ import annotations

import functools
import os
import runpy
import sys

try:
    import sitecustomize as site_phases  # bench/mainjob_site/sitecustomize.py: process, python, torch; the record
except ImportError:
    site_phases = None
if getattr(site_phases, "OUT", None) is None:
    raise SystemExit("mainjob_phases.py: run it as bench/mainjob.py --phases does (bench/mainjob_site on PYTHONPATH, "
                     "FT_MAINJOB_PHASES set)")
STAMPS = site_phases.STAMPS
stamp = site_phases.stamp
_write = site_phases.write
FIRST = "first_step"


def wrap(owner: object, name: str, before: str | None, after: str | None) -> None:
    """Replace ``owner.name`` by a function that stamps ``before`` (first call) and ``after`` (first return)."""
    if not hasattr(owner, name):
        print(f"mainjob_phases: {owner!r} has no {name!r} any more: update bench/mainjob_phases.py", file=sys.stderr)
        raise SystemExit(3)
    fn = getattr(owner, name)

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        if before:
            stamp(before)
        try:
            result = fn(*args, **kwargs)
        except BaseException as e:  # (passed on as it is: e.g. a cache load that misses; recorded, first only)
            if after:
                stamp(f"{after}_raised")
                site_phases.NOTES.setdefault(f"{after}_raised", f"{type(e).__name__}: {str(e)[:300]}")
            raise
        if after:
            stamp(after)
        return result

    setattr(owner, name, wrapped)


def _functrain_hooks() -> None:
    from functrain.compiler import backend, capture, runtime
    from functrain.trainer import compiling

    wrap(compiling.RunClock, "__init__", "loop", None)
    tick = compiling.RunClock.tick

    def first_tick(self, step):
        tick(self, step)
        if FIRST not in STAMPS:
            stamp(FIRST)
            _write()

    compiling.RunClock.tick = first_tick
    wrap(runtime.Graphs, "trace", "trace_start", "trace")
    wrap(backend.CountingBackend, "load", "load_start", "load")
    wrap(runtime.Graphs, "install", "switch_start", "switch")
    wrap(runtime, "compile_captured", "compile_start", "compile")
    preload = capture.preload

    def watched_preload():
        preload()
        thread = capture._preloading
        if thread is not None and "compile_imports_start" not in STAMPS:
            stamp("compile_imports_start")
            import threading

            def watch():
                thread.join()
                stamp("compile_imports")

            threading.Thread(target=watch, name="mainjob-phases", daemon=True).start()

    capture.preload = watched_preload
    from functrain.compiler import background
    if getattr(background, "_preload", None) is preload:
        background._preload = watched_preload


def main(argv: list[str]) -> None:
    stamp("script")
    if len(argv) < 1:
        raise SystemExit("usage: mainjob_phases.py SCRIPT [ARGS...]")
    script, args = argv[0], argv[1:]
    if sys.path and os.path.abspath(sys.path[0] or ".") == os.path.dirname(os.path.abspath(__file__)):
        del sys.path[0]  # (this file's folder, bench/: its modules must not shadow the program's imports)
    import torch  # noqa: F401 - (its import is a phase)
    import torch.distributed as dist
    wrap(dist, "init_process_group", "dist_start", "dist_init")
    anchor = os.path.basename(script) != "diffusion.py"
    if anchor:
        import accelerate  # noqa: F401
    else:
        import functrain  # noqa: F401
    stamp("library")
    if anchor:
        def post(optimizer, args_, kwargs_):
            if FIRST not in STAMPS:
                stamp(FIRST)
                _write()

        from torch.optim.optimizer import register_optimizer_step_post_hook

        register_optimizer_step_post_hook(post)
    else:
        _functrain_hooks()
    examples = os.environ.get("FT_EXAMPLES", "examples") if anchor else os.path.dirname(os.path.abspath(script))
    sys.path.insert(0, examples)
    import diffusion
    wrap(diffusion, "digits_dataset", "data_start", "data")
    wrap(diffusion.Diffusion, "__init__", "model_start", "model")
    if anchor:
        wrap(diffusion.Diffusion, "forward", "loop", None)
    sys.argv = [script, *args]
    if anchor:
        sys.path.remove(examples)  # (the anchor puts it there itself)
        runpy.run_path(script, run_name="__main__")
    else:
        diffusion.main()  # the example's ``if __name__ == "__main__": main()``, with the wrapped names


if __name__ == "__main__":
    main(sys.argv[1:])
