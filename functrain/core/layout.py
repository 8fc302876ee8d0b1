"""The flat, per-dtype shard layout of a params tree (what sharded data parallelism and its checkpoints share).

The params' leaves, in their pytree order, are laid end to end in one 1-D
buffer per dtype, padded with zeros to a multiple of the world size ``W``;
rank ``r`` owns the slice ``[r * S, (r + 1) * S)`` of each buffer (``S =
ceil(numel / W)``). A *shard tree* is ``{dtype name: 1-D tensor of S}``,
e.g. ``{"float32": tensor(S)}``: sharded params, optimizer moments and EMA are
held as shard trees. A sharded :class:`~functrain.TrainState` carries a
:class:`ShardState` in ``state.slots["data_parallel"]`` (rank, world size and the
params' names, dtypes and shapes as small int64 tensors), so a sharded state or
checkpoint describes itself: it can be gathered or resharded without the step
that made it.

Everything here is pure tensor code on Python-int offsets, so it runs eagerly
and inside a compiled step alike; no communication happens in this module.

Example::

    >>> import torch
    >>> from functrain.core.layout import FlatLayout
    >>> params = {"w": torch.arange(5.0), "b": torch.tensor([9.0])}
    >>> layout = FlatLayout.from_params(params, world=2, rank=1)
    >>> layout.shard_of(params)                      # b first (optree sorts dict keys), then w
    {'float32': tensor([2., 3., 4.])}
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple

import optree
import torch

from .eager import tracing
from .validate import path_str
from .registry import register_checkpoint_type

__all__ = ["FlatLayout", "ShardState", "SLOT", "DTYPES", "find_shard_trees"]

SLOT = "data_parallel"  # the slot of a sharded state (the sharded data_parallel transform's name)

# dtype codes stored in ShardState.layout: the index in this tuple (append only: saved checkpoints use them)
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16,
          getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None))


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``: the key of that dtype's buffer in a shard tree."""
    return str(dtype).rpartition(".")[2]


@register_checkpoint_type("functrain.ShardState")
class ShardState(NamedTuple):
    """The ``"data_parallel"`` slot of a sharded state: who holds which shard of what.

    ``rank``/``world`` (int64 scalars): this shard's rank and the world size it was
    cut for; ``params_sharded`` (bool scalar): whether ``state.params`` is a shard
    tree (``shard="params"``) or the whole params (``shard="optimizer"``);
    ``layout``: a tree shaped like the params whose leaves are int64 tensors
    ``[dtype code, *shape]``. The slot never changes during training.
    """

    rank: torch.Tensor
    world: torch.Tensor
    params_sharded: torch.Tensor
    layout: Any


class FlatLayout:
    """Where each leaf of a params tree lives in the per-dtype flat buffers, and which slice a rank owns.

    Python ints only (offsets, sizes), computed once; the methods map trees to
    shard trees and back. ``spec`` is the params' treespec; ``keys`` the sorted
    dtype names; ``numel[k]`` the unpadded length of buffer ``k``; ``size[k]``
    the shard length ``ceil(numel / world)``.
    """

    def __init__(self, spec: Any, dtypes: list[torch.dtype], shapes: list[tuple[int, ...]], world: int,
                 rank: int):
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is outside world size {world}")
        self.spec, self.world, self.rank = spec, int(world), int(rank)
        self.dtypes = {dtype_name(d): d for d in dtypes}
        self.keys = sorted(self.dtypes)
        self.entries: list[tuple[str, tuple[int, ...], int, int]] = []  # (key, shape, numel, offset) per leaf
        offset = {k: 0 for k in self.keys}
        for d, shape in zip(dtypes, shapes):
            k, n = dtype_name(d), math.prod(shape)
            self.entries.append((k, tuple(shape), n, offset[k]))
            offset[k] += n
        self.numel = offset
        self.size = {k: -(-n // self.world) if n else 0 for k, n in offset.items()}

    # -- construction -------------------------------------------------------------------------------
    @classmethod
    def from_params(cls, params: Any, world: int, rank: int) -> "FlatLayout":
        leaves, spec = optree.tree_flatten(params)
        for path, leaf in zip(optree.tree_paths(params), leaves):
            if not torch.is_tensor(leaf) or leaf.dtype not in DTYPES:
                raise TypeError(f"sharding: params leaf {path_str(path)!r} must be a floating tensor of one of "
                                f"{[dtype_name(d) for d in DTYPES if d is not None]}; got "
                                f"{getattr(leaf, 'dtype', type(leaf).__name__)}")
        return cls(spec, [x.dtype for x in leaves], [tuple(x.shape) for x in leaves], world, rank)

    @classmethod
    def from_slot(cls, slot: ShardState, world: int | None = None, rank: int | None = None) -> "FlatLayout":
        """The layout a :class:`ShardState` describes (host reads; for another world/rank if given)."""
        leaves, spec = optree.tree_flatten(slot.layout)
        codes = [[int(v) for v in leaf.tolist()] for leaf in leaves]
        dtypes = [DTYPES[c[0]] for c in codes]
        return cls(spec, dtypes, [tuple(c[1:]) for c in codes],
                   int(slot.world) if world is None else world, int(slot.rank) if rank is None else rank)

    def for_rank(self, world: int, rank: int) -> "FlatLayout":
        """The same params cut for another world size / rank."""
        return FlatLayout(self.spec, [self.dtypes[e[0]] for e in self.entries], [e[1] for e in self.entries],
                          world, rank)

    def slot(self, params_sharded: bool, device: Any = None) -> ShardState:
        """This layout as the state's :class:`ShardState` slot."""
        codes = [torch.tensor([DTYPES.index(self.dtypes[k]), *shape], dtype=torch.int64, device=device)
                 for k, shape, _, _ in self.entries]
        scalar = lambda v, dt: torch.tensor(v, dtype=dt, device=device)  # noqa: E731
        return ShardState(scalar(self.rank, torch.int64), scalar(self.world, torch.int64),
                          scalar(bool(params_sharded), torch.bool), optree.tree_unflatten(self.spec, codes))

    def same_params(self, other: "FlatLayout") -> bool:
        """Whether both describe the same params (structure, dtypes and shapes), whatever the world."""
        return self.spec == other.spec and [e[:2] for e in self.entries] == [e[:2] for e in other.entries]

    # -- trees <-> shard trees ----------------------------------------------------------------------
    def span(self, key: str, rank: int | None = None) -> tuple[int, int]:
        """The ``[lo, hi)`` range of buffer ``key`` that ``rank`` (default: this one) owns."""
        r = self.rank if rank is None else rank
        return r * self.size[key], (r + 1) * self.size[key]

    def shard_of(self, tree: Any, rank: int | None = None, copy: bool = False) -> dict[str, torch.Tensor]:
        """This rank's shard tree of a tree shaped like the params (reads only the owned slice).

        ``copy=True`` makes each shard own its memory (a shard that is a slice of
        one leaf is otherwise a view that keeps the whole leaf alive): for state at
        rest. Inside the step views are fine.
        """
        leaves = self._leaves(tree)
        out = {}
        for k in self.keys:
            lo, hi = self.span(k, rank)
            pieces, like = [], None
            for (key, _, n, off), leaf in zip(self.entries, leaves):
                if key != k:
                    continue
                like = leaf
                a, b = max(lo, off), min(hi, off + n)
                if a < b:
                    pieces.append(leaf.reshape(-1)[a - off:b - off])
            pad = hi - max(lo, self.numel[k])
            if pad > 0:
                pieces.append(torch.zeros(min(pad, hi - lo), dtype=like.dtype, device=like.device))
            if not pieces:  # only empty leaves of this dtype
                out[k] = torch.zeros(0, dtype=like.dtype, device=like.device)
            elif len(pieces) == 1:
                out[k] = pieces[0].clone() if copy else pieces[0]
            else:
                out[k] = torch.cat(pieces)
        return out

    def flatten(self, tree: Any) -> dict[str, torch.Tensor]:
        """The whole padded flat buffers of a tree shaped like the params: ``{dtype name: 1-D tensor of
        world * size}``, the leaves end to end then zeros (what a reduce-scatter cuts into the shards)."""
        leaves = self._leaves(tree)
        out = {}
        for k in self.keys:
            pieces = [leaf.reshape(-1) for (key, _, _, _), leaf in zip(self.entries, leaves) if key == k]
            like = next(leaf for (key, _, _, _), leaf in zip(self.entries, leaves) if key == k)
            pad = self.world * self.size[k] - self.numel[k]
            if pad:
                pieces.append(torch.zeros(pad, dtype=like.dtype, device=like.device))
            out[k] = torch.cat(pieces) if len(pieces) > 1 else pieces[0].reshape(-1)
        return out

    def unflatten(self, flats: dict[str, torch.Tensor], like: Any = None) -> Any:
        """The params-shaped tree from whole (gathered) flat buffers of at least ``numel`` each (views).

        ``like``: any tree with the params' structure (inside a compiled step, the
        state's :class:`ShardState` ``layout``: Dynamo rebuilds trees only from
        structures it flattened itself).
        """
        leaves = [flats[k][off:off + n].view(shape) for k, shape, n, off in self.entries]
        spec = self.spec if like is None else optree.tree_flatten(like)[1]
        return optree.tree_unflatten(spec, leaves)

    def _leaves(self, tree: Any) -> list:
        if tracing():  # the structure was checked eagerly or at the first trace
            leaves = optree.tree_leaves(tree)
            if len(leaves) != len(self.entries):
                raise ValueError(f"expected a tree of {len(self.entries)} leaves shaped like the params; got "
                                 f"{len(leaves)}")
            return leaves
        return self.spec.flatten_up_to(tree)

    def is_shard_tree(self, node: Any) -> bool:
        """Whether ``node`` is a shard tree of this layout (a dict of its dtype keys, 1-D shards of its size)."""
        return (isinstance(node, dict) and sorted(node) == self.keys
                and all(torch.is_tensor(node[k]) and node[k].dtype == self.dtypes[k]
                        and tuple(node[k].shape) == (self.size[k],) for k in self.keys))

    def is_params_like(self, node: Any) -> bool:
        """Whether ``node`` has the params' structure, dtypes and shapes (an optimizer moment, an EMA).

        (While compiling, the structure itself is not compared, only the leaves' count, dtypes and shapes:
        Dynamo cannot compare a tree structure made outside the graph.)
        """
        if tracing():
            leaves = optree.tree_leaves(node)
        else:
            if optree.tree_structure(node) != self.spec:
                return False
            leaves = optree.tree_leaves(node)
        return len(leaves) == len(self.entries) and all(
            torch.is_tensor(x) and x.dtype == self.dtypes[k] and tuple(x.shape) == shape
            for x, (k, shape, _, _) in zip(leaves, self.entries))


def find_shard_trees(tree: Any, keys: list[str]) -> list[tuple[str, dict]]:
    """Every dict in ``tree`` whose keys are exactly ``keys`` (the dtype names), with its path.

    What a sharded state's shard trees look like whatever world they were cut for
    (used to report a state cut for another world size).
    """
    found = []

    def walk(node: Any, path: list) -> None:
        if isinstance(node, dict) and sorted(node) == keys and all(torch.is_tensor(v) for v in node.values()):
            found.append((path_str(path), node))
            return
        if isinstance(node, dict):
            for k in node:
                walk(node[k], path + [k])
        elif isinstance(node, (list, tuple)):
            fields = getattr(node, "_fields", None)
            for i, v in enumerate(node):
                walk(v, path + [fields[i] if fields else i])

    walk(tree, [])
    return found
