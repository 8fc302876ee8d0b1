"""Recycled output buffers: the pure compiled call without fresh memory per step.

A pure step's new state is new memory every call. On CPU a large block comes from
the kernel as untouched pages and each first write faults (~0.7k faults per step on a
1.3M-parameter MLP with Adam, ~20% of its step time). So the captured graph takes one
extra input per large CPU state leaf and writes that leaf's new value into it
(``copy_``, which inductor fuses into the kernel computing it); the buffers come from
two sets per capture, and a set is reused only when every buffer's storage is held by
nobody but the pool (the caller dropped that state and every view of it). A loop
``state, m = cstep(state, b)`` alternates between the two sets; a state the caller
keeps is never written. The price is memory: the pool keeps up to two sets of those leaves alive
for as long as the compiled step lives (after the loop, one set more than the caller holds); a
donated step (``donate=True``, ``ft.run``) has no pool. Other devices have caching allocators:
nothing is recycled there.
"""
from __future__ import annotations

from typing import Any

import optree
import torch

__all__ = ["Buffer", "write_into", "recyclable", "free_buffers", "RECYCLE_BYTES"]


class Buffer:
    """Marks an output leaf the graph wrote into recycled buffer ``j`` (not a graph output)."""

    __slots__ = ("j",)

    def __init__(self, j: int):
        self.j = j


def write_into(new: Any, state_spec: Any, inputs: tuple, recycle: tuple, bufs: tuple, record: dict) -> Any:
    """``new`` (the traced new state) with each recyclable tensor leaf written into its buffer (``copy_``,
    which inductor fuses into the kernel computing it) and replaced by a :class:`Buffer` mark."""
    new_leaves, new_spec = optree.tree_flatten(new)
    tensor_idx = [i for i, x in enumerate(new_leaves) if torch.is_tensor(x)]
    used = []
    if new_spec == state_spec:
        for j, (k, buf) in enumerate(zip(recycle, bufs)):
            if k >= len(tensor_idx):
                continue
            i = tensor_idx[k]
            value = new_leaves[i]
            if value is inputs[k] or value.shape != buf.shape or value.dtype != buf.dtype \
                    or value.device != buf.device:
                continue  # an unchanged leaf is returned as it is; another shape cannot go there
            buf.copy_(value)
            new_leaves[i] = Buffer(j)
            used.append(j)
    record["recycled"] = used
    return optree.tree_unflatten(new_spec, new_leaves)


RECYCLE_BYTES = 1 << 17  # glibc serves blocks from 128 KiB up with fresh pages: a page fault per 4 KiB
_use_count = getattr(torch._C, "_storage_Use_Count", None)


def recyclable(state_tensors: list) -> tuple:
    """Positions of the state's tensors worth writing into recycled buffers: large CPU leaves.

    A pure step's new state is fresh memory every call; on CPU a large block comes from the
    kernel as untouched pages, and each first write faults (~0.7k faults per step on a 1.3M
    parameter MLP with Adam, ~20% of its step time). Other devices have caching allocators.
    """
    if _use_count is None:  # pragma: no cover - a torch without the use-count query: no recycling
        return ()
    return tuple(k for k, t in enumerate(state_tensors)
                 if t.device.type == "cpu" and t.numel() * t.element_size() >= RECYCLE_BYTES)


def free_buffers(cap: Any) -> list:
    """Output buffers for the recycled leaves of ``cap``: a set from an earlier call whose every
    storage nobody else holds any more (the caller dropped that state and all views of it), or a new set.

    At most two sets are kept: the state passed in (in use) and the one before it (free once the
    caller rebinds its variable), so a loop ``state, m = step(state, batch)`` alternates between them.
    """
    for bufs in cap.pool:
        # 2 = the pool's tensor + the temporary storage object of the query; anything more is a holder
        if all(_use_count(b.untyped_storage()._cdata) == 2 for b in bufs):
            return bufs
    metas = [cap.signature.metas[k] for k in cap.recycle]
    bufs = [torch.empty_strided(shape, stride, dtype=dtype, device=device) for shape, stride, dtype, device in metas]
    cap.pool.insert(0, bufs)
    del cap.pool[2:]
    return bufs

