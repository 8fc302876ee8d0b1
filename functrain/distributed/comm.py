"""Small collective helpers the layers above share: where collectives run, an all-reduce of one integer,
and a check that every rank holds the same values.

``ft.shard`` (ranks agreeing when an iterable of unknown length ends) and
``ft.gather_for_eval`` (all-gathering evaluation rows) need the first two; they live
here so that neither module reaches into the other's private names. ``ft.Trainer``
checks with :func:`check_same` that every rank was given the same config.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any, Mapping

import torch
import torch.distributed as dist

__all__ = ["comm_device", "all_reduce_int", "check_same"]


def comm_device() -> torch.device:
    """The device the default process group's collectives take tensors on: the current CUDA device under
    NCCL, else the CPU.

    Example::

        t = torch.tensor([n], device=comm_device())
        dist.all_reduce(t)
    """
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_int(value: int, op: Any = dist.ReduceOp.SUM) -> int:
    """``value`` reduced with ``op`` over the default process group (one collective, one host sync).

    Example::

        total = all_reduce_int(len(my_items))                      # the sum over ranks
        any_left = all_reduce_int(int(more), dist.ReduceOp.MAX)    # 1 if any rank has more
    """
    t = torch.tensor([int(value)], dtype=torch.int64, device=comm_device())
    dist.all_reduce(t, op=op)
    return int(t.item())


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
