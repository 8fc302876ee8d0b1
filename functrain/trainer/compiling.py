"""The run's clock: where a ``train()`` call is (its first and last step) and what it reports of time and compiling
(``metrics.jsonl`` fields and the summary's lines).

The Trainer's step runs on a runner it owns (``trainer.run_step``, :meth:`functrain.CompiledStep.runner`). A
blocking compile makes the first step the compile: its time is ``compile_s`` and the throughput counts from the
step after it. A background compile (:mod:`functrain.compiler.background`) runs the first steps eagerly while the
compiled step is built, and takes over when it is ready: the runner's own rate meter
(:class:`~functrain.compiler.PhaseRates`, recorded by the runner at each call) and its
:class:`~functrain.compiler.progress.Progress` say when the switch happened (``switched_at``), how long the
compile took (``compile_s``, once) and the throughput on each path so far (``steps_per_s_eager``,
``steps_per_s_compiled``).

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

__all__ = ["RunClock", "precompile"]


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
        self.first_at: float | None = None  # when the first step returned (after compiling)
        self.compile_s = 0.0  # a blocking compile: the first step's time
        self.reported: set = set()  # the fields logged once that were logged

    def tick(self, step: int) -> None:
        """Step ``step`` has returned (its host values not read): note it, and when the first one did."""
        self.step = step
        if self.first_at is None:
            self.first_at = time.perf_counter()
            self.compile_s = self.first_at - self.t0

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
        p, rates = self.progress, self.rates
        if p.compile_s is not None and "compile_s" not in self.reported:
            host["compile_s"] = p.compile_s
            if p.source is not None:  # "cache": a precompile's or an earlier run's code, loaded (no compile here)
                host["compile_source"] = p.source
            self.reported.add("compile_s")
        if rates.switched_at is not None and "switched_at" not in self.reported:
            host["switched_at"] = self.start + rates.switched_at  # (the runner counts its calls; the run, its steps)
            self.reported.add("switched_at")
        for path in ("eager", "compiled"):
            rate = rates.rate(path)
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
        """The summary's line about a background compile (``[]`` when there was none)."""
        if self.rates is None:
            return []
        p, rates = self.progress, self.rates
        d = self.policy.decision
        said = [f"compile policy ({d.inputs.source} predictions): {d.why}"] if d is not None else []
        if d is not None and not d.compile or self.policy.declined:
            return said
        speeds = ", ".join(f"{k} {v:.1f} steps/s" for k in ("eager", "compiled") if (v := rates.rate(k)))
        speeds = f" ({speeds})" if speeds else ""
        if p.phase == "failed":
            return said + [f"the background compile failed, every step ran eagerly{speeds}: {str(p.reason)[:200]}"]
        if rates.switched_at is not None:
            took = f" in {p.compile_s:.1f} s" if p.compile_s is not None else ""
            at = self.start + rates.switched_at
            how = (f"loaded from the compile caches{took} (the trace and the load: a precompile's or an earlier "
                   f"run's code, no compile)" if p.source == "cache" else f"compiled in the background{took}")
            return said + [f"{how}; the compiled step took over at step {at}{speeds}"]
        if d is None and p.phase == "eager" and not p.workers and self.policy.total is not None:
            return [f"every step ran eagerly: the run ended before its compile was decided (the compiler's imports "
                    f"and the trace come first){speeds}"]
        if rates.steps["eager"] and not rates.steps["compiled"]:
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
