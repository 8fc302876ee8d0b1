"""The flat state: params (and everything shaped like them) as one contiguous buffer per dtype.

A :class:`FlatParams` holds a params tree as one 1-D buffer per dtype (the
leaves laid end to end in pytree order, what JAX's ``ravel_pytree`` and FSDP's
flat parameter do) and reads like the tree it came from: ``params["fc.weight"]``
is a view of the buffer with the leaf's shape, ``dict(params)`` /
``params.tree()`` the whole ``{name: tensor}`` tree of views, ``{**params}`` works
wherever a dict of tensors does.

As a pytree (optree) its children are the buffers, so everything the step maps
over the params maps over the buffers instead: the optimizer's moments and the
EMA built by ``tree_map`` from flat params are flat too, one Adam update is one
elementwise pass over one buffer (one fused kernel compiled, one ``_foreach``
call of one tensor eager), data parallelism all-reduces one buffer per dtype,
and a compiled step has a handful of inputs instead of three per parameter.
The gradient is taken with respect to the per-leaf views (the loss function
sees a plain ``{name: tensor}`` dict) and laid into one flat buffer per dtype
by one concatenation.

Checkpoints do not see the flat form: :func:`unflat` turns every flat node back
into its named tree (views, no copy) before saving, and loading into a flat
template flattens the named tensors again, so a checkpoint of a flat state is
the same file as one of the plain state, readable by name and loadable into
either.

Example::

    >>> import torch, functrain as ft
    >>> params = {"w": torch.ones(2, 3), "b": torch.zeros(3)}
    >>> flat = ft.flat(params)
    >>> flat.buffers["float32"].shape           # b then w: optree sorts dict keys
    torch.Size([9])
    >>> flat["w"].shape, flat["w"].data_ptr() == flat.buffers["float32"][3:].data_ptr()
    (torch.Size([2, 3]), True)
    >>> ft.tree.tree_map(torch.zeros_like, flat).buffers["float32"].shape
    torch.Size([9])
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, Iterator

import optree
import torch

from .validate import path_str
from .layout import SLOT, FlatLayout, ShardState

__all__ = ["FlatParams", "FlatSpec", "flat", "unflat", "reflat", "is_flat", "split_leaves"]


class FlatSpec:
    """Where each leaf of a params tree lives in the per-dtype buffers (hashable; the flat node's pytree metadata).

    ``spec``: the params' treespec; ``keys``: the dtype names of the buffers, sorted;
    ``entries``: per leaf, ``(key, shape, numel, offset)``; ``numel[key]``: buffer length.
    Two specs are equal when the params' structure, dtypes and shapes are.
    """

    __slots__ = ("spec", "keys", "entries", "numel", "names", "_index", "_key", "_hash")

    def __init__(self, spec: Any, dtypes: list[torch.dtype], shapes: list[tuple[int, ...]]):
        layout = FlatLayout(spec, dtypes, shapes, world=1, rank=0)  # the sharded layout, on one rank: no padding
        self.spec = spec
        self.entries = tuple(layout.entries)
        self.keys = tuple(layout.keys)
        self.numel = layout.numel
        paths = optree.tree_paths(optree.tree_unflatten(spec, [0] * len(self.entries)))
        self.names = tuple(path_str(p) for p in paths)
        # a top-level dict of tensors (what ft.functionalize gives): params[name] is one view
        self._index: dict | None = None
        if spec.type is dict and all(len(p) == 1 for p in paths):
            self._index = {p[0]: i for i, p in enumerate(paths)}
        # compared as Python values (a str and tuples), so that Dynamo can compare two specs while tracing
        self._key = (repr(spec), self.entries)
        self._hash = hash(self._key)

    @classmethod
    def of(cls, params: Any) -> "FlatSpec":
        leaves, spec = optree.tree_flatten(params)
        for path, leaf in zip(optree.tree_paths(params), leaves):
            if not torch.is_tensor(leaf) or not leaf.is_floating_point():
                raise TypeError(f"ft.flat: params leaf {path_str(path)!r} must be a floating-point tensor; got "
                                f"{getattr(leaf, 'dtype', type(leaf).__name__)}")
        if not leaves:
            raise ValueError("ft.flat: params is empty: there is nothing to flatten")
        devices = {leaf.device for leaf in leaves}
        if len(devices) > 1:
            raise ValueError(f"ft.flat: all params must be on one device to share a buffer; got {sorted(map(str, devices))}")
        return cls(spec, [x.dtype for x in leaves], [tuple(x.shape) for x in leaves])

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FlatSpec) and self._key == other._key

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        sizes = ", ".join(f"{k}: {self.numel[k]}" for k in self.keys)
        return f"FlatSpec({len(self.entries)} leaves; {sizes})"

    # -- buffers <-> views --------------------------------------------------------------------------
    def views(self, buffers: dict) -> list[torch.Tensor]:
        """The per-leaf views of ``buffers`` in pytree order."""
        return [buffers[k][off:off + n].view(shape) for k, shape, n, off in self.entries]

    def tree(self, buffers: dict) -> Any:
        """The params tree of views of ``buffers``."""
        return self.unflatten(self.views(buffers))

    def unflatten(self, leaves: list) -> Any:
        """The params tree from per-leaf tensors in pytree order. A ``{name: tensor}`` dict is built
        directly (Dynamo cannot unflatten with a treespec made outside its trace)."""
        if self._index is not None:
            return dict(zip(self._index, leaves))
        return optree.tree_unflatten(self.spec, leaves)

    def pack(self, leaves: list[torch.Tensor], copy: bool = True) -> dict[str, torch.Tensor]:
        """One buffer per dtype from per-leaf tensors in pytree order (one concatenation each).

        ``copy=False`` lets a dtype with a single leaf be a flat view of it (the gradient's case)."""
        groups: dict[str, list] = {k: [] for k in self.keys}
        for (k, _, _, _), leaf in zip(self.entries, leaves):
            groups[k].append(leaf.reshape(-1))
        return {k: (g[0].clone() if copy else g[0]) if len(g) == 1 else torch.cat(g) for k, g in groups.items()}


class FlatParams(Mapping):
    """A params tree held as one 1-D buffer per dtype; reads like the tree (by name, as views).

    ``buffers``: ``{dtype name: 1-D tensor}``; ``spec``: the :class:`FlatSpec`. Build
    one with :func:`flat`. Mapping access (``params[name]``, ``params.items()``,
    ``{**params}``) works when the params are a ``{name: tensor}`` dict, the form
    :func:`functrain.functionalize` gives; :meth:`tree` works for any structure.

    Example::

        >>> import torch, functrain as ft
        >>> p = ft.flat({"w": torch.arange(4.0).view(2, 2)})
        >>> p["w"]
        tensor([[0., 1.],
                [2., 3.]])
    """

    __slots__ = ("buffers", "spec")

    def __init__(self, buffers: dict, spec: FlatSpec):
        self.buffers = buffers
        self.spec = spec

    def tree(self) -> Any:
        """The params tree, each leaf a view of its buffer (no copy)."""
        return self.spec.tree(self.buffers)

    def _dict_index(self) -> dict:
        index = self.spec._index
        if index is None:
            raise TypeError(f"this FlatParams holds a {self.spec.spec.type.__name__} params tree, not a flat "
                            f"{{name: tensor}} dict: use .tree() to read it")
        return index

    def __getitem__(self, name: str) -> torch.Tensor:
        i = self._dict_index().get(name)
        if i is None:
            raise KeyError(name)
        k, shape, n, off = self.spec.entries[i]
        return self.buffers[k][off:off + n].view(shape)

    def __iter__(self) -> Iterator[str]:
        return iter(self._dict_index())

    def __len__(self) -> int:
        return len(self.spec.entries)

    def __contains__(self, name: object) -> bool:
        return name in self._dict_index()

    def __repr__(self) -> str:
        bufs = ", ".join(f"{k}: {tuple(v.shape)} {v.dtype}" for k, v in self.buffers.items())
        return f"FlatParams({len(self.spec.entries)} leaves in {{{bufs}}})"


def _flatten(node: FlatParams) -> tuple:
    keys = node.spec.keys
    return tuple(node.buffers[k] for k in keys), node.spec, keys


def _unflatten(spec: FlatSpec, children: Any) -> FlatParams:
    return FlatParams(dict(zip(spec.keys, children)), spec)


def _register() -> None:
    # The global optree namespace: every optree call (functrain's, the user's, Dynamo's polyfills) sees the
    # buffers as the children. optree's public spelling of that namespace is this sentinel.
    from optree.registry import __GLOBAL_NAMESPACE as GLOBAL  # noqa: N811 - optree's own name for it
    optree.register_pytree_node(FlatParams, _flatten, _unflatten, path_entry_type=optree.MappingEntry,
                                namespace=GLOBAL)


_register()  # registering our own class's pytree behaviour: no effect on any other type


# -- conversions ----------------------------------------------------------------------------------
def is_flat(x: Any) -> bool:
    """Whether ``x`` is a :class:`FlatParams`."""
    return isinstance(x, FlatParams)


def flat(tree: Any) -> Any:
    """The flat form of a params tree, or of a state: one contiguous buffer per dtype (a copy).

    Given a params tree (floating tensors, one device), a :class:`FlatParams`.
    Given a :class:`~functrain.TrainState`, the state with its params and every
    subtree shaped like them (optimizer moments, the EMA's params) flat; what is
    already flat stays as it is. The values are the same; only the memory layout
    changes, and a step runs on either form with the same results.

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
        spec = FlatSpec.of(tree)
        return FlatParams(spec.pack(optree.tree_leaves(tree)), spec)
    slots = getattr(tree, "slots", None)
    if isinstance(slots, dict) and isinstance(slots.get(SLOT), ShardState):
        raise ValueError("ft.flat: this state is sharded over ranks (data_parallel(shard=...)), whose params, "
                         "moments and EMA are flat shards already; flatten a replicated or single-process state")
    spec = params.spec if isinstance(params, FlatParams) else FlatSpec.of(params)
    dtypes = [getattr(torch, e[0]) for e in spec.entries]

    def params_like(node: Any) -> bool:
        if isinstance(node, FlatParams):
            return True
        if not isinstance(node, (dict, list, tuple)):
            return False
        try:
            if optree.tree_structure(node) != spec.spec:
                return False
        except Exception:  # noqa: BLE001 - an unflattenable node is not params-shaped
            return False
        leaves = optree.tree_leaves(node)
        return all(torch.is_tensor(x) and x.dtype == d and tuple(x.shape) == e[1]
                   for x, d, e in zip(leaves, dtypes, spec.entries))

    def convert(node: Any) -> Any:
        if isinstance(node, FlatParams) or not params_like(node):
            return node
        return FlatParams(spec.pack(optree.tree_leaves(node)), spec)

    return optree.tree_map(convert, tree, is_leaf=lambda n: params_like(n) or torch.is_tensor(n), none_is_leaf=True)


def unflat(tree: Any) -> Any:
    """``tree`` with every :class:`FlatParams` replaced by its named tree of views (no copy).

    What a flat state looks like to code that walks it by name: checkpoints,
    exports, comparisons with a plain state (``ft.testing``).

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
    ``template`` is packed into new buffers with that node's spec (placed on the
    device of ``template``'s buffer).
    """
    if not _has_flat(template):
        return tree

    def convert(t: Any, sub: Any) -> Any:
        if not isinstance(t, FlatParams):
            return sub
        out = t.spec.pack(t.spec.spec.flatten_up_to(sub))
        return FlatParams({k: v.to(t.buffers[k].device) for k, v in out.items()}, t.spec)

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
        spec = params.spec
        return (spec.views(params.buffers), spec.unflatten,
                lambda gs: FlatParams(spec.pack(gs, copy=False), spec))
    leaves, tspec = flatten(params)
    rebuild = lambda ls: optree.tree_unflatten(tspec, ls)  # noqa: E731
    return leaves, rebuild, rebuild
