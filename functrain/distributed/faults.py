"""Why a multi-process job failed, and which rank to blame: shared by both launchers.

Both ``ft.launch`` (:mod:`.spawn`) and ``python -m functrain.launch`` (:mod:`.cli`)
describe how each rank ended as a :class:`RankEnd` and ask :func:`root_cause` for
the rank that failed first *for a reason of its own*. The rules, in order:

1. a rank that raised its own error (not a lost connection, not a timeout);
2. a rank that exited with a non-zero status without a Python error, or was
   killed by a signal other than SIGTERM (SIGKILL, the OOM killer, a segfault);
3. a rank that *finished* (status 0) before any other rank failed, while they
   still ran: its peers' next collective fails without it ("Connection closed
   by peer"), so it left early (fewer steps or batches than the others?);
4. when some rank timed out waiting for a peer in a collective: a rank that was
   still running then (or stopped by the launcher's SIGTERM): the rank that
   did not arrive, i.e. the hung one;
5. a rank that failed only because of a peer: its connection closed, or a
   collective timed out waiting for it;
6. a rank the launcher stopped because others had failed.

Ties go to the earliest failure, then the lowest rank. :func:`die_with_parent`
is the other half of "leave nothing behind": each rank calls it at start so it
dies when its launcher dies, even by SIGKILL.
"""
from __future__ import annotations

import math
import os
import signal
import sys
import threading
from dataclasses import dataclass
from typing import Iterable

__all__ = ["LOST_PEER", "PEER_TIMEOUT", "PeerFailed", "cause_of", "RankEnd", "root_cause", "left_early", "describe_end",
           "die_with_parent"]

# What a rank raises when a peer died first (its connection to that peer is gone).
LOST_PEER = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
             "NCCL communicator was aborted")
# What a rank raises when a peer did not arrive at a collective in time (gloo, NCCL's watchdog, the store).
PEER_TIMEOUT = ("Timed out waiting", "Watchdog caught collective operation timeout", "Wait timeout",
                "Socket Timeout")

OWN, LOST, TIMEOUT = "own", "lost_peer", "peer_timeout"


class PeerFailed(RuntimeError):
    """This rank stops because another rank failed first, which reports its own error: a secondary failure.

    Raised where the ranks agree on an outcome (the results folder's lock, which checkpoint to resume) and
    another rank's part failed; :func:`cause_of` counts it as a lost peer, so the launchers blame the rank
    whose own error this is, never this one.

    Example::

        >>> from functrain.distributed.faults import PeerFailed, cause_of
        >>> cause_of(PeerFailed("rank 0 could not lock the results folder (see its error)"))
        'lost_peer'
    """

    __module__ = "functrain.distributed"  # its public home, in reprs and tracebacks


def cause_of(error: BaseException | str | None) -> str:
    """``"lost_peer"``, ``"peer_timeout"`` or ``"own"``: why a rank's error happened.

    An exception is judged with everything it was raised from (``__cause__`` and
    ``__context__``); a string (a traceback's text) by its content.

    Example::

        >>> cause_of(RuntimeError("[pair.cc:534] Read error: Connection reset by peer"))
        'lost_peer'
        >>> cause_of("RuntimeError: ... Timed out waiting 2000ms for recv operation to complete")
        'peer_timeout'
        >>> cause_of(KeyError("x"))
        'own'
    """
    texts = []
    if isinstance(error, BaseException):
        seen = set()
        e: BaseException | None = error
        while e is not None and id(e) not in seen:
            seen.add(id(e))
            texts.append(str(e))
            e = e.__cause__ or e.__context__
    elif error:
        texts.append(str(error))
    text = "\n".join(texts)
    if any(m in text for m in LOST_PEER):
        return LOST
    if any(m in text for m in PEER_TIMEOUT):
        return TIMEOUT
    if isinstance(error, BaseException) and _chain_has(error, PeerFailed):
        return LOST
    if isinstance(error, str) and "PeerFailed:" in error:  # a traceback's text
        return LOST
    return OWN


def _chain_has(error: BaseException, kind: type) -> bool:
    seen = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        if isinstance(e, kind):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


@dataclass(frozen=True)
class RankEnd:
    """How one rank ended.

    ``how``: ``"error"`` (it reported a Python exception; ``cause`` says whose fault),
    ``"exit"`` (a non-zero exit status ``code`` without a report), ``"signal"``
    (killed by signal ``code``), ``"running"`` (still running when the job was
    stopped) or ``"done"`` (finished with status 0). ``time`` is when it ended
    (``time.time()``; unknown: inf; a ``"done"`` rank with a known time that is
    earlier than every failure left early, rule 3 of the module doc).

    Example::

        >>> RankEnd(1, "signal", code=9)
        RankEnd(rank=1, how='signal', cause='own', code=9, time=inf, message='')
    """

    rank: int
    how: str
    cause: str = OWN
    code: int = 0
    time: float = math.inf
    message: str = ""


def _tier(end: RankEnd, someone_timed_out: bool, first_failure: float) -> int:
    if end.how == "error":
        return 0 if end.cause == OWN else 4
    if end.how == "exit" or (end.how == "signal" and end.code != signal.SIGTERM):
        return 1
    if end.how == "done":  # finished before anyone failed: left its peers in a collective without it
        return 2 if end.time < first_failure else 6
    if end.how in ("running", "signal"):  # still running, or stopped by the launcher's SIGTERM
        return 3 if someone_timed_out else 5
    return 6


def _first_failure(ends: list[RankEnd]) -> float:
    """When the first rank that did not finish ended (inf: none did, or the times are unknown)."""
    return min((e.time for e in ends if e.how != "done"), default=math.inf)


def left_early(end: RankEnd, ends: Iterable[RankEnd]) -> bool:
    """Whether ``end`` finished (status 0) before any other rank of ``ends`` failed (rule 3).

    Example::

        >>> ends = [RankEnd(0, "error", cause="lost_peer", time=9.0), RankEnd(1, "done", time=5.0)]
        >>> left_early(ends[1], ends), left_early(ends[0], ends)
        (True, False)
    """
    ends = list(ends)
    return end.how == "done" and end.time < _first_failure(ends)


def root_cause(ends: Iterable[RankEnd]) -> RankEnd:
    """The rank that failed first for a reason of its own (the rules are in the module doc).

    Example::

        >>> root_cause([RankEnd(0, "error", cause="peer_timeout", time=5.0), RankEnd(1, "running")]).rank
        1
    """
    ends = list(ends)
    if not ends:
        raise ValueError("root_cause: no ranks given")
    timed_out = any(e.how == "error" and e.cause == TIMEOUT for e in ends)
    first = _first_failure(ends)
    return min(ends, key=lambda e: (_tier(e, timed_out, first), e.time, e.rank))


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(code).name
    except ValueError:
        return f"signal {code}"


def describe_end(end: RankEnd, ends: Iterable[RankEnd] = (), dist_timeout: float | None = None) -> str:
    """One line on how ``end`` ended, as the launchers print it ("rank 1 ..." follows)."""
    ends = list(ends)
    waiting = sorted(e.rank for e in ends if e.how == "error" and e.cause == TIMEOUT)
    if end.how in ("running", "signal") and waiting:  # with a peer timed out waiting: the hung rank, stopped
        within = f" within the collective timeout ({dist_timeout:g} s)" if dist_timeout else ""
        stopped = ("; it was then stopped" if end.how == "running" else
                   f"; it was then stopped ({_signal_name(end.code)})")
        return (f"did not arrive at a collective{within}: it was still running (hung?) when rank(s) "
                f"{', '.join(map(str, waiting))} timed out waiting for it{stopped}")
    if end.how == "error":
        what = {OWN: "", LOST: " (it lost its connection to a peer)",
                TIMEOUT: " (a collective timed out waiting for a peer)"}[end.cause]
        return f"failed: {end.message}{what}"
    if end.how == "signal":
        return f"was killed by signal {end.code} ({_signal_name(end.code)})"
    if end.how == "exit":
        return f"exited with code {end.code} without a Python traceback"
    if left_early(end, ends):
        still = sorted(e.rank for e in ends if e.how != "done")
        return (f"finished (exit status 0) while rank(s) {', '.join(map(str, still))} were still running: they "
                f"then failed in a collective without it (did it run fewer steps or batches than the others?)")
    if end.how == "running":
        return "was still running when the job was stopped"
    return "finished"


# --------------------------------------------------------------------------- die with the launcher

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int | None = None) -> str:
    """Make this process die (SIGKILL) when its parent dies; return how: ``"prctl"`` or ``"watchdog"``.

    On Linux the kernel's parent-death signal (``prctl(PR_SET_PDEATHSIG)``) does
    it, even when the parent is SIGKILLed. If the parent already died before the
    call (the race between start and ``prctl``), ``os.getppid()`` no longer is
    ``parent_pid`` and the process exits at once. Elsewhere a daemon thread polls
    ``os.getppid()`` once a second. A rank that outlives its launcher would go on
    writing checkpoints that a relaunch then races with.

    Example::

        die_with_parent(int(os.environ["FUNCTRAIN_LAUNCHER_PID"]))   # first thing in a worker
    """
    parent = os.getppid() if parent_pid is None else int(parent_pid)
    how = "watchdog"
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0:
                how = "prctl"
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:  # the parent is gone already: the signal will never come
        os.kill(os.getpid(), signal.SIGKILL)
    if how == "watchdog":
        def watch() -> None:
            import time

            while os.getppid() == parent:
                time.sleep(1.0)
            os.kill(os.getpid(), signal.SIGKILL)

        threading.Thread(target=watch, name="functrain-parent-watchdog", daemon=True).start()
    return how
