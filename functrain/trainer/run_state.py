"""What one ``Trainer.train()`` call tracks between the hooks of ``ft.run``: host values only.

Kept apart from :mod:`functrain.trainer.loop` (the ``Trainer`` and its hooks): the loop reads and writes
these fields; the ranks' per-step stop vote lives here because it is state carried from step to step.
"""
from __future__ import annotations

import time
from typing import Any

import torch

from ..driver import PhaseRates

__all__ = ["RunState"]


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
