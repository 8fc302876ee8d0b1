"""When ``train()`` stops early: :class:`StopAgreement`, asked every step, and :class:`StopSignals`, what SIGTERM and
Ctrl-C do while ``train()`` runs.

A stop is wanted on a rank when a signal came or a ``should_stop`` hook said so; every rank must stop at the same
step (each saves its part of the checkpoint, and the collectives of the next step would wait forever for a rank that
left). On several processes the ranks vote at every step: :class:`~functrain.distributed.comm.Vote`, one CPU number
on a gloo group of the agreement's own, read one step later.
"""
from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any

from ..distributed import default_timeout
from ..distributed.comm import Vote, gloo_group
from ..distributed.faults import lost_steps, report_stop

__all__ = ["StopAgreement", "StopSignals"]


class StopAgreement:
    """Whether the run stops after this step: asked at every step (:meth:`agreed`), the same answer on every rank.

    A stop is wanted on this rank after :meth:`request` (a ``should_stop`` hook) or a signal (:attr:`signals`). On
    one process the run stops at the step it was wanted in. On several, every rank starts exactly one vote per
    step (:class:`~functrain.distributed.comm.Vote`, not waited for) and reads it at its next step, so the votes
    pair up by step and every rank gets the same answer at the same step, whatever the step time does: a stop
    wanted during step *k* anywhere is agreed at step *k + 1* everywhere. Reading it rarely waits: the step in
    between has synchronised the ranks already. A stop ends the voting (no vote is left pending).

    Per ``train()`` call: :meth:`begin` (signal handlers in place, nothing wanted), :meth:`agreed` each step,
    :meth:`end_vote` after the loop, :meth:`restore` at the end whatever happened.
    """

    def __init__(self, rank: int, world: int, checkpoints: Any):
        self.rank, self.world = rank, world
        self.signals = StopSignals(rank, checkpoints)
        self.requested = False  # a should_stop hook answered true on this rank
        self.group: Any = None  # gloo: the per-step votes (CPU numbers, never a device sync); made once
        self.vote: Vote | None = None  # the vote started at the previous step

    @property
    def signalled(self) -> bool:
        """A SIGTERM or Ctrl-C came to this process during this ``train()`` call."""
        return self.signals.signal is not None

    @property
    def wanted(self) -> bool:
        """This rank wants to stop (a signal or ``should_stop``)."""
        return self.requested or self.signalled

    def begin(self, clock: Any, saves: Any) -> None:
        """A ``train()`` call starts: nothing wanted yet; SIGTERM and Ctrl-C now stop it at an agreed step (its
        ``clock``: the last finished step; ``saves``: the last checkpoint written, for a second Ctrl-C's words).
        Every rank calls it (the vote's group is made at the first call)."""
        self.requested = False
        self.vote = None
        if self.world > 1 and self.group is None:
            self.group = gloo_group(default_timeout())
        self.signals.install(clock, saves)

    def request(self) -> None:
        """Stop at the next agreed step (a ``should_stop`` hook said so)."""
        self.requested = True

    def agreed(self, step: int) -> bool:
        """Whether every rank stops after ``step`` (and rank 0 says so); on several processes: whether any rank
        wanted to at the previous step, then this step's vote is started."""
        if self.world == 1:
            stop = self.wanted
        else:
            stop = False
            if self.vote is not None:
                vote, self.vote = self.vote, None
                stop = vote.result()  # a CPU number: no device sync
            if not stop:
                self.vote = Vote(self.wanted, self.group)
        if stop and self.rank == 0:
            print(f"stopping at step {step} ({self.signals.signal or 'should_stop'}): saving", flush=True)
        return stop

    def end_vote(self) -> None:
        """Wait for the vote of the last step (started by every rank) so that none is left in flight."""
        if self.vote is not None:
            vote, self.vote = self.vote, None
            vote.wait()

    def restore(self) -> None:
        """Put the signal handlers back (the end of ``train()``, whatever happened)."""
        self.signals.restore()


class StopSignals:
    """SIGTERM and Ctrl-C (SIGINT) while ``train()`` runs (installed by :meth:`install`, the previous handlers
    put back by :meth:`restore`).

    The first of them is noted (:attr:`signal`, which the :class:`StopAgreement` reads): the trainer finishes the
    step every rank agrees on, saves it and returns (:meth:`saved` then tells a launcher so). A Ctrl-C while that
    stop is under way (the grace period: the step, the vote, the save) ends this process at once without saving:
    rank 0 says on stderr which step it was at and which checkpoint is the last, so which steps are lost; the
    launcher is told the same (:func:`~functrain.distributed.faults.report_stop`), and the process dies of SIGINT
    as an interrupted program does (status 130 in a shell). No ``KeyboardInterrupt`` is raised inside a step.
    """

    def __init__(self, rank: int, checkpoints: Any):
        self.rank = rank
        self.checkpoints = checkpoints  # the CheckpointManager: which checkpoints are complete, their paths
        self.signal: str | None = None  # the name of the first signal of this train() call, if any
        self.clock: Any = None  # the run's RunClock (trainer/compiling.py): its last finished step
        self.saves: Any = None  # the run's Checkpointing (trainer/components.py): the last save it finished
        self._previous: dict = {}

    def install(self, clock: Any, saves: Any) -> None:
        """Take SIGTERM and SIGINT for this ``train()`` (the previous handlers kept for :meth:`restore`)."""
        self.signal, self.clock, self.saves = None, clock, saves
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        """Put back the handlers :meth:`install` replaced."""
        for sig, handler in self._previous.items():
            if handler is not None:  # (None: a handler not set from Python, which cannot be put back)
                signal.signal(sig, handler)
        self._previous = {}
        self.clock = self.saves = None

    def _handle(self, signum: int, frame: Any) -> None:
        if signum == signal.SIGINT and self.signal is not None:
            self._at_once()  # does not return
        if self.signal is None:
            self.signal = signal.Signals(signum).name
            if signum == signal.SIGINT and self.rank == 0:
                _say("Ctrl-C: stopping after this step (every rank at the same step) and saving it; Ctrl-C again "
                     "stops at once without saving")

    def last_checkpoint(self) -> int | None:
        """The newest complete checkpoint's step: on disk, or the last save this run finished."""
        try:
            steps = self.checkpoints.steps()
        except Exception:  # noqa: BLE001 - an unreadable folder: what this run knows
            steps = []
        saved = self.saves.saved_at if self.saves is not None and self.saves.saved_at > 0 else None
        known = [s for s in (*steps, saved) if s is not None]
        return max(known) if known else None

    def saved(self, step: int) -> None:
        """The stop's checkpoint (of ``step``) is written: tell a launcher."""
        report_stop(True, how="saved", step=step, checkpoint_step=step, checkpoint=self.checkpoints.path(step))

    def _at_once(self) -> None:
        n = self.clock.step if self.clock is not None else None
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
