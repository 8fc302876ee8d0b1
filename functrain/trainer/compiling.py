"""The run's clock: where a ``train()`` call is (its first and last step) and what it reports of time and compiling
(``metrics.jsonl`` fields and the summary's lines).

The Trainer's step runs on a runner it owns (``trainer.run_step``, :meth:`functrain.CompiledStep.runner`). A
blocking compile makes the first step the compile: its time is ``compile_s`` and the throughput counts from the
step after it. A background compile (:mod:`functrain.compiler.background`) runs the first steps eagerly while the
compiled step is built, and takes over when it is ready: the runner's own rate meter
(:class:`~functrain.compiler.PhaseRates`, recorded by the runner at each call) and its
:class:`~functrain.compiler.progress.Progress` say when the switch happened (``switched_at``), how long the
compile took (``compile_s``, once) and the throughput on each path so far (``steps_per_s_eager``,
``steps_per_s_compiled``). All of it is this ``train()`` call's: the runner lives as long as the Trainer (its own
meter counts from when it was made, through a :func:`precompile` or an earlier ``train()``), so the clock notes
which path each of this call's steps ran (the runner's ``rates.path`` after the call) on its own timer. A run
whose compiled code was ready before its first step (compiled ahead in this process, or by an earlier call) runs
no step eagerly: it reports ``switched_at`` = its first step and ``compile_s`` = what its first step spent getting
that code (a load, or nothing).

Whether a background compile starts at all is the compile policy's decision (:mod:`functrain.compiler.policy`),
made after the first few eager steps: it goes to ``metrics.jsonl`` once (``compile_decision``: 1 compile, 0 train
eagerly, with its numbers: ``compile_predicted_cpu_s``, ``compile_gain_s``, ``compile_cost_s``,
``compile_eager_step_s``, ``compile_steps_left``, ``compile_cores``, ``compile_busy``) and to the summary in words.
:func:`precompile` compiles a Trainer's step ahead (``--precompile`` on examples/diffusion.py).
"""
from __future__ import annotations

import time
from typing import Any

from ..compiler import Runner
from ..compiler.race import MARGIN

__all__ = ["RunClock", "precompile"]


_SOURCES = {"cache": "loaded from the compile caches", "peer": "loaded from another process's compile",
            "worker": "compiled by a worker process", "thread": "compiled on a thread",
            "here": "compiled on the training thread",
            "warm": "loaded from a package before any trace (a precompile's or an earlier run's, checked against the "
                    "eager step at its first call)"}  # (Progress.source: where the first graph's code came from)


class RunClock:
    """One ``train()`` call's steps and times: :meth:`tick` after each step, :meth:`fields` at each log step,
    :meth:`notes` and :meth:`wall_s` for the summary.

    ``runner``: what the loop runs (``trainer.run_step``); ``compiled``: whether the step is compiled; ``start``:
    the step the run resumes from (0: a fresh run).

    Example::

        >>> clock = RunClock(None, compiled=False, start=10)   # an eager step resumed at step 10
        >>> clock.tick(11)
        >>> host = {"loss": 1.0}
        >>> clock.fields(11, host)
        >>> sorted(host), clock.step, clock.notes()
        (['loss', 'steps_per_s'], 11, [])
    """

    def __init__(self, runner: Any, compiled: bool, start: int):
        background = isinstance(runner, Runner) and runner.background is not None
        self.start = self.step = start  # the step the run resumed from; the last finished step
        self.t0 = time.perf_counter()
        self.compiled = compiled and not background  # the first step is the compile (a blocking one)
        self.rates = runner.rates if background else None  # a background compile: each path's throughput
        self.progress = runner.progress if background else None  # ... and its phase
        self.policy = runner.background if background else None  # the compile policy's decision (BackgroundCompiler)
        self.later = runner.graphs.later if background else None  # the package for the next run (compiler/later.py)
        self.first_at: float | None = None  # when the first step returned (after compiling)
        self.compile_s = 0.0  # a blocking compile: the first step's time
        self.reported: set = set()  # the fields logged once that were logged
        # a background runner: this call's steps on each path, the seconds of those that did no compile work (the
        # runner's meter also counts its calls before this train(): a precompile's time would be in its first)
        self.steps = {"eager": 0, "compiled": 0}
        self.seconds = {"eager": 0.0, "compiled": 0.0}
        self.switched_at: int | None = None  # this call's first step that ran compiled
        self.ready_before = False  # ... was its first step: the compiled code was there before the run
        self.first_compiled_s: float | None = None  # that step's time if it did compile work (a load), else 0
        self._last = self.t0
        self.compiled_before = background and runner.progress.compile_s is not None  # by an earlier train() call

    def tick(self, step: int) -> None:
        """Step ``step`` has returned (its host values not read): note it, and when the first one did."""
        self.step = step
        now = time.perf_counter()
        if self.first_at is None:
            self.first_at = now
            self.compile_s = self.first_at - self.t0
        dt, self._last = now - self._last, now
        rates = self.rates
        if rates is None or rates.path not in self.steps:
            return
        path = rates.path
        if path == "compiled" and self.switched_at is None:
            self.switched_at = step
            self.ready_before = step == self.start + 1
            self.first_compiled_s = dt if rates.paused else 0.0
        if not rates.paused:
            self.steps[path] += 1
            self.seconds[path] += dt

    def rate(self, path: str) -> float | None:
        """This call's steps per second on ``path`` (``"eager"``, ``"compiled"``) so far, from its steps that did
        no compile work; ``None`` before two of them (or without a background compile)."""
        n = self.steps[path]
        return n / self.seconds[path] if n >= 2 and self.seconds[path] > 0 else None

    def _compile_s(self) -> float | None:
        """The compile's seconds as this call saw them: the runner's compile or load; for code that was ready
        before the run, what its first step spent getting it (0: in this process already)."""
        if self.progress.compile_s is not None and not self.compiled_before:
            return self.progress.compile_s
        return self.first_compiled_s if self.ready_before else None

    def fields(self, step: int, host: dict) -> None:
        """Add to log step ``step``'s record ``host``: the throughput (``steps_per_s``: compiled, from the first step
        after the compile), a blocking compile's ``compile_s`` (once), a background compile's ``compile_s`` and
        ``switched_at`` (once, when known) and ``steps_per_s_eager`` / ``steps_per_s_compiled`` (so far)."""
        now = time.perf_counter()
        if self.rates is not None:
            self._background(host)
            self._decision(host)
        if self.compiled and self.first_at is not None and "compile_s" not in self.reported:
            host["compile_s"] = self.compile_s
            self.reported.add("compile_s")
        if self.compiled:  # the throughput from the first step after compilation
            if self.first_at is not None and step > self.start + 1:
                host["steps_per_s"] = (step - self.start - 1) / max(now - self.first_at, 1e-9)
        else:
            host["steps_per_s"] = (step - self.start) / max(now - self.t0, 1e-9)

    def _background(self, host: dict) -> None:
        compile_s = self._compile_s()
        if compile_s is not None and "compile_s" not in self.reported:
            host["compile_s"] = compile_s
            if self.progress.source is not None:  # "cache": a precompile's or an earlier run's code, loaded
                host["compile_source"] = self.progress.source
            self.reported.add("compile_s")
        if self.switched_at is not None and "switched_at" not in self.reported:
            host["switched_at"] = self.switched_at
            self.reported.add("switched_at")
        if self.progress.runner is not None and "compile_runner" not in self.reported:  # (a race: race.py)
            host["compile_runner"] = self.progress.runner
            host["compile_runner_ratio"] = round(self.progress.runner_ratio, 4)
            self.reported.add("compile_runner")
        for path in ("eager", "compiled"):
            rate = self.rate(path)
            if rate is not None:
                host[f"steps_per_s_{path}"] = rate

    def _decision(self, host: dict) -> None:
        d = self.policy.decision
        if d is None or "compile_decision" in self.reported:
            return
        i = d.inputs
        host.update({"compile_decision": int(d.compile), "compile_predicted_cpu_s": round(i.compile_cpu_s, 3),
                     "compile_gain_s": round(min(d.gain_s, 1e12), 3), "compile_cost_s": round(d.cost_s, 3),
                     "compile_eager_step_s": i.eager_s, "compile_cores": i.cores, "compile_busy": i.busy})
        if i.remaining is not None:
            host["compile_steps_left"] = i.remaining
        self.reported.add("compile_decision")

    def wall_s(self) -> float:
        """Seconds since the run started."""
        return time.perf_counter() - self.t0

    def compile_time_s(self) -> float | None:
        """A blocking compile's time (the first step's), for the summary; ``None`` otherwise."""
        return self.compile_s if self.compiled else None

    def notes(self) -> list[str]:
        """The summary's lines about a background compile and the package it left for the next run (``[]`` when
        there was none)."""
        return self._compile_notes() + self._later_notes()

    def _later_notes(self) -> list[str]:
        later, p = self.later, self.progress
        raced = []
        if p is not None and p.runner is not None:
            ran = ("it served the rest of the run" if p.runner == "package" else
                   f"the JIT code stayed (the package must take at most {1 - MARGIN:.2f} of its time)")
            raced = [f"the package built in this run took {p.runner_ratio:.2f}x the JIT code's time per call: {ran}"]
        if later is None or not later.started:
            return raced
        running = later.poll()  # (their counts are current from here)
        if later.built:
            return raced + ["the package for the next run is written: a later run of this step starts compiled from "
                            "its first step"]
        if running:
            after = ("it goes on after this process exits (FUNCTRAIN_COMPILE_FINISH=1)" if later.settings.finish else
                     "it is stopped at exit (FUNCTRAIN_COMPILE_FINISH=1 lets it finish), and the next run loads the "
                     "compile caches after its trace")
            return [f"the package for the next run was still being built when the run ended: {after}"]
        return [f"the package for the next run could not be built: {later.failed[-1][:200] if later.failed else '?'}"]

    def _compile_notes(self) -> list[str]:
        if self.rates is None:
            return []
        p = self.progress
        d = self.policy.decision
        said = [f"compile policy ({d.inputs.source} predictions): {d.why}"] if d is not None else []
        if d is not None and not d.compile or self.policy.declined:
            return said
        speeds = ", ".join(f"{k} {v:.1f} steps/s" for k in ("eager", "compiled") if (v := self.rate(k)))
        speeds = f" ({speeds})" if speeds else ""
        if self.ready_before:
            took = self._compile_s()
            where = ("compiled before this train() call, in this process (precompile, or an earlier train())"
                     if self.compiled_before or p.source is None else _SOURCES.get(p.source, f"compiled ({p.source})"))
            how = (f"{where} in {took * 1000:.0f} ms" if took < 0.1 else f"{where} in {took:.1f} s") if took else where
            return said + [f"compiled from step {self.switched_at}, no step ran eagerly: its code was {how}{speeds}"]
        if p.phase == "failed":
            return said + [f"the background compile failed, every step ran eagerly{speeds}: {str(p.reason)[:200]}"]
        if self.switched_at is not None:
            took = f" in {p.compile_s:.1f} s" if p.compile_s is not None else ""
            how = (f"loaded from the compile caches{took} (the trace and the load: a precompile's or an earlier "
                   f"run's code, no compile)" if p.source == "cache" else f"compiled in the background{took}")
            return said + [f"{how}; the compiled step took over at step {self.switched_at}{speeds}"]
        if d is None and p.phase == "eager" and not p.workers and self.policy.total is not None:
            return [f"every step ran eagerly: the run ended before its compile was decided (the compiler's imports "
                    f"and the trace come first){speeds}"]
        if self.steps["eager"] and not self.steps["compiled"]:
            return said + [f"the background compile had not finished: every step ran eagerly{speeds}"]
        cached = "; its code loaded from the compile caches (a precompile's or an earlier run's code; no compile)"
        return said + ([f"compiled{speeds}{cached if p.source == 'cache' else ''}"] if speeds else [])


def precompile(trainer: Any, quiet: bool = False) -> float:
    """Compile a Trainer's step ahead, into the compile caches, without training: the step of its first state
    (:meth:`~functrain.Trainer.initial_state`) and one batch of its loader (the loader's position is put back).
    A later ``train()`` (this process's, or a later run's) then runs compiled from its first steps. Returns the
    seconds it took. ``TrainConfig(compile=False)`` has nothing to compile: ``ValueError``.

    Example::

        trainer = ft.Trainer(model, dataset, config)
        precompile(trainer)      # "functrain: compiled ahead in 41.2 s ..."; exit, or train()
    """
    compiled = getattr(trainer, "compiled", None)
    if compiled is None:
        raise ValueError("precompile: this Trainer's step is not compiled (TrainConfig(compile=False)): nothing to "
                         "compile ahead")
    loader = trainer.loader
    position = loader.state_dict()
    try:
        batch = next(iter(loader))
    finally:
        loader.load_state_dict(position)
    return compiled.precompile(trainer.initial_state(), batch, donate=True, quiet=quiet or trainer.rank != 0)
