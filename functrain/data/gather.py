"""Evaluation across ranks: ``ft.gather_for_eval`` collects per-batch results, each sample exactly once.

It reads which samples the :class:`~functrain.data.loader.ShardedLoader` put in
its last batch (and which of them are wrap-around padding: its public
``last_batch_info``) and all-gathers the ranks' rows.
"""
from __future__ import annotations

from typing import Any

import optree
import torch
import torch.distributed as dist

from ..distributed import group as distributed
from ..distributed.comm import comm_device
from .loader import ShardedLoader

__all__ = ["gather_for_eval"]


def gather_for_eval(tree: Any, loader: ShardedLoader | None = None) -> Any:
    """All ranks' results for the batch ``loader`` yielded last, each sample exactly once.

    Call it once per batch on every rank; every rank gets the same result. The rows of all
    ranks are gathered (sizes may differ between ranks: they are gathered first and the
    rows padded to the largest), the loader's wrap-around padding is removed, and the rows
    are put in the loader's global order: for a map-style dataset the epoch's order
    (dataset order without shuffling), so concatenating the results of all batches of an
    epoch gives each sample exactly once, in that order; for a ``DistributedSampler`` or a
    strided iterable likewise (their own order); for an iterable with a ``shard`` hook or a
    custom rank-aware sampler, rank 0's rows, then rank 1's, ... (padding of a custom
    sampler is unknown and kept). Without a process group (or with one process) nothing is
    communicated: the input is returned, less the padding rows of the loader's last batch.

    Args:
        tree: a tensor or pytree of tensors (numpy arrays are taken as tensors) holding one row
            per sample of that batch (leading dimension = the batch's rows on this rank).
        loader: the :class:`~functrain.data.ShardedLoader` that yielded the batch (default
            ``None``: a plain gather, in rank order, nothing removed).

    Returns:
        The same structure with every rank's rows, on the input's device and dtype.

    Raises:
        TypeError: a leaf that is not a tensor with a leading batch dimension.
        ValueError: leaves of different leading sizes, a row count that is not the loader's last
            batch's, or a loader sharded over a world size that is not the process group's (or
            over several ranks without a group).
        RuntimeError: the loader has not yielded a batch yet.

    Example::

        >>> import torch, functrain as ft
        >>> loader = ft.shard(torch.arange(5.0), batch_size=2, shuffle=False, rank=0, world_size=1)
        >>> [ft.gather_for_eval(b * 10, loader).tolist() for b in loader]   # padding removed
        [[0.0, 10.0], [20.0, 30.0], [40.0]]
    """
    where = "gather_for_eval"
    leaves, spec = optree.tree_flatten(tree)
    if not leaves:
        return tree
    rows = []
    for i, x in enumerate(leaves):
        if type(x).__module__ == "numpy":
            x = leaves[i] = torch.from_numpy(x)
        if not torch.is_tensor(x) or x.dim() == 0:
            raise TypeError(f"{where}: every leaf must be a tensor with a leading batch dimension; leaf {i} is "
                            f"{type(x).__name__ if not torch.is_tensor(x) else 'a 0-dim tensor'}")
        rows.append(x.shape[0])
    n = rows[0]
    if any(r != n for r in rows):
        raise ValueError(f"{where}: the leaves have different leading sizes {rows}; one row per sample is needed")
    world = None
    if loader is not None:
        info = loader.last_batch_info
        if info is None:
            raise RuntimeError(f"{where}: the loader has not yielded a batch yet; call it after each batch")
        if n != info.rows:
            raise ValueError(f"{where}: the results have {n} rows but the loader's last batch (epoch {info.epoch}, "
                             f"batch {info.batch}) had {info.rows} rows on this rank; pass one row per sample")
        real, layout, world = info.real, info.layout, loader.world_size
    else:
        real, layout = n, "blocked"
    if not distributed.is_initialized() or dist.get_world_size() == 1:
        if world not in (None, 1):
            raise ValueError(f"{where}: the loader is sharded over world_size={world} but there is no process group "
                             f"of that size to gather from")
        return tree if real == n else optree.tree_unflatten(spec, [x[:real] for x in leaves])
    group = dist.get_world_size()
    if world is not None and world != group:
        raise ValueError(f"{where}: world_size mismatch: the loader is sharded over {world} ranks but the process "
                         f"group has {group}")
    comm = comm_device()
    counts = torch.tensor([n, real], dtype=torch.int64, device=comm)
    gathered = [torch.empty_like(counts) for _ in range(group)]
    dist.all_gather(gathered, counts)
    counts = torch.stack(gathered).cpu()
    sizes, reals = counts[:, 0].tolist(), counts[:, 1]
    most = max(sizes)
    out = []
    for x in leaves:
        y = x.detach().to(comm)
        if y.dtype == torch.bool:
            y = y.to(torch.uint8)
        if n < most:
            y = torch.cat([y, y.new_zeros((most - n,) + tuple(y.shape[1:]))])
        y = y.contiguous()
        parts = [torch.empty_like(y) for _ in range(group)]
        dist.all_gather(parts, y)
        if layout == "strided":  # row l of rank r is global position l*W + r: interleave
            keep = (torch.arange(most)[:, None] < reals[None, :]).to(comm)  # [row, rank]
            z = torch.stack(parts, dim=1)[keep]
        else:
            z = torch.cat([p[:int(r)] for p, r in zip(parts, reals)])
        out.append(z.to(device=x.device, dtype=x.dtype))
    return optree.tree_unflatten(spec, out)
