"""Where a runner's compile stands (:class:`Progress`) and how fast each of its paths runs (:class:`PhaseRates`).

Each runner (:class:`~functrain.compiler.runtime.Runner`) has one of each: the :class:`Progress` of its compile
(written by the runner, or by the background component it owns, which reports into it) and one rate meter,
recorded by the runner after every call with the path the call took and whether it did compile work on the
caller's thread. ``ft.run``'s bar, the Trainer's metrics and summary read them; nobody else times the runner.
"""
from __future__ import annotations

import time

__all__ = ["Progress", "PhaseRates"]


class Progress:
    """Where a runner's compile stands (host values, read by ``ft.run``'s bar and the Trainer).

    Attributes:
        phase:       ``"eager"`` (nothing compiling yet), ``"compiling"``, ``"ready"`` (this process's compiled
                     code is ready: the switch waits for ``switch_at`` or for the other processes), ``"compiled"``
                     (a compiled graph runs) or ``"failed"`` (the compile failed: eager for good; ``reason``).
        eager_calls: calls that ran the eager step.
        compile_s:   seconds from the start of the first graph's trace to its code being loaded here (a blocking
                     compile: the first call's compile).
        worker_s:    of which the worker's own compile (``None`` without a worker).
        worker_pid:  the running worker's process id, or ``None``.
        source:      where the first graph's code came from: ``"worker"`` (this process's worker compiled it),
                     ``"peer"`` (another process on this machine was compiling it: this one waited for it and
                     loaded its code), ``"cache"`` (an earlier process had: loaded at the first trace),
                     ``"thread"``, ``"here"`` (compiled on the training thread: a blocking compile, another
                     backend, a package, or a failed load); ``None`` before.
        switch_at:   the step count at which the compiled code takes over (``None``: when it is ready).
        workers:     compile workers this process gave a graph to (one machine compiles each graph once: a
                     process that follows another's compile starts none).
        traced:      whether the first graph has been traced (or its trace failed): until then ``ft.memory`` of
                     this runner would trace it itself, waiting for the compiler's imports.
        reason:      why the compile failed, or ``None``.
        background:  whether the runner compiles in the background (``False``: its first call compiles and waits).
        runner:      which code serves the first graph after a race between a background compile's JIT code and the
                     package built in the same run (:mod:`functrain.compiler.race`): ``"package"`` or ``"jit"``;
                     ``None`` when there was no race.
        runner_ratio: the package's time per call over the JIT code's in that race (the largest of the processes').
    """

    __slots__ = ("phase", "eager_calls", "compile_s", "worker_s", "worker_pid", "reason", "switch_at", "source",
                 "workers", "traced", "background", "runner", "runner_ratio")

    def __init__(self, switch_at: int | None = None, background: bool = True) -> None:
        self.switch_at = switch_at
        self.background = background
        self.phase = "eager"
        self.eager_calls = 0
        self.compile_s: float | None = None
        self.worker_s: float | None = None
        self.worker_pid: int | None = None
        self.reason: str | None = None
        self.source: str | None = None
        self.workers = 0
        self.traced = False
        self.runner: str | None = None
        self.runner_ratio: float | None = None

    def __repr__(self) -> str:
        return (f"Progress(phase={self.phase!r}, eager_calls={self.eager_calls}, compile_s={self.compile_s}, "
                f"reason={self.reason!r})")


class PhaseRates:
    """Steps per second on each path of a runner (``"eager"`` while it compiles in the background,
    ``"compiled"``), from host timers: a call that did compile work on the caller's thread (a blocking compile,
    a background compile's trace, load or wait) counts on neither, so no rate or ETA comes from it.

    The runner records each call (:meth:`record`) as it returns: the time since the previous call returned (since
    the meter was made, for the first) is that call's.

    Attributes:
        calls: ``{path: count}`` of every call; steps, seconds: ``{path: count}``, ``{path: seconds}`` of the
            timed ones.
        switched_at: the number (1-based, of this runner's calls) of the first call that ran compiled after eager
            ones (``None`` before, or when no call ran eagerly).
        paused: whether the last call did compile work.
        path: the path of the last call (``None`` before the first).

    Example::

        >>> from functrain.compiler.progress import PhaseRates
        >>> rates = PhaseRates()
        >>> for path, paused in [("eager", True), ("eager", False), ("eager", False), ("compiled", True),
        ...                      ("compiled", False), ("compiled", False)]:
        ...     rates.record(path, paused)
        >>> rates.calls, rates.steps, rates.switched_at
        ({'eager': 3, 'compiled': 3}, {'eager': 2, 'compiled': 2}, 4)
    """

    def __init__(self) -> None:
        self.calls = {"eager": 0, "compiled": 0}
        self.steps = {"eager": 0, "compiled": 0}
        self.seconds = {"eager": 0.0, "compiled": 0.0}
        self.switched_at: int | None = None
        self.paused = False
        self.path: str | None = None
        self.last = time.perf_counter()  # when the last call returned

    def record(self, path: str, paused: bool) -> None:
        """Account the call that just returned: it ran ``path``; ``paused``: it did compile work."""
        now = time.perf_counter()
        dt, self.last = now - self.last, now
        if path == "compiled" and self.path == "eager" and self.switched_at is None:
            self.switched_at = self.calls["eager"] + self.calls["compiled"] + 1
        self.path, self.paused = path, paused
        self.calls[path] += 1
        if not paused:
            self.steps[path] += 1
            self.seconds[path] += dt

    def rate(self, path: str) -> float | None:
        """Steps per second on ``path`` so far (``None`` before two timed calls on it)."""
        n = self.steps[path]
        return n / self.seconds[path] if n >= 2 and self.seconds[path] > 0 else None

    def describe(self, progress: Progress | None) -> str:
        """``"compiling in the background · eager 85.1 it/s"``, then ``"compiled 301 it/s (eager 85.1 it/s)"``."""
        eager, compiled = self.rate("eager"), self.rate("compiled")
        e = f"eager {eager:.3g} it/s" if eager is not None else "eager ? it/s"  # (a label with its rate, unknown yet)
        if progress is not None and progress.phase == "compiling" and self.path != "compiled":
            return f"compiling in the background · {e}"
        if progress is not None and progress.phase == "ready" and self.path != "compiled":
            when = f"at step {progress.switch_at}" if progress.switch_at is not None else "with the other processes"
            return f"compiled, switching {when} · {e}"
        if progress is not None and progress.phase == "failed":
            return f"{e} (the compile failed)"
        if self.path == "compiled" and self.calls["eager"]:
            c = f"compiled {compiled:.3g} it/s" if compiled is not None else "compiled ? it/s"
            return f"{c} ({e})"
        return ""
