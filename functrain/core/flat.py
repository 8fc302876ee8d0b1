"""One flat layout: a params tree (and everything shaped like it) as one contiguous buffer per dtype.

:class:`FlatLayout` says where each leaf of a params tree lives in one 1-D buffer per
dtype (the leaves laid end to end in pytree order, what JAX's ``ravel_pytree`` and
FSDP's flat parameter do) and, for ``world`` ranks, which slice of each buffer rank
``r`` owns (the buffers padded with zeros to a multiple of ``world``; ``S = ceil(numel
/ world)``, rank ``r`` owning ``[r * S, (r + 1) * S)``). The same type serves both:

* **the flat state** (``world = 1``): a :class:`FlatParams` holds a params tree as its
  buffers and reads like the tree (``params["fc.weight"]`` is a view with the leaf's
  shape, ``params.tree()`` the whole ``{name: tensor}`` tree of views). As a pytree its
  children are the buffers, so everything the step maps over the params maps over the
  buffers instead: the optimizer's moments and the EMA built by ``tree_map`` from flat
  params are flat too, one Adam update is one elementwise pass over one buffer, and a
  compiled step has a handful of inputs instead of three per parameter. The gradient is
  taken with respect to the per-leaf views (the loss function sees a plain ``{name:
  tensor}`` dict) and packed into one buffer per dtype by one concatenation. Asked
  (``blocks=True``), each repeated block (``blocks.3.…``) has buffers of its own
  (``"float32@blocks.3"``, :mod:`~functrain.core.flat_blocks`), so identical blocks have
  identical layouts.
* **sharded data parallelism** (``world = N``): a *shard tree* ``{dtype name: 1-D tensor
  of S}`` is this rank's slice; sharded params, optimizer moments and params-shaped
  slot fields are held as shard trees. A sharded :class:`~functrain.TrainState`
  carries a :class:`ShardState` in ``state.slots["data_parallel"]`` (rank, world size
  and the params' dtypes and shapes as small int64 tensors), so a sharded state or
  checkpoint describes itself: it can be gathered or resharded without the step that
  made it.

Checkpoints do not see the flat form: :func:`unflat` turns every flat node back into
its named tree (views, no copy) before saving, and loading into a flat template packs
the named tensors again, so a checkpoint of a flat state is the same file as one of the
plain state. Everything here is pure tensor code on Python-int offsets: it runs eagerly
and inside a compiled step alike, and no communication happens in this module.

Example::

    >>> import torch, functrain as ft
    >>> from functrain.core.flat import FlatLayout
    >>> params = {"w": torch.ones(2, 3), "b": torch.zeros(3)}
    >>> flat = ft.flat(params)
    >>> flat.buffers["float32"].shape           # b then w: optree sorts dict keys
    torch.Size([9])
    >>> flat["w"].shape, flat["w"].data_ptr() == flat.buffers["float32"][3:].data_ptr()
    (torch.Size([2, 3]), True)
    >>> ft.tree.tree_map(torch.zeros_like, flat).buffers["float32"].shape
    torch.Size([9])
    >>> FlatLayout.from_params(params, world=2, rank=1).shard_of(params)   # rank 1's half of the 9, padded
    {'float32': tensor([1., 1., 1., 1., 0.])}
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Callable, Iterator, NamedTuple

import optree
import torch

from .eager import tracing
from .flat_blocks import blocks_by_name, buffer_key
from .registry import register_checkpoint_type
from .validate import path_str

__all__ = ["FlatLayout", "FlatParams", "ShardState", "SLOT", "DTYPES", "flat", "unflat", "reflat", "is_flat",
           "split_leaves", "find_shard_trees"]

SLOT = "data_parallel"  # the slot of a sharded state (the sharded data_parallel transform's name)

# dtype codes stored in ShardState.layout: the index in this tuple (append only: saved checkpoints use them)
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16,
          getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None))


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``: the key of that dtype's buffer."""
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
    """Where each leaf of a params tree lives in the per-dtype flat buffers, and which slice rank ``rank`` of
    ``world`` owns (``world=1``: the whole unpadded buffers, the flat state's layout).

    Python ints only, computed once; hashable and compared as a value (the pytree metadata of a
    :class:`FlatParams`). ``spec``: the params' treespec; ``keys``: the dtype names of the buffers,
    sorted; ``dtypes[key]``: the dtype; ``entries``: per leaf, ``(key, shape, numel, offset)``;
    ``numel[key]``: the unpadded buffer length; ``size[key]``: the shard length ``ceil(numel / world)``;
    ``names``: the leaves' path names. Two layouts are equal when the params' structure, dtypes and
    shapes, the blocks, the world and the rank are.

    ``blocks=True`` (world 1 only: the flat state's layout) gives each repeated block of the params
    (:func:`~functrain.core.flat_blocks.blocks_by_name`: ``blocks.0.…``, ``blocks.1.…`` alike in names, dtypes and shapes) buffers of its
    own, keyed ``"<dtype>@<block>"``, and the other leaves the dtype's buffer: identical blocks then have
    identical layouts (the same offsets in buffers of the same size), so while a compiled step is traced the
    calls of identical blocks look alike to torch's fake-tensor cache, which keys on each input's storage offset
    and storage size (bench/README.md, issue 29).
    """

    __slots__ = ("spec", "world", "rank", "dtypes", "keys", "entries", "numel", "size", "names", "blocks",
                 "_index", "_key", "_hash")

    def __init__(self, spec: Any, dtypes: list[torch.dtype], shapes: list[tuple[int, ...]], world: int = 1,
                 rank: int = 0, blocks: bool = False):
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is outside world size {world}")
        if blocks and world != 1:
            raise ValueError(f"blocks=True (a buffer per repeated block) is the flat state's layout, for world "
                             f"size 1; a layout cut for {world} ranks has one buffer per dtype")
        self.spec, self.world, self.rank = spec, int(world), int(rank)
        paths = optree.tree_paths(optree.tree_unflatten(spec, [0] * len(dtypes)))
        self.names = tuple(path_str(p) for p in paths)
        owner = blocks_by_name(list(self.names), dtypes, shapes) if blocks else [""] * len(dtypes)
        self.blocks = bool(blocks)
        keys = [buffer_key(d, b) for d, b in zip(dtypes, owner)]
        self.dtypes = {k: d for k, d in zip(keys, dtypes)}
        self.keys = tuple(sorted(self.dtypes))
        entries, offset = [], {k: 0 for k in self.keys}
        for k, shape in zip(keys, shapes):
            n = math.prod(shape)
            entries.append((k, tuple(shape), n, offset[k]))
            offset[k] += n
        self.entries: tuple[tuple[str, tuple[int, ...], int, int], ...] = tuple(entries)
        self.numel = offset
        self.size = {k: -(-n // self.world) if n else 0 for k, n in offset.items()}
        # a top-level dict of tensors (what ft.functionalize gives): params[name] is one view
        self._index: dict | None = None
        if spec.type is dict and all(len(p) == 1 for p in paths):
            self._index = {p[0]: i for i, p in enumerate(paths)}
        # compared as Python values (a str, tuples, ints), so that Dynamo can compare two layouts while tracing
        self._key = (repr(spec), self.entries, self.world, self.rank)
        self._hash = hash(self._key)

    # -- construction -------------------------------------------------------------------------------
    @classmethod
    def from_params(cls, params: Any, world: int = 1, rank: int = 0, blocks: bool = False) -> "FlatLayout":
        """The layout of ``params`` (floating tensors of :data:`DTYPES`, on one device), cut for ``world`` ranks
        (``blocks=True``: a buffer per repeated block, world 1 only)."""
        leaves, spec = optree.tree_flatten(params)
        for path, leaf in zip(optree.tree_paths(params), leaves):
            if not torch.is_tensor(leaf) or leaf.dtype not in DTYPES:
                raise TypeError(f"params leaf {path_str(path)!r} must be a floating-point tensor of one of "
                                f"{[dtype_name(d) for d in DTYPES if d is not None]} to be laid in a flat buffer; "
                                f"got {getattr(leaf, 'dtype', type(leaf).__name__)}")
        if not leaves:
            raise ValueError("params is empty: there is nothing to lay in a flat buffer")
        devices = {leaf.device for leaf in leaves}
        if len(devices) > 1:
            raise ValueError(f"all params must be on one device to share a flat buffer; got "
                             f"{sorted(map(str, devices))}")
        return cls(spec, [x.dtype for x in leaves], [tuple(x.shape) for x in leaves], world, rank, blocks)

    @classmethod
    def from_slot(cls, slot: ShardState, world: int | None = None, rank: int | None = None) -> "FlatLayout":
        """The layout a :class:`ShardState` describes (host reads; for another world/rank if given)."""
        leaves, spec = optree.tree_flatten(slot.layout)
        codes = [[int(v) for v in leaf.tolist()] for leaf in leaves]
        dtypes = [DTYPES[c[0]] for c in codes]
        return cls(spec, dtypes, [tuple(c[1:]) for c in codes],
                   int(slot.world) if world is None else world, int(slot.rank) if rank is None else rank)

    def slot(self, params_sharded: bool, device: Any = None) -> ShardState:
        """This layout as the state's :class:`ShardState` slot."""
        codes = [torch.tensor([DTYPES.index(self.dtypes[k]), *shape], dtype=torch.int64, device=device)
                 for k, shape, _, _ in self.entries]
        scalar = lambda v, dt: torch.tensor(v, dtype=dt, device=device)  # noqa: E731
        return ShardState(scalar(self.rank, torch.int64), scalar(self.world, torch.int64),
                          scalar(bool(params_sharded), torch.bool), optree.tree_unflatten(self.spec, codes))

    def same_params(self, other: "FlatLayout") -> bool:
        """Whether both describe the same params (structure, dtypes and shapes), whatever the world."""
        return self.spec == other.spec and [(self.dtypes[k], s) for k, s, _, _ in self.entries] == \
            [(other.dtypes[k], s) for k, s, _, _ in other.entries]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FlatLayout) and self._key == other._key

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        per: dict[str, list[int]] = {}
        for k in self.keys:
            per.setdefault(dtype_name(self.dtypes[k]), []).append(self.numel[k])
        sizes = ", ".join(f"{d}: {sum(n)}" + (f" in {len(n)} buffers" if len(n) > 1 else "") for d, n in per.items())
        cut = f"; rank {self.rank} of {self.world}" if self.world > 1 else ""
        return f"FlatLayout({len(self.entries)} leaves; {sizes}{cut})"

    @property
    def index(self) -> dict[str, int] | None:
        """``{name: leaf index}`` when the params are a top-level ``{name: tensor}`` dict (what
        ``ft.functionalize`` gives), in leaf order; ``None`` for another tree."""
        return self._index

    # -- buffers <-> trees --------------------------------------------------------------------------
    def views(self, buffers: dict) -> list[torch.Tensor]:
        """The per-leaf views of whole buffers (``numel`` long at least) in pytree order."""
        return [buffers[k][off:off + n].view(shape) for k, shape, n, off in self.entries]

    def unflatten(self, leaves: list) -> Any:
        """The params tree from per-leaf tensors in pytree order. A ``{name: tensor}`` dict is built
        directly (Dynamo cannot unflatten with a treespec made outside its trace)."""
        if self._index is not None:
            return dict(zip(self._index, leaves))
        return optree.tree_unflatten(self.spec, leaves)

    def tree(self, buffers: dict, like: Any = None) -> Any:
        """The params tree of views of whole (for shards: gathered) buffers.

        ``like``: any tree with the params' structure (inside a compiled step, the state's
        :class:`ShardState` ``layout``: Dynamo rebuilds trees only from structures it flattened itself).
        """
        if like is None:
            return self.unflatten(self.views(buffers))
        return optree.tree_unflatten(optree.tree_flatten(like)[1], self.views(buffers))

    def pack(self, leaves: list[torch.Tensor], copy: bool = True) -> dict[str, torch.Tensor]:
        """The whole buffers, ``{dtype name: 1-D tensor of world * size}``, from per-leaf tensors in pytree order:
        one concatenation each, the leaves end to end then zeros (what a reduce-scatter cuts into the shards).

        ``copy=False`` lets a dtype with a single leaf and no padding be a flat view of it (the gradient's case)."""
        groups: dict[str, list] = {k: [] for k in self.keys}
        for (k, _, _, _), leaf in zip(self.entries, leaves):
            groups[k].append(leaf.reshape(-1))
        for k, g in groups.items():
            pad = self.world * self.size[k] - self.numel[k]
            if pad:
                g.append(torch.zeros(pad, dtype=g[0].dtype, device=g[0].device))
        return {k: (g[0].clone() if copy else g[0]) if len(g) == 1 else torch.cat(g) for k, g in groups.items()}

    def flatten(self, tree: Any) -> dict[str, torch.Tensor]:
        """:meth:`pack` of a tree shaped like the params (views where no concatenation is needed)."""
        return self.pack(self._leaves(tree), copy=False)

    # -- shards -------------------------------------------------------------------------------------
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

    # -- this rank's parts: what a sharded init builds the state from --------------------------------
    def part_sizes(self, rank: int | None = None) -> list[int]:
        """Per leaf (pytree order), how many of its elements fall in ``rank``'s slice (default: this one)."""
        out = []
        for k, _, n, off in self.entries:
            lo, hi = self.span(k, rank)
            out.append(max(0, min(hi, off + n) - max(lo, off)))
        return out

    def parts(self, shard: dict[str, torch.Tensor]) -> "FlatParams":
        """This rank's elements of each leaf, as a :class:`FlatParams` over the owned, unpadded prefix of
        ``shard`` (a shard tree of this layout; no copy): leaf ``i`` is the 1-D run of its elements in this
        rank's slice (empty if none), under the params' names. What an elementwise ``init`` maps over it
        (an optimizer's zero moments, an EMA's copy) is the flat form of its shard, never the whole:
        :meth:`from_parts` turns it into the shard tree.

        Example::

            >>> import torch
            >>> lay = FlatLayout.from_params({"a": torch.ones(4), "b": torch.ones(2)}, world=2, rank=1)
            >>> part = lay.parts({"float32": torch.arange(3.0)})
            >>> part["a"], part["b"], lay.from_parts(part)
            (tensor([0.]), tensor([1., 2.]), {'float32': tensor([0., 1., 2.])})
        """
        sizes = self.part_sizes()
        used = {k: sum(n for (key, _, _, _), n in zip(self.entries, sizes) if key == k) for k in self.keys}
        layout = FlatLayout(self.spec, [self.dtypes[e[0]] for e in self.entries], [(n,) for n in sizes])
        return FlatParams({k: shard[k][:used[k]] for k in self.keys}, layout)

    def is_parts(self, node: Any) -> bool:
        """Whether ``node`` is a :class:`FlatParams` of this rank's parts (what :meth:`parts` makes)."""
        return (isinstance(node, FlatParams) and node.layout.world == 1 and node.layout.spec == self.spec
                and [e[1] for e in node.layout.entries] == [(n,) for n in self.part_sizes()])

    def from_parts(self, node: "FlatParams") -> dict[str, torch.Tensor]:
        """The shard tree of a :meth:`parts`-shaped :class:`FlatParams`: its buffers, zero-padded to the shard
        size where this rank's slice runs past the end (the buffer itself where it does not: no copy)."""
        out = {}
        for k in self.keys:
            buf = node.buffers[k]
            pad = self.size[k] - buf.numel()
            out[k] = torch.cat([buf, buf.new_zeros(pad)]) if pad else buf
        return out

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
        return (isinstance(node, dict) and sorted(node) == list(self.keys)
                and all(torch.is_tensor(node[k]) and node[k].dtype == self.dtypes[k]
                        and tuple(node[k].shape) == (self.size[k],) for k in self.keys))

    def is_params_like(self, node: Any) -> bool:
        """Whether ``node`` has the params' structure, dtypes and shapes (an optimizer moment, an EMA).

        (While tracing, the structure itself is not compared, only the leaves' count, dtypes and shapes:
        Dynamo cannot compare a tree structure made outside the graph.)
        """
        if not tracing() and optree.tree_structure(node) != self.spec:
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
    keys = sorted(keys)

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


class FlatParams(Mapping):
    """A params tree held as one 1-D buffer per dtype; reads like the tree (by name, as views).

    Build one with :func:`flat` rather than by hand. Mapping access (``params[name]``,
    ``params.items()``, ``{**params}``) works when the params are a ``{name: tensor}``
    dict, the form :func:`functrain.functionalize` gives; :meth:`tree` works for any
    structure. It is a pytree node whose children are the buffers.

    Args:
        buffers: ``{dtype name: 1-D tensor}``, one buffer per dtype, in the layout's order.
        layout: the :class:`FlatLayout` (``world = 1``) saying where each leaf lives.

    Attributes:
        buffers: the buffers, as given.
        layout: the layout, as given.

    Example::

        >>> import torch, functrain as ft
        >>> p = ft.flat({"w": torch.arange(4.0).view(2, 2), "h": torch.ones(1, dtype=torch.float64)})
        >>> p["w"]
        tensor([[0., 1.],
                [2., 3.]])
        >>> p
        FlatParams(2 leaves in {float32: (4,) torch.float32, float64: (1,) torch.float64})
    """

    __slots__ = ("buffers", "layout")

    def __init__(self, buffers: dict, layout: FlatLayout):
        self.buffers = buffers
        self.layout = layout

    def tree(self) -> Any:
        """The params tree, each leaf a view of its buffer (no copy).

        Returns:
            The tree in the structure the params were flattened from.
        """
        return self.layout.tree(self.buffers)

    def _dict_index(self) -> dict:
        index = self.layout._index
        if index is None:
            raise TypeError(f"this FlatParams holds a {self.layout.spec.type.__name__} params tree, not a "
                            f"{{name: tensor}} dict: use .tree() to read it")
        return index

    def __getitem__(self, name: str) -> torch.Tensor:
        i = self._dict_index().get(name)
        if i is None:
            raise KeyError(name)
        k, shape, n, off = self.layout.entries[i]
        return self.buffers[k][off:off + n].view(shape)

    def __iter__(self) -> Iterator[str]:
        return iter(self._dict_index())

    def __len__(self) -> int:
        return len(self.layout.entries)

    def __contains__(self, name: object) -> bool:
        return name in self._dict_index()

    def __repr__(self) -> str:
        bufs = ", ".join(f"{k}: {tuple(v.shape)} {v.dtype}" for k, v in self.buffers.items())
        return f"FlatParams({len(self.layout.entries)} leaves in {{{bufs}}})"


def _flatten(node: FlatParams) -> tuple:
    keys = node.layout.keys
    return tuple(node.buffers[k] for k in keys), node.layout, keys


def _unflatten(layout: FlatLayout, children: Any) -> FlatParams:
    return FlatParams(dict(zip(layout.keys, children)), layout)


def _register() -> None:
    # The global optree namespace: every optree call (functrain's, the user's, Dynamo's polyfills) sees the
    # buffers as the children. optree's public spelling of that namespace is this sentinel.
    from optree.registry import __GLOBAL_NAMESPACE as GLOBAL  # noqa: N811 - optree's own name for it
    optree.register_pytree_node(FlatParams, _flatten, _unflatten, path_entry_type=optree.MappingEntry,
                                namespace=GLOBAL)


_register()  # registering our own class's pytree behaviour: no effect on any other type


# -- conversions ----------------------------------------------------------------------------------
def _flat_layout(params: Any, blocks: bool) -> FlatLayout:
    try:
        return FlatLayout.from_params(params, blocks=blocks)
    except (TypeError, ValueError) as e:
        raise type(e)(f"ft.flat: {e}") from None


def is_flat(x: Any) -> bool:
    """Whether ``x`` is a :class:`FlatParams`."""
    return isinstance(x, FlatParams)


def flat(tree: Any, *, blocks: bool = False) -> Any:
    """The flat form of a params tree, or of a state: one contiguous buffer per dtype (a copy).

    The values are the same; only the memory layout changes, and a step runs on either
    form with the same results. ``blocks=True`` gives each repeated block (``blocks.0.…``, ``blocks.1.…``: the
    same names, dtypes and shapes after the index, see :func:`~functrain.core.flat_blocks.blocks_by_name`)
    buffers of its own, so identical blocks have identical layouts and the trace's fake-tensor cache hits on
    them; measured, that does not shorten a deep compile (inductor then emits an update per block: see
    bench/README.md, "compile flat in depth"), so it is off by default.

    Args:
        tree: a params tree (floating tensors, one device), a :class:`FlatParams` (returned as it
            is), or a :class:`~functrain.TrainState` (not one sharded by ``data_parallel(shard=...)``).
        blocks: a buffer per repeated block, or (default) one buffer per dtype for all leaves.

    Returns:
        For a params tree, a :class:`FlatParams`. For a state, the state with its params and every
        subtree shaped like them (optimizer moments, the EMA's params) flat; what is already flat
        stays as it is.

    Raises:
        TypeError: a leaf that is not a floating-point tensor of a supported dtype (named in the message).
        ValueError: leaves on several devices, or a sharded state.

    Example::

        >>> import torch, functrain as ft
        >>> step = ft.train_step(lambda p, b, x: (p["w"] * x).sum(), ft.optim.adamw(1e-3))
        >>> state = ft.flat(step.init({"w": torch.ones(3)}))
        >>> type(state.opt_state.exp_avg).__name__
        'FlatParams'
    """
    if isinstance(tree, FlatParams):
        return tree
    params = getattr(tree, "params", None)
    if params is None or not hasattr(tree, "_replace"):
        layout = _flat_layout(tree, blocks)
        return FlatParams(layout.pack(optree.tree_leaves(tree)), layout)
    slots = getattr(tree, "slots", None)
    if isinstance(slots, dict) and isinstance(slots.get(SLOT), ShardState):
        raise ValueError("ft.flat: this state is sharded over ranks (data_parallel(shard=...)), whose params, "
                         "moments and EMA are flat shards already; flatten a replicated or single-process state")
    layout = params.layout if isinstance(params, FlatParams) else _flat_layout(params, blocks)

    def params_like(node: Any) -> bool:
        if isinstance(node, FlatParams):
            return True
        if not isinstance(node, (dict, list, tuple)):
            return False
        try:
            return layout.is_params_like(node)
        except Exception:  # noqa: BLE001 - an unflattenable node is not params-shaped
            return False

    def convert(node: Any) -> Any:
        if isinstance(node, FlatParams) or not params_like(node):
            return node
        return FlatParams(layout.pack(optree.tree_leaves(node)), layout)

    return optree.tree_map(convert, tree, is_leaf=lambda n: params_like(n) or torch.is_tensor(n), none_is_leaf=True)


def unflat(tree: Any) -> Any:
    """``tree`` with every :class:`FlatParams` replaced by its named tree of views (no copy).

    What a flat state looks like to code that walks it by name: checkpoints,
    exports, comparisons with a plain state (``ft.testing``).

    Args:
        tree: any pytree, a :class:`FlatParams` or a state holding them.

    Returns:
        The same structure with each :class:`FlatParams` node its params tree; ``tree`` itself
        when it holds none.

    Example::

        >>> import torch, functrain as ft
        >>> ft.unflat({"p": ft.flat({"w": torch.ones(2)})})
        {'p': {'w': tensor([1., 1.])}}
    """
    if not _has_flat(tree):
        return tree
    return optree.tree_map(lambda n: n.tree() if isinstance(n, FlatParams) else n, tree,
                           is_leaf=_is_flat_node, none_is_leaf=True)


def reflat(tree: Any, template: Any) -> Any:
    """``tree`` (a named tree, e.g. loaded from a checkpoint) made flat where ``template`` is flat.

    ``tree`` must have ``unflat(template)``'s structure; each subtree at a flat node of
    ``template`` is packed into new buffers with that node's layout (placed on the
    device of ``template``'s buffer).
    """
    if not _has_flat(template):
        return tree

    def convert(t: Any, sub: Any) -> Any:
        if not isinstance(t, FlatParams):
            return sub
        out = t.layout.pack(t.layout.spec.flatten_up_to(sub))
        return FlatParams({k: v.to(t.buffers[k].device) for k, v in out.items()}, t.layout)

    return optree.tree_map(convert, template, tree, is_leaf=_is_flat_node, none_is_leaf=True)


def _is_flat_node(node: Any) -> bool:
    return isinstance(node, FlatParams)


def _has_flat(tree: Any) -> bool:
    return any(map(_is_flat_node, optree.tree_leaves(tree, is_leaf=_is_flat_node, none_is_leaf=True)))


def split_leaves(params: Any, flatten: Callable = optree.tree_flatten
                 ) -> tuple[list[torch.Tensor], Callable[[list], Any], Callable[[list], Any]]:
    """What the grad stage differentiates: ``(leaves, as_params, as_grads)``.

    For a plain params tree: its leaves (``flatten(params)``), and unflatten for both. For
    :class:`FlatParams`: the per-leaf views (``as_params`` gives the loss function the
    plain ``{name: tensor}`` tree of them) and ``as_grads`` packs the per-leaf
    gradients into one flat buffer per dtype (one concatenation; a single leaf's
    gradient is used as it is), the flat gradient the optimizer takes.
    """
    if isinstance(params, FlatParams):
        layout = params.layout
        return (layout.views(params.buffers), layout.unflatten,
                lambda gs: FlatParams(layout.pack(gs, copy=False), layout))
    leaves, tspec = flatten(params)
    rebuild = lambda ls: optree.tree_unflatten(tspec, ls)  # noqa: E731
    return leaves, rebuild, rebuild
