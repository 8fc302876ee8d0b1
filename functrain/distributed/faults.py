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

When the launcher is stopped (SIGTERM, Ctrl-C) it must say whether the ranks'
checkpoint was written; only the ranks know. :func:`report_stop` is how a rank
tells it (``ft.Trainer`` after its save, or when a second Ctrl-C stops it
without saving; the launcher's runner when a ``KeyboardInterrupt`` ended the
script): one small JSON file per rank in the folder the launcher names in
``FUNCTRAIN_STOP_REPORT``, read back with :func:`read_stop_reports`.
"""
from __future__ import annotations

import json
import math
import os
import signal
from dataclasses import dataclass
from typing import Any, Iterable

from ..core.procs import die_with_parent  # (in the core: compile workers die with their parent too)

__all__ = ["LOST_PEER", "PEER_TIMEOUT", "PeerFailed", "cause_of", "RankEnd", "root_cause", "left_early", "describe_end",
           "die_with_parent", "STOP_REPORT", "report_stop", "read_stop_reports", "stop_outcome", "lost_steps"]

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


# ----------------------------------------------------------------------------------- how a stopped rank ended

STOP_REPORT = "FUNCTRAIN_STOP_REPORT"  # the folder (set by the launcher) where each rank says how it stopped


def report_stop(saved: bool, *, how: str, step: int | None = None, checkpoint_step: int | None = None,
                checkpoint: str | None = None, replace: bool = True) -> bool:
    """Tell the launcher how this rank stopped after a signal; ``True`` if a report was written.

    ``saved``: whether the checkpoint of the stop step is written. ``how``: ``"saved"``, ``"at_once"`` (a
    second Ctrl-C: stopped without saving) or ``"KeyboardInterrupt"`` (the script did not handle the signal).
    ``step``: the last step this rank finished; ``checkpoint_step``, ``checkpoint``: the newest checkpoint it
    knows is complete (the one saved, or the one the steps since are lost from). ``replace=False`` leaves an
    earlier report of this rank as it is. Nothing is written outside a launcher (``FUNCTRAIN_STOP_REPORT``
    unset) or when the folder cannot be written: the report is a courtesy to the launcher, never an error.
    Safe in a signal handler (no locks; one small file written aside and renamed into place).

    Example::

        >>> report_stop(True, how="saved", step=40, checkpoint_step=40)   # outside a launcher: nothing to do
        False
    """
    folder = os.environ.get(STOP_REPORT)
    rank = os.environ.get("RANK", "")
    if not folder or not rank.isdigit():
        return False
    path = os.path.join(folder, f"rank{int(rank)}.json")
    if not replace and os.path.exists(path):
        return False
    data = {"rank": int(rank), "saved": bool(saved), "how": how, "step": step, "checkpoint_step": checkpoint_step,
            "checkpoint": checkpoint, "pid": os.getpid()}
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as fp:
            json.dump(data, fp)
        os.replace(tmp, path)
    except OSError:
        return False
    return True


def read_stop_reports(folder: str) -> dict[int, dict[str, Any]]:
    """The reports of :func:`report_stop` in ``folder``: ``{rank: report}`` (unreadable ones left out).

    Example::

        >>> read_stop_reports("/nonexistent")
        {}
    """
    out: dict[int, dict[str, Any]] = {}
    try:
        names = os.listdir(folder)
    except OSError:
        return out
    for name in names:
        if not (name.startswith("rank") and name.endswith(".json") and name[4:-5].isdigit()):
            continue
        try:
            with open(os.path.join(folder, name)) as fp:
                data = json.loads(fp.read(65536))
        except (OSError, ValueError):
            continue
        if isinstance(data, dict):
            out[int(name[4:-5])] = data
    return out


def stop_outcome(sig: int, *, term_timeout: float, after: dict, killed: list, ended: bool, second: int | None,
                 reports: dict) -> tuple[int, str]:
    """The launcher's exit status and line after it was stopped by ``sig`` and stopped the ranks in turn.

    ``after``: rank -> exit status (``Popen.returncode``) once stopped; ``killed``: the ranks SIGKILLed;
    ``ended``: every rank ended by itself (status 0 or ``128 + sig``); ``second``: a second signal that cut the
    grace short; ``reports``: :func:`read_stop_reports`. The status is ``128 + sig`` when the checkpoint is
    written: every rank reported it saved (``ft.Trainer``) or, for a script that reports nothing, every rank
    ended by itself within ``--term-timeout`` and no rank said it lost anything and no second signal came.
    Else ``128 + SIGKILL``; the line then names the ranks SIGKILLed, stopped at once, ended by a
    ``KeyboardInterrupt`` or failed, and the last checkpoint the ranks know of, so what is lost.

    Example::

        >>> saved = {r: {"saved": True, "step": 7, "checkpoint_step": 7, "checkpoint": "ck/step_7"} for r in (0, 1)}
        >>> stop_outcome(2, term_timeout=30, after={0: 0, 1: 0}, killed=[], ended=True, second=None, reports=saved)
        (130, 'stopped by SIGINT; every rank ended by itself within --term-timeout 30 s: the checkpoint of step 7 \
is written (ck/step_7) (exit status 130)')
    """
    name = _signal_name(sig)
    saved = {r: rep for r, rep in reports.items() if rep.get("saved") is True}
    unsaved = sorted(r for r in reports if r not in saved)
    if (after and all(r in saved for r in after)) or (ended and second is None and not unsaved):
        if ended:
            how = f"every rank ended by itself within --term-timeout {term_timeout:g} s"
        else:
            late = [r for r in after if r in killed]
            how = "every rank saved before it was stopped" + (f" (rank(s) {_ranks(late)} then SIGKILLed)"
                                                              if late else "")
        steps = sorted({rep.get("checkpoint_step") for rep in saved.values()}, key=str)
        if len(steps) == 1:
            what = f": the checkpoint of step {steps[0]} is written ({next(iter(saved.values())).get('checkpoint')})"
        elif steps:
            what = ": the ranks saved different steps (" + ", ".join(
                f"rank {r}: step {rep.get('checkpoint_step')}" for r, rep in sorted(saved.items())) + ")"
        else:
            what = " (none said whether it saved a checkpoint; an ft.Trainer does)"
        return 128 + sig, f"stopped by {name}; {how}{what} (exit status {128 + sig})"
    parts = []
    if second is not None:
        parts.append(f"a second {_signal_name(second)} stopped the ranks at once, without waiting for them to save")
    at_once = [r for r in unsaved if reports[r].get("how") == "at_once"]
    interrupted = [r for r in unsaved if reports[r].get("how") == "KeyboardInterrupt"]
    if at_once:
        at = sorted({reports[r].get("step") for r in at_once if reports[r].get("step") is not None})
        parts.append(f"rank(s) {_ranks(at_once)} stopped without saving"
                     + (f" at step {', '.join(map(str, at))}" if at else ""))
    if interrupted:
        parts.append(f"rank(s) {_ranks(interrupted)} ended with KeyboardInterrupt (the signal came where the script "
                     f"does not handle it, e.g. before ft.Trainer's loop): they saved nothing on the stop")
    if killed:
        parts.append(f"rank(s) {_ranks(killed)} " + ("were SIGKILLed" if second is not None else
                                                     f"did not end within --term-timeout {term_timeout:g} s and "
                                                     f"were SIGKILLed"))
    other = sorted(r for r, c in after.items() if r not in killed and r not in reports and c not in (0, 128 + sig))
    if other:
        parts.append("rank(s) " + ", ".join(f"{r} ({_status(after[r])})" for r in other) + " did not end cleanly")
    if not parts:
        parts.append("how the ranks ended is unknown")
    known = [rep for rep in reports.values() if isinstance(rep.get("checkpoint_step"), int)]
    if known:
        newest = max(known, key=lambda rep: rep["checkpoint_step"])
        last = newest["checkpoint_step"]
        done = max((rep.get("step") for rep in reports.values() if isinstance(rep.get("step"), int)), default=last)
        tail = f": the last checkpoint is step {last} ({newest.get('checkpoint')}); {lost_steps(last, done)}"
    elif at_once or interrupted:
        tail = ": no checkpoint is written"
    else:
        tail = ": their last checkpoint may not be written"
    code = 128 + int(signal.SIGKILL)
    return code, f"stopped by {name}; {'; '.join(parts)}{tail} (exit status {code})"


def _ranks(ranks: Iterable[int]) -> str:
    return ", ".join(map(str, sorted(ranks)))


def _status(code: int) -> str:
    return f"killed by {_signal_name(-code)}" if code < 0 else f"exit status {code}"


def lost_steps(checkpoint: int, done: int | None) -> str:
    """What a stop without saving lost: the finished steps after the last ``checkpoint``.

    Example::

        >>> lost_steps(40, 43), lost_steps(40, 41), lost_steps(40, 40)
        ('steps 41 to 43 are lost', 'step 41 is lost', 'no finished step is lost')
    """
    if done is None or done <= checkpoint:
        return "no finished step is lost"
    return f"step {done} is lost" if done == checkpoint + 1 else f"steps {checkpoint + 1} to {done} are lost"
