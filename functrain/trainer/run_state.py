"""What one ``Trainer.train()`` call tracks between the hooks of ``ft.run``: host values only.

Kept apart from :mod:`functrain.trainer.loop` (the ``Trainer`` and its hooks): the loop reads and writes
these fields; the ranks' per-step stop vote lives here because it is state carried from step to step, and so
does :class:`StopSignals`, what SIGTERM and Ctrl-C do while ``train()`` runs.
"""
from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any, Callable

import torch

from ..distributed.faults import lost_steps, report_stop
from ..driver import PhaseRates

__all__ = ["RunState", "StopSignals"]


class RunState:
    """What one ``train()`` call tracks between the hooks of ``ft.run`` (host values only)."""

    def __init__(self, start: int, trackers: list, compiled: bool):
        self.start = self.n = self.saved_at = start
        self.trackers = trackers
        self.compiled = compiled
        self.t0 = time.perf_counter()
        self.first_at: float | None = None  # when the first step returned (after compiling)
        self.compile_s = 0.0
        self.reported: set = set()
        self.last: dict = {}  # the last logged metrics (and evaluation), for the summary
        self.unsent: tuple[int, dict] | None = None  # a log step's record, sent to the trackers after its step
        self.logged_at = start
        self.pending: list = []  # `skipped` flags (device tensors) not read yet
        self.pending_until = start  # the step of the newest pending flag
        self.in_a_row = 0  # skipped updates in a row, as of the last read
        self.rates: PhaseRates | None = None  # a background compile: each path's throughput
        self.progress: Any = None  # and its Progress
        self.memory: Any = None  # the run's MemoryLine (trainer/summary.py)
        self.pending_vote: tuple | None = None  # (work, tensor): the stop vote started at the previous step

    def vote(self, flag: bool, group: Any) -> bool:
        """Whether any rank wanted to stop at the previous step; then start this step's vote.

        Every rank starts exactly one vote per step (an all-reduce on ``group``, not waited for) and reads
        it at its next step, so votes pair up by step and every rank gets the same answer at the same step,
        whatever the step time does. Reading it rarely waits: the step in between has synchronised the
        ranks already. A stop ends the voting (no vote is left pending).
        """
        stop = False
        if self.pending_vote is not None:
            work, t = self.pending_vote
            self.pending_vote = None
            work.wait()
            stop = bool(t.numpy()[0] > 0)  # a CPU number: no device sync, no _local_scalar_dense
        if not stop:
            t = torch.tensor([1.0 if flag else 0.0])
            work = torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=group, async_op=True)
            self.pending_vote = (work, t)
        return stop

    def end_vote(self) -> None:
        """Wait for the vote of the last step (started by every rank) so that none is left in flight."""
        if self.pending_vote is not None:
            self.pending_vote[0].wait()
            self.pending_vote = None

    def emit(self, step: int, metrics: dict) -> None:
        """Send one record to every tracker."""
        for t in self.trackers:
            t.log(step, metrics)

    def first_done(self, now: float) -> None:
        """Note when the first step (which compiles) returned; later calls change nothing."""
        if self.first_at is None:
            self.first_at, self.compile_s = now, now - self.t0


class StopSignals:
    """SIGTERM and Ctrl-C (SIGINT) while ``train()`` runs (installed by :meth:`install`, the previous handlers
    put back by :meth:`restore`).

    The first of them calls ``on_stop``: the trainer finishes the step every rank agrees on, saves it and
    returns (:meth:`saved` then tells a launcher so). A Ctrl-C while that stop is under way (the grace period:
    the step, the vote, the save) ends this process at once without saving: rank 0 says on stderr which step it
    was at and which checkpoint is the last, so which steps are lost; the launcher is told the same
    (:func:`~functrain.distributed.faults.report_stop`), and the process dies of SIGINT as an interrupted
    program does (status 130 in a shell). No ``KeyboardInterrupt`` is raised inside a step.
    """

    def __init__(self, on_stop: Callable[[], None], rank: int, checkpoints: Any):
        self.on_stop = on_stop
        self.rank = rank
        self.checkpoints = checkpoints  # the CheckpointManager: which checkpoints are complete, their paths
        self.signal: str | None = None  # the name of the first signal of this train() call, if any
        self.run: RunState | None = None
        self._previous: dict = {}

    def install(self, run: RunState) -> None:
        self.signal, self.run = None, run
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            if handler is not None:  # (None: a handler not set from Python, which cannot be put back)
                signal.signal(sig, handler)
        self._previous = {}
        self.run = None

    def _handle(self, signum: int, frame: Any) -> None:
        if signum == signal.SIGINT and self.signal is not None:
            self._at_once()  # does not return
        if self.signal is None:
            self.signal = signal.Signals(signum).name
            if signum == signal.SIGINT and self.rank == 0:
                _say("Ctrl-C: stopping after this step (every rank at the same step) and saving it; Ctrl-C again "
                     "stops at once without saving")
        self.on_stop()

    def last_checkpoint(self) -> int | None:
        """The newest complete checkpoint's step: on disk, or the last save this run finished."""
        try:
            steps = self.checkpoints.steps()
        except Exception:  # noqa: BLE001 - an unreadable folder: what this run knows
            steps = []
        saved = self.run.saved_at if self.run is not None and self.run.saved_at > 0 else None
        known = [s for s in (*steps, saved) if s is not None]
        return max(known) if known else None

    def saved(self, step: int) -> None:
        """The stop's checkpoint (of ``step``) is written: tell a launcher."""
        report_stop(True, how="saved", step=step, checkpoint_step=step, checkpoint=self.checkpoints.path(step))

    def _at_once(self) -> None:
        n = self.run.n if self.run is not None else None
        last = self.last_checkpoint()
        path = self.checkpoints.path(last) if last is not None else None
        at = f" (the last finished step: {n})" if n is not None else ""
        if last is None:
            lost = "; there is no checkpoint: every finished step is lost"
        else:
            lost = f"; the last checkpoint is step {last} ({path}): {lost_steps(last, n)}"
        written = last is not None and n is not None and last >= n  # (the stop's save had finished)
        report_stop(written, how="at_once", step=n, checkpoint_step=last, checkpoint=path)
        if self.rank == 0:
            _say(f"second Ctrl-C: stopped at once without saving{at}{lost}")
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a write in progress (we interrupted it) or a closed stream
                pass
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)  # dies of the signal: no traceback, no teardown (the lock is the kernel's)
        time.sleep(5.0)  # (the signal is delivered at once; this line is not reached)
        os._exit(128 + int(signal.SIGINT))


def _say(line: str) -> None:
    """One line on stderr from a signal handler (os.write: no buffered stream that the handler interrupted)."""
    try:
        os.write(2, (line + "\n").encode())
    except OSError:
        pass
