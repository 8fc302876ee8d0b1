"""The run's reports: the memory line (at the start, or once a background compile has traced the step), the
end-of-run summary (what the run reached, how long it
took, and where everything went)."""
from __future__ import annotations

import math
import os
import threading
import warnings
from typing import Any, Callable, Iterable, Iterator, Mapping

__all__ = ["run_summary", "format_duration", "memory_line", "MemoryLine", "FirstBatch", "schedule_change"]

_SCHEDULE = ("train_lr", "lr_schedule", "warmup_steps", "min_lr", "train_num_steps")  # what the built-in lr follows


def memory_line(run_step: Any, state: Any, batch: Any) -> str:
    """The Trainer's memory line: :func:`functrain.memory` of a compiled step (its capture is what the first step
    compiles, so this costs no second trace), or the state's bytes of an eager one.

    Example::

        >>> import torch, functrain as ft
        >>> step = ft.train_step(lambda p, b, x: (p["w"] * x).sum(), ft.optim.sgd(0.1))
        >>> memory_line(step, step.init({"w": torch.zeros(1024)}), torch.ones(1024)).split(" (")[0]
        'memory per rank on cpu: state 4.04 KiB'
    """
    return str(_prepared(run_step, state, batch, trace=True).finish())


def _prepared(run_step: Any, state: Any, batch: Any, trace: bool) -> Any:
    from ..compiler import CompiledStep, DynamoRunner, Runner
    from ..compiler.estimate import MemoryEstimate, Prepared, device_memory, prepare, state_bytes

    if isinstance(run_step, (CompiledStep, Runner, DynamoRunner)):
        return prepare(run_step, state, batch, donate=True, trace=trace)  # ft.run donates
    device = state.step.device
    return Prepared(MemoryEstimate(device=device, state=state_bytes(state), traced=False,
                                   capacity=device_memory(device)))


class MemoryLine:
    """When and where the Trainer makes :func:`memory_line` (rank 0 prints it, once).

    What the line needs from the step and the state is read on the training thread (the capture, the state's
    bytes); the walk of the capture's graph, seconds on a large model, runs on a thread of its own
    (``functrain-memory-line``), which prints the line: no step waits for it. :meth:`close` (the end of the run)
    waits for that thread, so the line is never lost.

    Before the first step (:meth:`first`, every rank: a compiled step's ranks each keep the capture its first call
    compiles), except for a background compile that switches when ready (``progress``: its
    :class:`~functrain.compiler.background.Progress`, ``switch_at`` ``None``): its trace waits for the compiler's
    imports, which a thread makes while the first steps run eagerly, so the line comes after the step in which
    that trace ran (:meth:`after_step`), from its capture; nothing is traced for the line then (the state's bytes
    alone if that capture is not kept or the compile failed); none if the run ended before the trace. The same
    for a runner whose first call may load a warm entry (``may_start_warm``): a trace for the line would import
    the compiler the warm start avoids.

    Attributes:
        thread: the thread walking the graph for the line (``None`` before; done once joined by :meth:`close`).
    """

    def __init__(self, run_step: Any, rank: int, progress: Any = None):
        self.run_step, self.rank, self.progress = run_step, rank, progress
        self.batch: Any = None  # the first batch, while the line waits for the background trace
        self.thread: threading.Thread | None = None

    def first(self, state: Any, batch: Any) -> None:
        """Before the first step (every rank): make the line now, or keep ``batch`` (rank 0) for :meth:`after_step`."""
        if self.progress is not None and (self.progress.switch_at is None or self.run_step.may_start_warm()):
            self.batch = batch if self.rank == 0 else None
            return
        prepared = _prepared(self.run_step, state, batch, trace=True)  # (the capture the first call compiles)
        if self.rank == 0:
            self._report(prepared)

    def after_step(self, state: Any) -> None:
        """After each step: once the background compile has traced (or failed), make the kept line from its
        capture; no trace here (nor a wait for the compiler's imports)."""
        if self.batch is None or not (self.progress.traced or self.progress.phase == "failed"):
            return
        batch, self.batch = self.batch, None
        prepared = _prepared(self.run_step.step, state, batch, trace=False) if self.progress.phase == "failed" \
            else _prepared(self.run_step, state, batch, trace=False)
        if self.progress.phase == "failed":  # the state's bytes, and why there is no peak
            prepared.estimate.untraced = "the step's peak unknown: the background compile failed, the steps run eagerly"
        self._report(prepared)

    def _report(self, prepared: Any) -> None:
        def run() -> None:
            try:
                print(str(prepared.finish()), flush=True)
            except Exception as e:  # noqa: BLE001 - an estimate that fails must not stop the run: said, not raised
                warnings.warn(f"the memory line's estimate failed ({type(e).__name__}: {e})", RuntimeWarning)

        self.thread = threading.Thread(target=run, name="functrain-memory-line", daemon=True)
        self.thread.start()

    def close(self, timeout: float = 600.0) -> None:
        """Wait for the line (at most ``timeout`` seconds; after that a warning says it was not finished)."""
        if self.thread is not None:
            self.thread.join(timeout)
            if self.thread.is_alive():
                warnings.warn(f"the memory line's estimate did not finish within {timeout:g} s; the run goes on "
                              f"without it", RuntimeWarning)


class FirstBatch:
    """``data`` (iterated as often as the loop iterates it, with its ``len``) that calls ``fn(batch)`` once,
    before its first batch is handed on: how the Trainer's :class:`MemoryLine` sees the first batch."""

    def __init__(self, data: Any, fn: Callable[[Any], None]):
        self.data, self.fn = data, fn

    def __iter__(self) -> Iterator:
        for batch in self.data:
            if self.fn is not None:
                fn, self.fn = self.fn, None
                fn(batch)
            yield batch

    def __len__(self) -> int:
        return len(self.data)


def format_duration(seconds: float) -> str:
    """``"42.0 s"``, ``"3 min 05 s"``, ``"2 h 07 min"``.

    Example::

        >>> format_duration(185.2)
        '3 min 05 s'
    """
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(int(round(seconds)), 60)
    if minutes < 60:
        return f"{minutes} min {secs:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


def _value(v: Any) -> str:
    try:
        return f"{float(v):.6g}"
    except (TypeError, ValueError):
        return str(v)


def run_summary(*, results_folder: str, step: int, total_steps: int | None = None,
                final_metrics: Mapping[str, Any] | None = None, wall_time_s: float | None = None,
                compile_time_s: float | None = None, steps_run: int | None = None,
                outputs: Mapping[str, str] | None = None, trackers: Iterable[Any] = (),
                notes: Iterable[str] = ()) -> str:
    """A few lines for the end of ``train()``: final metrics, time (and compile time), where the results are.

    ``final_metrics`` are the last logged values (``loss`` first); ``wall_time_s`` the
    time of this session's loop; ``compile_time_s`` the part spent compiling, so the
    throughput line excludes it; ``steps_run`` the steps this session ran (differs from
    ``step`` after a resume); ``outputs`` ``{label: path}`` (paths that do not exist are
    left out, so the summary never points at a missing file); ``trackers`` the objects of
    :func:`functrain.trainer.trackers.make_trackers` (their ``where()`` lines); ``notes`` more lines
    after the time (a background compile: when it took over, the rate of each path).

    Example::

        >>> print(run_summary(results_folder="/tmp/none", step=100, total_steps=100,
        ...                   final_metrics={"loss": 0.1234567}, wall_time_s=12.5, compile_time_s=2.5, steps_run=100))
        finished step 100/100: loss 0.123457
        time 12.5 s (compile 2.5 s), 10.0 steps/s after compiling
        results in /tmp/none
    """
    lines = []
    metrics = dict(final_metrics or {})
    head = f"finished step {step}" + (f"/{total_steps}" if total_steps is not None else "")
    ordered = sorted(metrics, key=lambda k: (k != "loss", k != "eval_loss", k))
    shown = [f"{k} {_value(metrics[k])}" for k in ordered if k not in ("steps_per_s",)]
    lines.append(head + (": " + ", ".join(shown) if shown else ""))
    if wall_time_s is not None:
        line = f"time {format_duration(wall_time_s)}"
        if compile_time_s is not None:
            line += f" (compile {format_duration(compile_time_s)})"
        run_time = wall_time_s - (compile_time_s or 0.0)
        if steps_run and run_time > 0:
            line += f", {steps_run / run_time:.1f} steps/s" + (" after compiling" if compile_time_s else "")
        lines.append(line)
    lines.extend(notes)
    lines.append(f"results in {os.path.abspath(results_folder)}")
    for label, path in (outputs or {}).items():
        if path and os.path.exists(path):
            lines.append(f"  {label}: {os.path.abspath(path)}")  # (every path absolute, as the folder's line)
    for tracker in trackers:
        where = getattr(tracker, "where", None)
        text = where() if callable(where) else None
        if text:
            lines.append(f"  {text}")
    return "\n".join(lines)


def schedule_change(saved: Any, config: Any, step: int, logged: tuple | None = None) -> str | None:
    """What a resume with a changed schedule does to the lr, in words, or ``None`` when the lr at ``step`` is the
    same: the built-in lr (:func:`~functrain.trainer.build.config_lr`) is a function of the step and of the run's
    length (``train_num_steps``), so a run resumed with another length follows the schedule of the new length from
    ``step`` on, as a run started with it would be there: its warm-up is not run again (``step`` is past it), but
    the decay is stretched over the new length, so the lr goes back up near its peak (the convention of Hugging
    Face's Trainer, which rebuilds its scheduler for the new ``max_steps`` on resume). ``saved``, ``config``: the
    checkpoint's :class:`~functrain.TrainConfig` and this run's; ``logged``: the last ``(step, lr)`` the run logged,
    if known: an lr that is not the config's schedule's (``Trainer(optimizer=...)`` brings its own) says nothing.

    Example::

        >>> import functrain as ft
        >>> old = ft.TrainConfig(train_num_steps=400, lr_schedule="warmup_cosine", warmup_steps=40, train_lr=1e-3,
        ...                      min_lr=1e-4)
        >>> print(schedule_change(old, old.replace(train_num_steps=3000), 400))
        lr schedule: warmup_cosine over train_num_steps 3000 (was 400): the next update's lr is 0.000968 (the old \
schedule's: 0.0001), decaying to min_lr 0.0001 at step 3000 (the schedule is a function of the step and the run's \
length: a longer run does not go on from the end of the shorter one's)
    """
    if all(getattr(saved, k) == getattr(config, k) for k in _SCHEDULE):
        return None
    if logged is not None:
        at, lr = logged  # (the lr logged at step n is the schedule's at count n - 1: the update that made step n)
        expected = _lr_at(saved, int(at) - 1)
        if expected is None or not math.isclose(float(lr), expected, rel_tol=1e-4, abs_tol=1e-12):
            return None  # (not the built-in schedule: the lr is the user's optimizer's)
    before, after = _lr_at(saved, step), _lr_at(config, step)
    if before is None or after is None or math.isclose(before, after, rel_tol=1e-6, abs_tol=0.0):
        return None
    if config.lr_schedule == "constant":
        return f"lr: {config.train_lr:.3g} (was {before:.3g} at step {step})"
    was = f" (was {saved.train_num_steps})" if saved.train_num_steps != config.train_num_steps else ""
    return (f"lr schedule: {config.lr_schedule} over train_num_steps {config.train_num_steps}{was}: the next "
            f"update's lr is {after:.3g} (the old schedule's: {before:.3g}), decaying to min_lr {config.min_lr:.3g} "
            f"at step {config.train_num_steps} (the schedule is a function of the step and the run's length: a "
            f"longer run does not go on from the end of the shorter one's)")


def _lr_at(config: Any, step: int) -> float | None:
    """The built-in lr of ``config`` at count ``step`` (the update after step ``step``; ``None`` if it cannot be
    computed)."""
    from .build import config_lr

    try:
        lr = config_lr(config)
        return float(lr(step)) if callable(lr) else float(lr)
    except Exception:  # noqa: BLE001 - a schedule the config cannot make: nothing to say
        return None
