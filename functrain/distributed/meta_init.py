"""This rank's shard of a model built on the meta device (``ft.init_empty``), made with the model's own initialisers.

``data_parallel(shard="params")``'s ``step.init`` calls :func:`make_shard` when the params it is given are meta
tensors from ``ft.functionalize``: the initialisation is replayed one module at a time
(:meth:`functrain.core.empty.EmptyModule.materialise`), and of each parameter only the elements in this rank's
slice of the flat layout are copied into the shard, so a rank holds at most its shard, the buffers and one module's
own tensors; the whole params never exist on any rank. The shard equals ``layout.shard_of(params)`` of the params a
normal build makes (bitwise), as the promise of :mod:`functrain.core.empty` says.
"""
from __future__ import annotations

from typing import Any

import optree
import torch
import torch.distributed as dist

from ..core.empty import EmptyModule, empty_source
from ..core.flat import FlatLayout
from .group import device as default_device

__all__ = ["make_shard", "with_made"]


def make_shard(layout: FlatLayout, source: tuple[EmptyModule, list[str]], group: Any = None
               ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``(shard, buffers)``: this rank's shard tree (``layout.rank``'s slice, zero padded) of the params that
    ``source`` (:func:`~functrain.core.empty.empty_source` of them) names, and the module's other tensors
    (buffers and frozen params) whole, ``{name: tensor}``.

    Without a seed (a plain ``torch.device("meta")`` build) the replay draws from rank 0's global generator, sent
    to the other ranks of ``group`` first (every rank of it must call this)."""
    empty, names = source
    device = empty.device if empty.device is not None else default_device()
    rng_state = None
    if empty.seed is None:
        rng_state = [torch.get_rng_state()] + ([torch.cuda.get_rng_state(device)] if device.type == "cuda" else [])
        if layout.world > 1:
            box = [rng_state]
            dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group is not None else 0,
                                       group=group)
            rng_state = [t.cpu() for t in box[0]]
    shard = {k: torch.zeros(layout.size[k], dtype=layout.dtypes[k], device=device) for k in layout.keys}
    where = {name: i for i, name in enumerate(names)}
    buffers: dict[str, torch.Tensor] = {}

    def keep(name: str, tensor: torch.Tensor) -> None:
        i = where.get(name)
        if i is None:  # a buffer or a frozen parameter: replicated, kept whole
            buffers[name] = tensor
            return
        k, _, n, off = layout.entries[i]
        lo, hi = layout.span(k)
        a, b = max(lo, off), min(hi, off + n)
        if a < b:
            shard[k][a - lo:b - lo].copy_(tensor.reshape(-1)[a - off:b - off])

    empty.materialise(keep, device, rng_state)
    return shard, buffers


def with_made(buffers: Any, made: dict[str, torch.Tensor]) -> Any:
    """``buffers`` with each meta tensor replaced by the tensor :func:`make_shard` made for its name (the tree's
    real tensors kept as they are)."""
    source = empty_source(buffers, "buffers")
    if source is None:
        return buffers
    leaves, spec = optree.tree_flatten(buffers)
    return optree.tree_unflatten(spec, [made[name] for name in source[1]])
