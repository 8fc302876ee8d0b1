"""``ft.run``: the minimal training loop around a (compiled) step; :func:`run_steps`, the same loop as an iterator."""
from __future__ import annotations

import contextlib
import io
import itertools
import logging
import math
import os
import signal
import sys
import threading
from typing import Any, Callable, Iterable

import optree
import torch
import torch.distributed as dist

from .compiler import CompiledStep, DynamoRunner, PhaseRates, Runner
from .compiler.profiling import Profile, Profiler, profile_request
from .core.state import TrainState
from .core.step import Step

__all__ = ["run", "run_steps", "Steps", "to_device", "PhaseRates", "Profile"]


def to_device(batch: Any, device: torch.device | str) -> Any:
    """Move every tensor (and numpy array) leaf of ``batch`` to ``device`` without blocking the host.

    Args:
        batch: a pytree of tensors, numpy arrays and other values (left as they are).
        device: the target device.

    Returns:
        The same structure with every tensor on ``device`` (numpy arrays become tensors).

    Example::

        >>> import numpy as np, torch, functrain as ft
        >>> out = ft.to_device({"x": np.ones(2, dtype=np.float32), "n": 3}, "cpu")
        >>> out["x"], out["n"]
        (tensor([1., 1.]), 3)
    """
    device = torch.device(device)

    def move(x: Any) -> Any:
        if type(x).__module__ == "numpy" and hasattr(x, "__array__"):
            x = torch.from_numpy(x)
        if torch.is_tensor(x) and x.device != device:
            return x.to(device, non_blocking=True)
        return x

    return optree.tree_map(move, batch)


def _to_host(metrics: dict) -> dict:
    """One pull of all metrics to the host (the only sync the driver makes)."""
    out = {}
    for k, v in metrics.items():
        v = v.detach().cpu() if torch.is_tensor(v) else v
        out[k] = v.item() if torch.is_tensor(v) and v.numel() == 1 else (v.tolist() if torch.is_tensor(v) else v)
    return out


def run(step: Callable[[TrainState, Any], tuple[TrainState, dict]], state: TrainState, data: Iterable,
        num_steps: int | None = None, *, log_every: int = 50, device: torch.device | str | None = None,
        progress: bool = True, on_log: Callable[[int, dict], None] | None = None,
        donate: bool = True, on_step: Callable[[int, TrainState, dict], bool | None] | None = None,
        start: int = 0, profile: str | os.PathLike | Profile | None = None) -> TrainState:
    """Run ``step`` over ``data`` and return the final state.

    Batches are moved to ``device`` (default: where the state lives). Metrics
    stay on the device except every ``log_every`` steps (and the last step),
    when they are pulled to the host once, shown on the progress bar (tqdm,
    when installed and ``progress``) and passed to ``on_log(step_index,
    metrics)``; other steps make no device-to-host sync. With ``num_steps``
    the data is iterated again (epochs) until that many steps ran, if it can be;
    without it, one pass.

    ``run`` owns the states it passes from step to step, so with a compiled step
    (``ft.compile``) it donates them by default (``donate=True``): it runs the step on a
    runner of its own (:meth:`functrain.CompiledStep.runner` with ``donate=True,
    background=True``), and each step writes the new state into the previous one's
    buffers instead of allocating a new state. The ``state`` you pass in is copied once
    first and is never written; the returned state is yours. ``donate=False`` calls the
    step as given. Eager steps are always called as given. A runner you made yourself
    (``step=cstep.runner(...)``: to read its ``progress`` and ``rates`` afterwards, as
    the Trainer does) is run as it is (its state copied once if it donates).

    A compiled step compiles in the background here (unless ``ft.compile(step,
    background=False)`` said otherwise; see :mod:`functrain.compiler.background`): the
    first steps run eagerly while the compile runs, the compiled code takes over when
    it is ready. The progress bar says so and shows the eager rate, then the compiled
    one; no step that waited for compile work counts in its rate or ETA.

    Hooks (:func:`run_steps` is the same loop as an iterator, with no hooks: what
    :class:`functrain.Trainer` is built on):

    * ``start``: the index of the step before the first one run here (a
      resumed run passes its step count): steps are numbered ``start + 1``,
      ``start + 2``, ...; log steps are those indices divisible by ``log_every``
      (and the last); the progress bar counts from ``start`` to
      ``start + num_steps``.
    * ``on_step(index, state, metrics) -> stop``: called after every step (after
      ``on_log`` on a log step) with the new state and the step's metrics *on the
      device*; it must not read them to the host if the loop is to stay
      sync-free (append them to a list, compare host counters). A true return
      value ends the loop after this step (a step that was not a log step is then
      logged). The state is only valid during the call when steps donate their
      input (keep no reference to it). On several processes (a ``data_parallel``
      step) a true value on any rank stops every rank after this same step
      (:meth:`Steps.stop_agreed`: one host vote per step; a dead rank raises).

    The bar is drawn on the main process only (rank 0) and left on screen with the
    final rates; while it is up, ``print``, warnings and the root logger's console
    handlers write above it. ``profile`` (a trace file path, or a
    :class:`~functrain.compiler.profiling.Profile`) records steps on rank 0 into a
    Chrome trace by step, phase and stage and prints a table of time per stage.

    Ctrl-C: ``run`` does not save, so it ends with ``KeyboardInterrupt``, raised by
    ``run`` itself after the step in flight (not from deep inside the step); a second
    Ctrl-C raises it at once. (Only where Python's own Ctrl-C handler is in place, in
    the main thread: a handler of yours, or ``ft.Trainer``'s, which saves, is left alone.)

    Example::

        state = ft.run(ft.compile(step), state, loader, num_steps=1000, log_every=100)
        stop = lambda i, state, metrics: time.monotonic() > deadline
        state = ft.run(step, state, loader, num_steps=1000, on_step=stop)

    Args:
        step: a step (eager or ``ft.compile``d): ``step(state, batch) -> (state, metrics)``.
        state: the initial state (copied once when donating; never written).
        data: an iterable of batches (a loader, a list).
        num_steps: how many steps to run (iterating ``data`` again as needed); ``None``: one pass.
        log_every: pull the metrics to the host every this many steps (and at the last).
        device: where batches go (``None``: the state's device).
        progress: show a tqdm bar when tqdm is installed.
        on_log: ``on_log(step_index, host_metrics)`` on log steps.
        donate: let a compiled step write each new state into the previous one's buffers.
        on_step: ``on_step(index, state, device_metrics) -> stop`` after every step.
        start: the index of the step before the first one run here (a resumed run's step count).
        profile: ``None``, a trace file path (the first 10 steps) or a ``Profile``.

    Returns:
        The final state.

    As a doctest::

        >>> import torch, functrain as ft
        >>> step = ft.train_step(lambda p, b, x: (p["w"] - x).pow(2).mean(), ft.optim.sgd(0.5))
        >>> state = ft.run(step, step.init({"w": torch.zeros(2)}), [torch.ones(2)] * 10, progress=False)
        >>> int(state.step), [round(v, 3) for v in state.params["w"].tolist()]   # 1 - 2 ** -10
        (10, [0.999, 0.999])
    """
    _check(num_steps, log_every, start, donate, state, on_log=on_log, on_step=on_step)
    with run_steps(step, state, data, num_steps, log_every=log_every, device=device, progress=progress,
                   donate=donate, start=start, profile=profile) as steps:
        for i, new, metrics, host in steps:
            if host is not None and on_log is not None:
                on_log(i, host)
            if on_step is not None and steps.stop_agreed(bool(on_step(i, new, metrics))):
                break
        if steps.interrupted:  # (the state is not returned: run saves nothing)
            raise KeyboardInterrupt(f"Ctrl-C: ft.run stopped after step {steps.index}")
        if not steps.logged:  # a stop (or the end of data of unknown length) between log steps
            host = steps.log()
            if on_log is not None:
                on_log(steps.index, host)
        if steps.runner is not None:  # a normal end: a compile still running may finish for the next run
            steps.runner.finish_after_exit()
    return steps.state


def run_steps(step: Callable[[TrainState, Any], tuple[TrainState, dict]], state: TrainState, data: Iterable,
              num_steps: int | None = None, *, log_every: int = 50, device: torch.device | str | None = None,
              progress: bool = True, donate: bool = True, start: int = 0,
              profile: str | os.PathLike | Profile | None = None) -> "Steps":
    """:func:`run`'s loop as an iterator: ``for index, state, metrics, host in steps`` (a :class:`Steps`).

    The same loop as ``ft.run`` (it is a thin loop over this one): batches moved to ``device``, the donation
    of the states it owns (the ``state`` you pass is copied once and never written), the host read of the
    metrics every ``log_every`` steps and at the last (``host``: the metrics as Python numbers; ``None`` on
    the other steps, which make no device-to-host sync), the progress bar, and Ctrl-C: the step in flight
    finishes, then the iteration ends with :attr:`Steps.interrupted` set (``ft.run`` then raises
    ``KeyboardInterrupt``; a second Ctrl-C raises at once), only where Python's own Ctrl-C handler is in place.

    Each item is ``(index, state, metrics, host)``: the step's number (``start + 1``, ``start + 2``, ...), the
    new state (valid until the next step when steps donate: keep no reference to it), the step's metrics on
    the device, and ``host``. Leaving the loop early (``break``) is a stop: :meth:`Steps.log` then reads that
    step's metrics if it was not a log step. Use it in a ``with`` block, which closes the bar and puts back
    Python's Ctrl-C handler (and ``sys.stdout`` / ``sys.stderr``: lines go above the bar while it is up) however the
    loop ends (an exhausted or failing loop closes them itself). The bar is rank 0's; ``profile`` is :func:`run`'s.

    Example::

        >>> import torch, functrain as ft
        >>> from functrain.driver import run_steps
        >>> step = ft.train_step(lambda p, b, x: (p["w"] - x).pow(2).mean(), ft.optim.sgd(0.5))
        >>> data = iter([torch.ones(2)] * 10)   # an iterator: its length is unknown
        >>> with run_steps(step, step.init({"w": torch.zeros(2)}), data, log_every=4, progress=False) as steps:
        ...     for i, state, metrics, host in steps:
        ...         if host is not None:
        ...             print(i, round(host["loss"], 4))
        4 0.0156
        8 0.0001
        >>> steps.logged, int(steps.state.step)   # step 10, the last, was not a log step: not read yet
        (False, 10)
    """
    _check(num_steps, log_every, start, donate, state)
    return Steps(step, state, data, num_steps, log_every, device, progress, donate, start, profile_request(profile))


def _check(num_steps: Any, log_every: Any, start: Any, donate: Any, state: Any, **hooks: Any) -> None:
    """The arguments of :func:`run` / :func:`run_steps` (``hooks``: run's ``on_log`` and ``on_step``)."""
    if num_steps is not None and (isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 0):
        raise ValueError(f"run: num_steps must be an int >= 0 or None; got {num_steps!r}")
    if isinstance(log_every, bool) or not isinstance(log_every, int) or log_every < 1:
        raise ValueError(f"run: log_every must be an int >= 1; got {log_every!r}")
    if isinstance(start, bool) or not isinstance(start, int) or start < 0:
        raise ValueError(f"run: start must be an int >= 0 (the steps already taken); got {start!r}")
    for name, hook in hooks.items():
        if hook is not None and not callable(hook):
            raise TypeError(f"run: {name} must be callable or None; got {type(hook).__name__}")
    if not isinstance(state, TrainState):
        raise TypeError(f"run: state must be a functrain TrainState (from step.init); got {type(state).__name__}")
    if not isinstance(donate, bool):
        raise TypeError(f"run: donate must be a bool; got {type(donate).__name__}")


class Steps:
    """The loop of :func:`run_steps` (and of :func:`run`): iterate it for ``(index, state, metrics, host)``.

    Attributes:
        index: the number of the last step run (``start`` before the first).
        state: the last step's state (the copy of the initial state before the first).
        logged: whether the last step's metrics were read to the host (a log step, or :meth:`log`).
        interrupted: Ctrl-C ended the iteration (after the step in flight).
        runner: the :class:`~functrain.compiler.Runner` (or ``DynamoRunner``) it runs, else ``None``.
        profiler: the :class:`~functrain.compiler.profiling.Profiler` of ``profile=`` (the main process), else
            ``None``.
    """

    def __init__(self, step: Any, state: TrainState, data: Iterable, num_steps: int | None, log_every: int,
                 device: Any, progress: bool, donate: bool, start: int, profile: Profile | None = None):
        self.device = torch.device(device) if device is not None else state.step.device
        if donate and isinstance(step, CompiledStep):
            step = step.runner(donate=True, background=True)  # the loop's own runner (it owns the states)
            owned = True
        else:
            owned = donate and isinstance(step, (Runner, DynamoRunner)) and _donates(step)
        if owned:  # one copy of the caller's state, then every state is the loop's own, donated to the next step
            state = optree.tree_map(lambda x: x.clone() if torch.is_tensor(x) else x, state)
        self.step, self.state, self.data, self.log_every = step, state, data, log_every
        self.runner = step if isinstance(step, (Runner, DynamoRunner)) else None
        inner = step.step if isinstance(step, (CompiledStep, Runner, DynamoRunner)) else step
        self.spans: Step | None = inner if isinstance(inner, Step) else None  # its agree(): the ranks it spans
        main = _main_process()
        self.profiler = Profiler(profile, self.runner, step) if profile is not None and main else None
        progress = progress and main  # one bar per job: rank 0's
        count = num_steps if num_steps is not None else _len(data)
        self.total = None if count is None else start + count
        if self.runner is not None:  # what a background compile's policy weighs the compile against
            self.runner.expect(count)
        self.num_steps, self.progress, self.start = num_steps, progress, start
        self.index = self.counted = start  # the last step run; the last one the bar counted
        self.logged = True  # (no step to read yet)
        self.interrupted = False
        self.metrics: dict | None = None
        self.batches: Any = None
        self.bar: Any = None
        self.shown = [0.0, None]  # when the bar's description was last refreshed, and the phase it showed
        self.ctrl_c: _CtrlC | None = None
        self.console = contextlib.ExitStack()  # while the bar is up: printed lines go above it
        self.opened = self.closed = False

    def __enter__(self) -> "Steps":
        self._open()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __iter__(self) -> "Steps":
        return self

    def __next__(self) -> tuple[int, TrainState, dict, dict | None]:
        if self.closed:
            raise StopIteration
        self._open()
        try:
            self._count()
            if self.ctrl_c is not None and self.ctrl_c.pressed:
                self.interrupted = True
                raise StopIteration
            batch = next(self.batches)  # (StopIteration: the data or num_steps is done)
            i = self.index + 1
            with self.profiler.step(i) if self.profiler is not None else contextlib.nullcontext():
                self.state, self.metrics = self.step(self.state, to_device(batch, self.device))
            self.index, self.logged = i, False
            host = self.log() if i % self.log_every == 0 or i == self.total else None
            return i, self.state, self.metrics, host
        except StopIteration:
            if not self.interrupted:  # the end (interrupted: the caller acts on it, then closes)
                self.close()
            raise
        except BaseException:
            self.close()
            raise

    def log(self) -> dict:
        """Read the last step's metrics to the host (one pull of them all), show them on the bar, and return them
        (``{name: number}``; a metric of several elements as a list): what a log step's ``host`` is."""
        if self.metrics is None:
            raise ValueError("Steps.log: no step has run yet")
        host = _to_host(self.metrics)
        if self.bar is not None:
            self.bar.set_postfix({k: f"{v:.4g}" for k, v in host.items() if isinstance(v, float) and math.isfinite(v)},
                                 refresh=False)
        self.logged = True
        return host

    def stop_agreed(self, wanted: bool) -> bool:
        """Whether to stop after this step: ``wanted`` on any process the step spans (its ``data_parallel``
        group: :meth:`functrain.core.step.Step.agree`, one host all-reduce of an int on gloo, no device sync),
        so that every process stops at the same step; on one process (or a step that spans none) ``wanted``
        itself, with no collective. Every process the step spans calls it once per step (``ft.run`` does when
        it has ``on_step``). A process that died, or stopped calling it, makes the others raise
        ``RuntimeError`` (within the group's timeout, ``FUNCTRAIN_DIST_TIMEOUT``) instead of waiting forever."""
        if self.spans is None:
            return bool(wanted)
        try:
            return self.spans.agree(0 if wanted else 1) == 0
        except RuntimeError as e:
            raise RuntimeError(f"ft.run: the processes could not agree whether to stop after step {self.index} "
                               f"(another process died, or does not call ft.run with on_step): {e}") from e

    def close(self) -> None:
        """Count the last step on the bar and close it; put back Python's Ctrl-C handler (again: nothing)."""
        if self.closed:
            return
        self.closed = True
        try:
            if not self.interrupted:
                self._count()
        finally:
            try:
                if self.ctrl_c is not None:
                    self.ctrl_c.restore()
                if self.profiler is not None:
                    self.profiler.close()
            finally:
                self._finish_bar()

    def _open(self) -> None:
        if self.opened:
            return
        self.opened = True
        self.batches = iter(_batches(self.data, self.num_steps))
        self.bar = _progress(self.total, self.start, self.runner is not None) if self.progress else None
        if self.bar is not None:
            _above_bar(self.console, self.bar)
        self.ctrl_c = _CtrlC.install()

    def _count(self) -> None:
        """The bar after the last step (once): leave compile work out of its rate, count the step."""
        if self.bar is not None and self.counted != self.index:
            if self.runner is not None:
                _show(self.bar, self.runner, self.shown)
            self.bar.update(1)
        self.counted = self.index

    def _finish_bar(self) -> None:
        """Leave the bar on screen with the final rates, and give the streams back."""
        if self.bar is not None:
            bar, self.bar = self.bar, None
            try:
                if self.runner is not None:
                    _show(bar, self.runner, self.shown, final=True)
                bar.close()
            finally:
                self.console.close()


class _CtrlC:
    """Ctrl-C during :func:`run`: noted, acted on by the loop after the step in flight; a second one raises at once."""

    def __init__(self) -> None:
        self.pressed = False

    @classmethod
    def install(cls) -> "_CtrlC | None":
        if threading.current_thread() is not threading.main_thread() or \
                signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
            return None
        ctrl = cls()
        signal.signal(signal.SIGINT, ctrl._handle)
        return ctrl

    def _handle(self, signum: int, frame: Any) -> None:
        if self.pressed:
            raise KeyboardInterrupt("second Ctrl-C: ft.run stopped at once")
        self.pressed = True
        try:
            os.write(2, b"Ctrl-C: ft.run stops after this step (Ctrl-C again stops at once)\n")
        except OSError:
            pass

    def restore(self) -> None:
        if signal.getsignal(signal.SIGINT) == self._handle:  # (not if someone installed another since)
            signal.signal(signal.SIGINT, signal.default_int_handler)


def _donates(runner: Any) -> bool:
    """Whether ``runner`` writes each new state into its input's buffers (it needs a state of its own)."""
    return runner.memory != "fresh" if isinstance(runner, Runner) else runner.call.donate


def _show(bar: Any, runner: Any, shown: list, final: bool = False) -> None:
    """Leave a call that did compile work out of the bar's time; refresh its description (at most twice a second:
    ``shown[0]``, when it was last; at once when the phase changed, ``shown[1]``; and at the end, ``final``)
    from the runner's rate meter and progress: each
    path's label with its rate, and an ETA only from the rate of the path that will run (none while a compile
    is pending, since the compiled rate is not known yet; the eager rate's while nothing compiles)."""
    rates, progress = runner.rates, runner.progress
    if rates.paused:
        bar.unpause()  # tqdm: the time since its last print is not counted
    changed = progress.phase != shown[1]
    if final or rates.last - shown[0] >= 0.5 or rates.paused or changed:
        shown[0], shown[1] = rates.last, progress.phase  # (a new phase is drawn at once, however brief)
        text = rates.describe(progress if progress.background else None)
        if not text and rates.path is not None:  # one path so far
            rate = rates.rate(rates.path)
            text = f"{rates.path} {rate:.3g} it/s" if rate is not None else f"{rates.path} ? it/s"
        # the path that will run: eager while nothing compiles (none started, or declined) or after a failed compile
        ahead = rates.rate("eager" if progress.phase in ("eager", "failed") else "compiled")
        if not final and ahead is not None and bar.total is not None and bar.total > bar.n:
            text += f" · ETA {bar.format_interval((bar.total - bar.n) / ahead)}"
        bar.set_description_str(text, refresh=False)


class _AboveBar(io.TextIOBase):
    """A stream whose lines go above the progress bar: the bar is cleared, the line written to ``stream``, the bar
    drawn again (a line still without its newline waits for it, or for the end of the run)."""

    def __init__(self, bar: Any, stream: Any):
        super().__init__()
        self.bar, self.stream, self.pending = bar, stream, ""

    def write(self, text: str) -> int:
        self.pending += text
        if "\n" in self.pending:
            done, _, self.pending = self.pending.rpartition("\n")
            self.put(done + "\n")
        return len(text)

    def put(self, text: str) -> None:
        self.bar.clear()
        self.stream.write(text)
        self.stream.flush()
        self.bar.refresh()

    def flush(self) -> None:
        self.stream.flush()

    def close_line(self) -> None:
        """The run ends: a line left without its newline is written as it is."""
        if self.pending:
            text, self.pending = self.pending, ""
            self.put(text)

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return self.stream.isatty()

    def fileno(self) -> int:
        return self.stream.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return self.stream.encoding


def _above_bar(stack: contextlib.ExitStack, bar: Any) -> None:
    """While the bar is up (until ``stack`` closes, however the run ends): ``print``, warnings and the root
    logger's console handlers write above the bar instead of onto its line."""
    out, err = _AboveBar(bar, sys.stdout), _AboveBar(bar, sys.stderr)
    stack.callback(out.close_line)
    stack.callback(err.close_line)
    stack.enter_context(contextlib.redirect_stdout(out))
    stack.enter_context(contextlib.redirect_stderr(err))
    for handler in logging.getLogger().handlers:
        if type(handler) is logging.StreamHandler and handler.stream in (out.stream, err.stream):
            previous = handler.setStream(out if handler.stream is out.stream else err)
            stack.callback(handler.setStream, previous)


def _batches(data: Iterable, num_steps: int | None) -> Iterable:
    if num_steps is None:
        return iter(data)
    if iter(data) is data:  # an iterator: one pass, at most num_steps
        return itertools.islice(data, num_steps)

    def epochs():
        n = 0
        while True:
            empty = True
            for batch in data:
                empty = False
                if n == num_steps:
                    return
                yield batch
                n += 1
            if empty or n == num_steps:
                return

    return epochs()


def _len(data: Any) -> int | None:
    try:
        return len(data)
    except TypeError:
        return None


def _progress(total: int | None, initial: int = 0, phases: bool = False) -> Any:
    """The bar (tqdm's, when installed), left on screen at the end. ``phases``: a runner's bar, whose description
    holds each path's rate and the ETA (tqdm's own average would mix the eager and compiled paths)."""
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    form = None
    if phases:
        form = ("{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]" if total
                else "{desc} {n_fmt} [{elapsed}{postfix}]")
    return tqdm(total=total, initial=initial, dynamic_ncols=True, leave=True, bar_format=form)


def _main_process() -> bool:
    """Rank 0 of the default process group, or no group: where the bar is drawn and the profile recorded (torch's
    own answer: the loop sits beside ``distributed/``, which it does not import)."""
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
