"""Small collective helpers the layers above share: where collectives run, an all-reduce of one integer, the
"any rank" / "every rank" flags (at once, or as a vote read later), a gloo group of their own, and a check that
every rank holds the same values.

``ft.shard`` (ranks agreeing when an iterable of unknown length ends) and
``ft.gather_for_eval`` (all-gathering evaluation rows) need the first two; they live
here so that neither module reaches into the other's private names. ``ft.Trainer``
uses the flags (a rank's failed lock, every shard finite, a signal on any rank), the vote
(its per-step stop agreement) and :func:`gloo_group` (the groups of its saves and votes,
whose timeouts are not the default group's), and checks with :func:`check_same` that
every rank was given the same config.
"""
from __future__ import annotations

import datetime
import hashlib
import json
from typing import Any, Mapping

import torch
import torch.distributed as dist

__all__ = ["comm_device", "all_reduce_int", "any_rank", "every_rank", "Vote", "gloo_group", "check_same"]


def comm_device(group: Any = None) -> torch.device:
    """The device the collectives of ``group`` (default: the default process group) take tensors on: the
    current CUDA device under NCCL, else the CPU.

    Example::

        t = torch.tensor([n], device=comm_device())
        dist.all_reduce(t)
    """
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_int(value: int, op: Any = dist.ReduceOp.SUM, group: Any = None) -> int:
    """``value`` reduced with ``op`` over ``group`` (default: the default process group): one collective, one
    host sync.

    Example::

        total = all_reduce_int(len(my_items))                      # the sum over ranks
        any_left = all_reduce_int(int(more), dist.ReduceOp.MAX)    # 1 if any rank has more
    """
    t = torch.tensor([int(value)], dtype=torch.int64, device=comm_device(group))
    dist.all_reduce(t, op=op, group=group)
    return int(t.item())


def any_rank(flag: bool, group: Any = None) -> bool:
    """Whether ``flag`` is true on any rank of ``group`` (every rank calls it; one all-reduce)."""
    return all_reduce_int(bool(flag), dist.ReduceOp.MAX, group) > 0


def every_rank(flag: bool, group: Any = None) -> bool:
    """Whether ``flag`` is true on every rank of ``group`` (every rank calls it; one all-reduce)."""
    return all_reduce_int(bool(flag), dist.ReduceOp.MIN, group) > 0


class Vote:
    """Whether ``flag`` is true on any rank of ``group``, asked now and answered later: :meth:`result`.

    The all-reduce starts at once and is not waited for (``async_op``); the flag is a CPU number, so ``group``
    must take CPU tensors (gloo: :func:`gloo_group`) and reading the answer is no device sync. Every rank must
    start the same votes in the same order; each is read (:meth:`result`) or waited for (:meth:`wait`) once.

    Example::

        vote = Vote(stop_here, group)        # at step k, on every rank
        ...                                   # step k + 1 runs
        if vote.result():                     # any rank wanted to stop at step k
            ...
    """

    def __init__(self, flag: bool, group: Any):
        self.tensor = torch.tensor([1 if flag else 0], dtype=torch.int64)
        self.work = dist.all_reduce(self.tensor, op=dist.ReduceOp.MAX, group=group, async_op=True)

    def wait(self) -> None:
        """Wait until every rank's flag is in (the vote is then complete; :meth:`result` reads it)."""
        self.work.wait()

    def result(self) -> bool:
        """Wait for the vote and say whether any rank's flag was true (no ``item()``: a CPU read)."""
        self.work.wait()
        return bool(self.tensor.numpy()[0] > 0)


def gloo_group(timeout_s: float | datetime.timedelta) -> Any:
    """A new gloo group of every rank whose collectives wait up to ``timeout_s`` (CPU tensors: host flags, votes
    and barriers that must not wait on the device, nor be bound by the default group's timeout). Every rank
    must create the same groups in the same order."""
    timeout = timeout_s if isinstance(timeout_s, datetime.timedelta) else datetime.timedelta(seconds=timeout_s)
    return dist.new_group(backend="gloo", timeout=timeout)


def _digest(value: Any) -> int:
    """A 63-bit hash of a JSON-able value's canonical text (the same on every process and Python run)."""
    text = json.dumps(value, sort_keys=True, default=repr)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") >> 1


def check_same(values: Mapping[str, Any], what: str) -> None:
    """Raise ``ValueError`` on every rank unless every rank of the default group passed the same ``values``.

    One all-gather of one int64 per name (a hash of each value's canonical JSON), bounded by the
    group's timeout like every collective. The error names each differing name, which ranks hold
    which value (grouped by hash) and this rank's own value. Every rank must call it with the same
    names; without a process group, or on one process, it returns at once.

    Example::

        check_same(config.to_dict(), "TrainConfig")
        # ValueError: TrainConfig differs between the 2 ranks: results_folder: ranks [0] hold one value, ranks [1]
        # another (this rank, 1, has '/tmp/b')
    """
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return
    names = sorted(values)
    mine = [_digest(names)] + [_digest(values[n]) for n in names]
    t = torch.tensor(mine, dtype=torch.int64, device=comm_device())
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t)
    table = torch.stack(parts).cpu().tolist()  # (ranks, 1 + names)
    if any(row[0] != mine[0] for row in table):
        raise ValueError(f"{what}: the ranks were given different sets of names (functrain versions differ?); "
                         f"this rank, {dist.get_rank()}, has {names}")
    problems = []
    for j, name in enumerate(names, start=1):
        groups: dict[int, list[int]] = {}
        for r, row in enumerate(table):
            groups.setdefault(row[j], []).append(r)
        if len(groups) > 1:
            ranks = sorted(groups.values())
            held = ", ".join(f"ranks {g}" for g in ranks)
            problems.append(f"{name}: {held} hold {len(ranks)} different values (this rank, {dist.get_rank()}, "
                            f"has {values[name]!r})")
    if problems:
        raise ValueError(f"{what} differs between the {len(table)} ranks: " + "; ".join(problems) +
                         ". Every rank must be given the same config (a per-rank results folder, batch size or "
                         "seed would split the run silently)")
