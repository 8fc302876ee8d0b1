"""The ranks of a group deciding together: which checkpoint every rank resumes from, and who writes a
replicated state.

:meth:`CheckpointManager.load_latest <functrain.checkpoint.CheckpointManager.load_latest>`
with a group tries the candidates newest first on every rank; each rank checks
its own part (its shard's files, or the whole checkpoint when every rank loads
it) and the verdicts are combined with one small collective per candidate, so
every rank takes the same one. A :class:`Agreement` is those collectives: on one
process (``group=None``) each is the identity, no collective runs.

Every collective is bounded by the group's timeout (the trainer passes its gloo
group of ``save_timeout`` seconds); a rank that dies or hangs meanwhile makes the
others raise :class:`~functrain.distributed.PeerFailed` saying what they were
agreeing on, with the collective's own error (lost connection, timeout) chained.

A replicated state (unsharded, in a process group of more than one process) is
written once, by rank 0 (:func:`save_once`). Rank 0 never waits for the others,
so saving on rank 0 alone still works: it records each save it starts and ends
in the process group's store. Another rank that saves too pairs its n-th save
with rank 0's n-th (of ``CheckpointManager.save``, or of ``ft.save``): the same
folder (path) means the same checkpoint, so it writes nothing, checks the step
(another is refused by name) and waits, up to a timeout, for rank 0's save to
end (rank 0's failure raised as :class:`~functrain.distributed.PeerFailed`,
quoted); another folder means a checkpoint of this rank's own, which it writes.
"""
from __future__ import annotations

import datetime
import hashlib
import json
import time
import warnings
from typing import Any, Callable

import torch

from ..distributed.faults import PeerFailed

__all__ = ["Agreement", "TEXT_BYTES", "replicated_rank", "save_once", "check_timeout"]

TEXT_BYTES = 2048  # the longest reason one rank sends (longer ones are cut)


class Agreement:
    """Collectives over ``group`` (a ``torch.distributed`` process group; ``None``: one process, no collectives).

    ``what`` names the decision in the error a lost or hung peer causes.

    Example::

        >>> a = Agreement(None, "which checkpoint to resume")
        >>> a.rank, a.world, a.codes(1), a.texts("why"), a.from_rank0([3, 2])
        (0, 1, [1], ['why'], [3, 2])
    """

    def __init__(self, group: Any, what: str):
        self.group, self.what = group, what
        if group is None:
            self.rank, self.world, self.device = 0, 1, torch.device("cpu")
            return
        import torch.distributed as dist

        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        cuda = dist.get_backend(group) == "nccl"
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")

    def _run(self, fn: Any) -> None:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - a peer died or hung: say what was being agreed on
            raise PeerFailed(f"rank {self.rank}: lost the other ranks while agreeing {self.what} "
                             f"({type(e).__name__}: {str(e)[:500]})") from e

    def from_rank0(self, values: list[int]) -> list[int]:
        """Rank 0's ``values`` (a list of ints) on every rank (two broadcasts)."""
        if self.group is None:
            return list(values)
        import torch.distributed as dist

        n = torch.tensor([len(values) if self.rank == 0 else 0], dtype=torch.int64, device=self.device)
        self._run(lambda: dist.broadcast(n, src=dist.get_global_rank(self.group, 0), group=self.group))
        t = torch.tensor(values if self.rank == 0 else [0] * int(n.item()), dtype=torch.int64, device=self.device)
        if t.numel():
            self._run(lambda: dist.broadcast(t, src=dist.get_global_rank(self.group, 0), group=self.group))
        return [int(v) for v in t.tolist()]

    def codes(self, code: int) -> list[int]:
        """Every rank's ``code`` (a small int), by rank: one all-reduce of ``world`` ints."""
        if self.group is None:
            return [int(code)]
        import torch.distributed as dist

        t = torch.zeros(self.world, dtype=torch.int64, device=self.device)
        t[self.rank] = int(code)
        self._run(lambda: dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group))
        return [int(v) for v in t.tolist()]

    def texts(self, text: str) -> list[str]:
        """Every rank's ``text`` (cut at :data:`TEXT_BYTES` bytes of UTF-8), by rank: one all-gather."""
        data = text.encode("utf-8")[:TEXT_BYTES]
        if self.group is None:
            return [data.decode("utf-8", "ignore")]
        import torch.distributed as dist

        mine = torch.zeros(TEXT_BYTES + 8, dtype=torch.uint8)
        mine[:8] = torch.tensor(list(len(data).to_bytes(8, "little")), dtype=torch.uint8)
        mine[8:8 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else mine[8:8]
        mine = mine.to(self.device)
        out = [torch.zeros_like(mine) for _ in range(self.world)]
        self._run(lambda: dist.all_gather(out, mine, group=self.group))
        texts = []
        for t in out:
            raw = bytes(t.cpu().tolist())
            n = min(int.from_bytes(raw[:8], "little"), TEXT_BYTES)
            texts.append(raw[8:8 + n].decode("utf-8", "ignore"))
        return texts


# -------------------------------------------------------------------------- a replicated state: rank 0 writes it
def replicated_rank() -> tuple[int, int] | None:
    """``(rank, world)`` in the default process group when one is initialised with more than one process.

    Returns:
        The pair, or ``None`` (no process group, or a group of one): this process saves alone.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    world = dist.get_world_size()
    return (dist.get_rank(), world) if world > 1 else None


def check_timeout(timeout: Any) -> float:
    """``timeout`` as a float: a finite number of seconds > 0 (a bool or a string is refused by name)."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"timeout must be a number of seconds (> 0, finite); got {timeout!r}")
    if not 0 < float(timeout) < float("inf"):
        raise ValueError(f"timeout must be a number of seconds > 0 and finite; got {timeout!r}")
    return float(timeout)


def _store() -> Any:
    """The default process group's key-value store (the rendezvous store every rank reaches)."""
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


def _where(kind: str, target: str, step: int | None) -> str:
    return f"step {step} into {target}" if kind == "manager" else target


def save_once(kind: str, target: str, step: int | None, write: Callable[[], str], timeout: float) -> str:
    """Save a replicated state once: rank 0 runs ``write()``; another rank that saves the same waits for it.

    Call it only in a process group of more than one process (:func:`replicated_rank`). Rank 0 records
    that its n-th save of ``kind`` starts (``target``, ``step``) and how it ended (the path, or its
    error) in the process group's store, and never waits. Another rank counts its saves of ``kind`` the
    same way and waits for rank 0's n-th start: another ``target`` (a per-rank folder or path) is this
    rank's own to write, and it runs ``write()``; the same ``target`` with another ``step`` is refused;
    else it waits for rank 0's end and returns rank 0's path. All of it within ``timeout`` seconds.

    Args:
        kind: ``"manager"`` (``target`` is a CheckpointManager's folder, ``step`` its step) or ``"save"``
            (``target`` is the path of ``ft.save``, ``step`` ``None``).
        target: the absolute folder or path.
        step: the step saved (compared with rank 0's), or ``None``.
        write: this rank's save; returns the path.
        timeout: how long another rank waits for rank 0, in seconds.

    Returns:
        The checkpoint's path.

    Raises:
        ValueError: (on a rank other than 0) rank 0's save at this point is another step of ``target``.
        functrain.distributed.PeerFailed: (on a rank other than 0) rank 0's save failed (its error quoted), or
            rank 0 did not start or end it within ``timeout`` (it saves nothing here), or the store was lost.
    """
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    ns = f"functrain/save/{kind}"
    what = _where(kind, target, step)
    if rank == 0:
        try:
            store = _store()
            number = int(store.add(f"{ns}/count/0", 1))
            store.set(f"{ns}/start/{number}", json.dumps({"target": target, "step": step}))
        except Exception as e:  # noqa: BLE001 - the save itself does not need the store: say so, then save
            warnings.warn(f"rank 0 could not record its save of {what} in the process group's store "
                          f"({type(e).__name__}: {e}); other ranks that save it too will wait for it in vain",
                          RuntimeWarning, stacklevel=3)
            return write()
        try:
            path = write()
        except BaseException as e:
            _post(store, ns, number, world, {"error": f"{type(e).__name__}: {e}"[:TEXT_BYTES]})
            raise
        _post(store, ns, number, world, {"path": path})
        return path

    deadline = time.monotonic() + timeout
    store, number, end = None, None, None
    try:
        try:
            store = _store()
            number = int(store.add(f"{ns}/count/{rank}", 1))
        except Exception as e:  # noqa: BLE001 - no store to wait on
            raise _Lost(False, timeout, f"{type(e).__name__}: {str(e)[:300]}") from e
        start = _wait(store, f"{ns}/start/{number}", deadline)
        if start.get("target") != target:  # rank 0's save at this point goes elsewhere: this one is ours
            _read(store, ns, number, world)
        elif start.get("step") != step:
            _read(store, ns, number, world)
            raise ValueError(
                f"rank {rank} saves step {step} into {target}, but rank 0's save number {number} there is step "
                f"{start.get('step')}: an unsharded state in a process group of {world} is replicated and written "
                f"by rank 0; every rank may call save with the same steps in the same order, or rank 0 alone "
                f"(a state that differs by rank: a folder of each rank's own, or replicated=False)")
        else:
            end = _wait(store, f"{ns}/end/{number}", deadline)
            _read(store, ns, number, world)
    except _Lost as e:
        done = _count(store, ns) if number is not None else None
        counts = "" if done is None else \
            f" (rank 0 has made {done} such save(s), rank {rank} is at its save {number})"
        raise PeerFailed(
            f"rank {rank}: {'waited' if e.timed_out else 'lost the store after'} {timeout - e.left:.0f} s "
            f"(timeout {timeout:g} s) for rank 0 to save {what}{counts}: an unsharded state in a process group "
            f"of {world} is replicated and written by rank 0, the other ranks wait for its save; is rank 0 "
            f"saving too, in the same order? A rank's own state, saved when rank 0 saves nothing: "
            f"replicated=False ({e.cause})") from e.__cause__
    if end is None:
        return write()
    if "error" in end:
        raise PeerFailed(f"rank {rank}: rank 0 failed to save {what}; nothing was saved ({end['error']})")
    return str(end["path"])


class _Lost(Exception):
    """Rank 0's record did not come: the wait timed out (``timed_out``) or the store failed."""

    def __init__(self, timed_out: bool, left: float, cause: str):
        super().__init__(cause)
        self.timed_out, self.left, self.cause = timed_out, left, cause


def _wait(store: Any, key: str, deadline: float) -> dict:
    """Rank 0's record ``key`` (a JSON dict), waited for until ``deadline``; :class:`_Lost` if it does not come."""
    left = deadline - time.monotonic()
    try:
        if left <= 0:
            raise TimeoutError("no time left")
        store.wait([key], datetime.timedelta(seconds=left))
        record = json.loads(store.get(key))
    except Exception as e:  # noqa: BLE001 - rank 0 did not record it in time, or the store is gone
        left = deadline - time.monotonic()
        raise _Lost(left <= 0, max(left, 0.0), f"{type(e).__name__}: {str(e)[:300]}") from e
    return record if isinstance(record, dict) else {}


def _post(store: Any, ns: str, number: int, world: int, record: dict) -> None:
    """Rank 0: how its save ended, for the ranks that wait for it."""
    try:
        store.set(f"{ns}/end/{number}", json.dumps(record))
    except Exception as e:  # noqa: BLE001 - rank 0's save stands; the waiting ranks time out, naming it
        warnings.warn(f"rank 0 could not record its save in the process group's store ({type(e).__name__}: {e})",
                      RuntimeWarning, stacklevel=4)
        return
    _read(store, ns, number, world)


def _count(store: Any, ns: str) -> int | None:
    try:
        return int(store.add(f"{ns}/count/0", 0))
    except Exception:  # noqa: BLE001 - only for the message
        return None


def _read(store: Any, ns: str, number: int, world: int) -> None:
    """One rank is done with save ``number``'s records; the last of all ``world`` ranks removes them (when
    rank 0 saves alone, its two small records per save stay in the store)."""
    try:
        if store.add(f"{ns}/read/{number}", 1) >= world:
            for part in ("start", "end", "read"):
                store.delete_key(f"{ns}/{part}/{number}")
    except Exception:  # noqa: BLE001 - a store without delete_key: the records stay
        pass
