"""What the background compiler keeps per input signature, and what it answers the runner with.

:class:`Record`: one signature's compile in a run (its status, capture, job and the policy's decision), the one
table :class:`~functrain.compiler.background.BackgroundCompiler` keeps. :class:`Eager` and :class:`Ready`: its
answers to a call whose graph is not compiled yet, which :class:`~functrain.compiler.runtime.Runner` acts on.
"""
from __future__ import annotations

from typing import Any, NamedTuple

from .capture import Captured
from .jobs import Job
from .policy import Decision

__all__ = ["Record", "Eager", "Ready", "WAITING", "HELD", "COMPILING", "INSTALLED", "GAVE_UP", "DECLINED_"]

WAITING, HELD, COMPILING, INSTALLED, GAVE_UP, DECLINED_ = "waiting", "held", "compiling", "ready", "failed", "declined"
"""A record's statuses (see :class:`Record`)."""


class Eager(NamedTuple):
    """A decision: this call ran the eager step (the graph is not compiled yet, or will not be); ``new``,
    ``metrics`` are its result; ``paused``: the call did compile work on the caller's thread (the trace)."""

    new: Any
    metrics: dict
    paused: bool


class Ready(NamedTuple):
    """A decision: the graph's code is ready: the runner installs ``capture`` with ``fn`` (``None``: it compiles
    it itself, now: a package, a graph that could not be sent) and calls it; ``paused``: this call did compile
    work (the load, a wait)."""

    capture: Captured
    fn: Any
    paused: bool


class Record:
    """One input signature's compile in a run.

    Attributes:
        key: its signature key.
        status: ``"waiting"`` (seen, not traced), ``"held"`` (traced, not in the caches: waiting for the policy),
            ``"compiling"`` (a job; its own status says running, ready or failed until the ranks agree),
            ``"ready"`` (its code was handed to the runner), ``"failed"`` or ``"declined"`` (eager for the run).
        capture: the traced :class:`~functrain.compiler.capture.Captured`, or ``None``.
        job: the compile :class:`~functrain.compiler.jobs.Job`, or ``None``.
        decision: the run's :class:`~functrain.compiler.policy.Decision` for it (the same on every rank), or
            ``None``.
    """

    __slots__ = ("key", "status", "capture", "job", "decision")

    def __init__(self, key: Any) -> None:
        self.key = key
        self.status = WAITING
        self.capture: Captured | None = None
        self.job: Job | None = None
        self.decision: Decision | None = None

    def __repr__(self) -> str:
        return f"Record({self.status!r}, job={type(self.job).__name__ if self.job else None})"
