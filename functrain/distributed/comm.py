"""Two collective helpers the data layer shares: where collectives run, and an all-reduce of one integer.

``ft.shard`` (ranks agreeing when an iterable of unknown length ends) and
``ft.gather_for_eval`` (all-gathering evaluation rows) both need them; they live
here so that neither module reaches into the other's private names.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["comm_device", "all_reduce_int"]


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
