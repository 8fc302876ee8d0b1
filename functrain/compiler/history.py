"""This machine's compile history: what the compile policy (:mod:`functrain.compiler.policy`) predicts from.

One small JSON file beside the compile caches (``functrain_history.json`` in inductor's cache folder, which
:mod:`functrain.compiler.cache` checked is this user's alone), written atomically (a temporary file in the same
folder, flushed, then renamed over it). It holds, per kind of graph (the device and the inductor mode):

* ``compiles``: the last :data:`KEEP` compiles, each ``{"nodes": graph nodes, "cpu_s": CPU seconds}``;
* ``steps``: the last :data:`KEEP` runs that ran both paths, each ``{"eager_s": s, "compiled_s": s}``.

A prediction scales the compile of the nearest graph size by the ratio of node counts, and takes the median
ratio of the compiled step to the eager one. A new machine (no entry of that kind) gets the conservative defaults
(:data:`DEFAULT_BASE_S` + :data:`DEFAULT_PER_NODE_S` per node; :data:`DEFAULT_RATIO`).

The history is advice, so any file gives a prediction, never a crash or a hang: a file that is not a regular file
(a directory, a FIFO, a socket, a link: opened without following a link and without blocking, its type checked
before a byte is read), is larger than :data:`MAX_BYTES`, is not JSON (nested past the parser's recursion limit
included), is not this format, or holds a value no measurement gives (a step time outside :data:`STEP_S`, a
compiled/eager ratio outside :data:`RATIO`, a compile outside :data:`COMPILE_S`) is not used: one warning names it
and why, it is moved aside as ``<name>.damaged`` at the next write, and the defaults apply. What a prediction
derives from the file (a compile scaled by node counts, a ratio of two times) is clamped to those ranges too, so
the policy never receives an infinite, zero or NaN input.
"""
from __future__ import annotations

import json
import math
import os
import stat
import tempfile
import warnings
from typing import Any, NamedTuple

__all__ = ["History", "Prediction", "kind_of", "cpu_seconds", "FILENAME", "KEEP", "DEFAULT_BASE_S",
           "DEFAULT_PER_NODE_S", "DEFAULT_RATIO", "STEP_S", "RATIO", "COMPILE_S", "MAX_NODES"]

FILENAME = "functrain_history.json"
FORMAT = 1
KEEP = 20
MAX_BYTES = 1 << 20
DEFAULT_BASE_S = 20.0
DEFAULT_PER_NODE_S = 0.05
DEFAULT_RATIO = 0.8
STEP_S = (1e-9, 1e6)
"""A recorded step time, seconds (a step under a nanosecond or over 11 days is no measurement)."""
RATIO = (1e-4, 1e4)
"""A recorded or predicted compiled/eager step ratio."""
COMPILE_S = (0.0, 1e7)
"""A recorded compile's CPU seconds; a predicted one lies in ``(0.1, 1e7)``."""
MAX_NODES = 10**9
"""A recorded graph's node count."""


class Prediction(NamedTuple):
    """A graph's predicted compile CPU seconds and compiled/eager step ratio; ``source``: ``"history"`` or
    ``"default"`` (the ratio's and the compile's sources can differ: ``"history"`` when either came from it)."""

    compile_cpu_s: float
    compiled_ratio: float
    source: str


def _real(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _bad_row(field: str, row: Any) -> str | None:
    """Why a ``compiles`` or ``steps`` row is not one this module writes (``None``: it is)."""
    if not isinstance(row, dict):
        return f"a {field} row that is not an object"
    if field == "compiles":
        nodes, cpu = row.get("nodes"), row.get("cpu_s")
        if not (isinstance(nodes, int) and not isinstance(nodes, bool) and 0 <= nodes <= MAX_NODES):
            return f"a graph of {nodes!r} nodes (allowed: an int from 0 to {MAX_NODES})"
        if not (_real(cpu) and COMPILE_S[0] <= cpu <= COMPILE_S[1]):
            return f"a compile of {cpu!r} CPU seconds (allowed: {COMPILE_S[0]:g} to {COMPILE_S[1]:g})"
        return None
    times = row.get("eager_s"), row.get("compiled_s")
    for t in times:
        if not (_real(t) and STEP_S[0] <= t <= STEP_S[1]):
            return f"a step of {t!r} s (allowed: {STEP_S[0]:g} to {STEP_S[1]:g})"
    ratio = times[1] / times[0]
    if not RATIO[0] <= ratio <= RATIO[1]:
        return f"a compiled/eager step ratio of {ratio:.3g} (allowed: {RATIO[0]:g} to {RATIO[1]:g})"
    return None


def _clean(data: Any) -> tuple[dict | None, str | None]:
    """``(the history, None)``: a fresh copy of ``data`` holding only what this module reads (an extra key is
    dropped: nothing else of the file is kept or written back); ``(None, why)`` if it is not a history."""
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("kinds"), dict):
        return None, f"it is not a format-{FORMAT} compile history"
    kinds = {}
    for kind, entry in data["kinds"].items():
        if not isinstance(entry, dict):
            return None, f"it is not a format-{FORMAT} compile history (kind {str(kind)[:40]!r})"
        clean = {}
        for field, keys in (("compiles", ("nodes", "cpu_s")), ("steps", ("eager_s", "compiled_s"))):
            rows = entry.get(field, [])
            if not isinstance(rows, list):
                return None, f"it is not a format-{FORMAT} compile history (kind {str(kind)[:40]!r})"
            for row in rows:
                why = _bad_row(field, row)
                if why is not None:
                    return None, (f"it is not a format-{FORMAT} compile history: it holds {why} (kind "
                                  f"{str(kind)[:40]!r})")
            clean[field] = [{k: row[k] for k in keys} for row in rows[-KEEP:]]
        kinds[kind] = clean
    return {"format": FORMAT, "kinds": kinds}, None


def _clamp(value: float, bounds: tuple[float, float]) -> float:
    return min(max(value, bounds[0]), bounds[1])


class History:
    """The history file at ``path`` (read at once; a damaged file warns once and reads as empty).

    Example::

        >>> import tempfile, os
        >>> h = History(os.path.join(tempfile.mkdtemp(), "h.json"))
        >>> h.predict("cpu:default", 1000).source
        'default'
        >>> h.add_compile("cpu:default", 1000, 12.0)
        >>> h.predict("cpu:default", 2000).compile_cpu_s
        24.0
    """

    def __init__(self, path: str):
        self.path = path
        self.damaged: str | None = None  # why the file on disk was not used
        self.data = self._read()

    @classmethod
    def beside_caches(cls) -> "History":
        """The history of inductor's cache folder this process compiles into."""
        from .cache import inductor_dir
        return cls(os.path.join(inductor_dir(), FILENAME))

    def _read(self) -> dict:
        empty = {"format": FORMAT, "kinds": {}}
        try:  # no link followed, no wait for a FIFO's writer; the type checked before a byte is read
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0)
                         | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            return empty
        except OSError as e:
            return self._refuse(f"it cannot be opened ({e.strerror or e})", empty)
        try:
            mode = os.fstat(fd).st_mode
            if not stat.S_ISREG(mode):
                return self._refuse(f"it is not a regular file but {_file_type(mode)}", empty)
            raw = b""
            while len(raw) <= MAX_BYTES:
                chunk = os.read(fd, MAX_BYTES + 1 - len(raw))
                if not chunk:
                    break
                raw += chunk
        except OSError as e:
            return self._refuse(f"it cannot be read ({e.strerror or e})", empty)
        finally:
            os.close(fd)
        if len(raw) > MAX_BYTES:
            return self._refuse(f"it is larger than {MAX_BYTES} bytes", empty)
        try:
            data = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as e:  # (RecursionError: nested too deep)
            return self._refuse(f"it is not JSON ({type(e).__name__}: {str(e)[:100]})", empty)
        clean, why = _clean(data)
        if clean is None:
            return self._refuse(why, empty)
        return clean

    def _refuse(self, why: str, empty: dict) -> dict:
        self.damaged = why
        warnings.warn(f"ft.compile: not using the compile history {self.path!r}: {why}; predicting from the "
                      f"defaults (it is set aside as {os.path.basename(self.path)}.damaged at the next write)",
                      RuntimeWarning, stacklevel=3)
        return empty

    def _kind(self, kind: str) -> dict:
        return self.data["kinds"].setdefault(kind, {"compiles": [], "steps": []})

    def predict(self, kind: str, nodes: int) -> Prediction:
        """The compile's CPU seconds for a graph of ``nodes`` nodes of ``kind``, and the compiled/eager ratio."""
        entry = self.data["kinds"].get(kind) or {}
        compiles, steps = entry.get("compiles") or [], entry.get("steps") or []
        source = "default"
        nodes = min(max(int(nodes), 0), MAX_NODES)
        cpu = DEFAULT_BASE_S + DEFAULT_PER_NODE_S * nodes
        if compiles:
            near = min(compiles, key=lambda r: abs(_log(r["nodes"]) - _log(nodes)))
            cpu = _clamp(float(near["cpu_s"]) * max(nodes, 1) / max(near["nodes"], 1), (0.1, COMPILE_S[1]))
            source = "history"
        ratio = DEFAULT_RATIO
        ratios = sorted(r["compiled_s"] / r["eager_s"] for r in steps if r["eager_s"] > 0 and r["compiled_s"] > 0)
        if ratios:
            ratio = _clamp(ratios[len(ratios) // 2], RATIO)
            source = "history"
        return Prediction(cpu, ratio, source)

    def untraced(self, kind: str) -> Prediction | None:
        """A lower bound on a compile of ``kind`` judged before its graph is traced, where this machine never
        compiled a graph of that kind (so the caches beside this history hold none, and a trace could only find
        nothing): the default's base cost, with the ratio :meth:`predict` gives. ``None`` once a compile of that
        kind is recorded (a worker's or a precompile's: the graph may be in the caches, only a trace can tell)."""
        entry = self.data["kinds"].get(kind) or {}
        if entry.get("compiles"):
            return None
        return Prediction(DEFAULT_BASE_S, self.predict(kind, 0).compiled_ratio, "default")

    def add_compile(self, kind: str, nodes: int, cpu_s: float) -> None:
        """Record a compile of a graph of ``nodes`` nodes that took ``cpu_s`` CPU seconds (and write the file);
        values outside the ranges a read accepts are not recorded."""
        row = {"nodes": int(nodes), "cpu_s": round(float(cpu_s), 3)}
        if _bad_row("compiles", row) is not None:  # (no measurement: nothing a later read would refuse)
            return
        rows = self._kind(kind)["compiles"]
        rows.append(row)
        del rows[:-KEEP]
        self.write()

    def add_steps(self, kind: str, eager_s: float, compiled_s: float) -> None:
        """Record a run's eager and compiled step times (and write the file); values outside the ranges a read
        accepts are not recorded."""
        row = {"eager_s": float(f"{float(eager_s):.6g}"), "compiled_s": float(f"{float(compiled_s):.6g}")}
        if _bad_row("steps", row) is not None:  # (no measurement: nothing a later read would refuse)
            return
        rows = self._kind(kind)["steps"]
        rows.append(row)
        del rows[:-KEEP]
        self.write()

    def write(self) -> None:
        """Write the history atomically; a file that was damaged is moved aside first. A failure warns (the run
        goes on: the history only predicts)."""
        folder = os.path.dirname(os.path.abspath(self.path))
        try:
            if self.damaged is not None and os.path.lexists(self.path):
                os.replace(self.path, self.path + ".damaged")
                self.damaged = None
            fd, tmp = tempfile.mkstemp(prefix=".history-", suffix=".tmp", dir=folder)
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump(self.data, f, sort_keys=True)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, self.path)
            except BaseException:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
                raise
        except OSError as e:
            warnings.warn(f"ft.compile: the compile history {self.path!r} was not written ({e}); later runs "
                          f"predict from what it held", RuntimeWarning, stacklevel=3)


def kind_of(metas: Any, mode: Any) -> str:
    """The history's key for a graph: its inputs' device type and the inductor mode (``"cpu:default"``)."""
    device = "cpu"
    for meta in metas or ():
        if len(meta) == 4 and meta[3] is not None:
            device = getattr(meta[3], "type", str(meta[3]))
            break
    return f"{device}:{mode or 'default'}"


def cpu_seconds() -> float:
    """The CPU seconds this process and its reaped children (the compiler's gcc runs) have used so far."""
    import resource

    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        total += usage.ru_utime + usage.ru_stime
    return total


def _log(n: float) -> float:
    return math.log(max(float(n), 1.0))


def _file_type(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return f"a file of mode {oct(stat.S_IFMT(mode))}"
