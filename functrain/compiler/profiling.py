"""A run's profile by stage and phase: what ``ft.run(..., profile=)`` and ``Trainer.train(profile=)`` record.

:class:`Profile` says what to record (``steps`` steps, after ``skip``, into a Chrome trace at ``path``);
:class:`Profiler` records it around the loop's steps with ``torch.profiler``: each step is a range named
``functrain/step <n> (<phase>)`` (the runner's phase when the step started: ``eager``, ``compiling``, ``ready``,
``compiled`` or ``failed``; a step with no runner: ``eager`` for a :class:`~functrain.core.step.Step`,
``compiled`` for a :class:`~functrain.compiler.api.CompiledStep` called as it is, else ``call``), the switch to
the compiled code is a range of its own (``functrain/switch to compiled at step <n>``), and an eager step marks
its stages (``functrain/stage/<name>``: :data:`functrain.core.step.STAGE_MARK`, from
:func:`~functrain.core.step.marking`). A compiled step is one graph whose code carries no range of ours (inductor
drops ``record_function`` from a captured graph and Dynamo ignores it), so its steps show the graph's ops, not
stages. When the profiled steps are done (or the loop ends first) the trace is written and a table of the time per
stage and per phase is printed (host times: on a GPU a range's host time is its launch time).
"""
from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator

import torch

from ..core.step import STAGE_MARK, STAGES, Step
from .api import CompiledStep
from .capture import wait_for_imports

__all__ = ["Profile", "Profiler", "profile_request"]


class Profile:
    """What to profile: ``steps`` steps, after ``skip`` steps of the run, into the Chrome trace ``path`` (open it in
    Perfetto or ``chrome://tracing``).

    Example::

        ft.run(ft.compile(step), state, loader, num_steps=1000, profile=Profile("trace.json", steps=20, skip=100))
    """

    __slots__ = ("path", "steps", "skip")

    def __init__(self, path: str | os.PathLike, steps: int = 10, skip: int = 0):
        if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
            raise TypeError(f"Profile: path must be a file path (str or os.PathLike); got {path!r}")
        for name, value, least in (("steps", steps, 1), ("skip", skip, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"Profile: {name} must be an int >= {least}; got {value!r}")
        path = os.fspath(path)
        folder = os.path.dirname(os.path.abspath(path))
        if os.path.isdir(path):
            raise ValueError(f"Profile: path {path!r} is a folder; give the trace file's path (e.g. trace.json)")
        if not os.path.isdir(folder):
            raise ValueError(f"Profile: the folder of {path!r} ({folder}) does not exist")
        self.path, self.steps, self.skip = path, steps, skip

    def __repr__(self) -> str:
        return f"Profile({self.path!r}, steps={self.steps}, skip={self.skip})"


def profile_request(value: Any) -> Profile | None:
    """``profile=`` as given to ``ft.run``: ``None`` (no profile), a path (the first 10 steps) or a :class:`Profile`."""
    if value is None or isinstance(value, Profile):
        return value
    if isinstance(value, (str, os.PathLike)):
        return Profile(value)
    raise TypeError(f"run: profile must be None, a trace file path or a functrain.compiler.profiling.Profile; "
                    f"got {type(value).__name__} {value!r}")


class Profiler:
    """Records a :class:`Profile` around a loop's steps: :meth:`step` around each call, :meth:`close` at the end of
    the loop (writes the trace if the loop ended before the profiled steps did).

    Attributes:
        table: the printed table (``None`` until the trace is written).
        switched_at: the step at which the compiled code took over while profiling (``None``: not seen).
    """

    def __init__(self, request: Profile, runner: Any = None, step: Any = None):
        self.request, self.runner = request, runner
        # the phase of a step without a runner
        self.plain = "eager" if isinstance(step, Step) else "compiled" if isinstance(step, CompiledStep) else "call"
        self.calls = 0
        self.prof: Any = None
        self.phases: dict[str, str] = {}  # step range name -> its phase
        self.first: int | None = None
        self.last: int | None = None
        self.switched_at: int | None = None
        self.table: str | None = None
        self.done = False

    @contextlib.contextmanager
    def step(self, index: int) -> Iterator[None]:
        """Around the call of step ``index``: profiled if it is one of the requested steps."""
        self.calls += 1
        if self.done or self.calls <= self.request.skip:
            yield
            return
        if self.prof is None:
            wait_for_imports()  # torch.profiler imports inductor: never while a thread imports Dynamo (a deadlock)
            self.prof = torch.profiler.profile(activities=_activities())
            self.prof.start()
            self.first = index
        phase = self.runner.progress.phase if self.runner is not None else self.plain
        name = f"functrain/step {index} ({phase})"
        self.phases[name] = phase
        with torch.profiler.record_function(name):
            yield
        self.last = index
        rates = self.runner.rates if self.runner is not None else None
        if rates is not None and phase != "compiled" and rates.path == "compiled" and rates.switched_at is not None:
            self.switched_at = index
            with torch.profiler.record_function(f"functrain/switch to compiled at step {index}"):
                pass
        if self.calls >= self.request.skip + self.request.steps:
            self.finish()

    def close(self) -> None:
        """The loop ended: write what was recorded, if anything is still open."""
        if self.prof is not None and not self.done:
            self.finish()

    def finish(self) -> None:
        """Stop recording, write the trace and print the table."""
        self.done = True
        self.prof.stop()
        self.prof.export_chrome_trace(self.request.path)
        self.table = self._table({e.key: e for e in self.prof.key_averages()})
        print(self.table, flush=True)

    def _table(self, events: dict) -> str:
        lines = [f"profile of steps {self.first}-{self.last} (trace: {self.request.path}); host times, ms",
                 f"  {'stage':<12}{'calls':>7}{'total':>11}{'per call':>11}"]
        for stage in STAGES:
            e = events.get(STAGE_MARK + stage)
            if e is not None:
                total = e.cpu_time_total / 1e3
                lines.append(f"  {stage:<12}{e.count:>7}{total:>11.3f}{total / e.count:>11.3f}")
        if len(lines) == 2:
            lines.append("  (no stage ran eagerly: a compiled step is one graph, without stage ranges)")
        else:
            lines.append("  (grad holds the loss's forward; compiled steps have no stage ranges)")
        lines.append(f"  {'phase':<12}{'steps':>7}{'total':>11}{'per step':>11}")
        by_phase: dict[str, list] = {}
        for name, phase in self.phases.items():
            e = events.get(name)
            if e is not None:
                by_phase.setdefault(phase, []).append(e.cpu_time_total / 1e3)
        for phase, times in by_phase.items():
            lines.append(f"  {phase:<12}{len(times):>7}{sum(times):>11.3f}{sum(times) / len(times):>11.3f}")
        if self.switched_at is not None:
            lines.append(f"  the compiled code took over at step {self.switched_at}")
        return "\n".join(lines)


def _activities() -> list:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return activities
