"""Eager-only shortcuts: reading a host scalar (and the test of when that is safe), flattening a
flat dict of tensors against a cached treespec.

A functrain step is written once for both eager calls and tracing (``torch.compile``,
``make_fx``): every decision on a tensor is a device-side select and every scalar a
tensor, so a trace never syncs. Eagerly, with the value in host memory, that costs a
dozen tiny tensor ops per step where Python arithmetic gives the same numbers. Code
that takes the shortcut asks :func:`host_number` and keeps the tensor path otherwise.

:class:`FlatDict` is the other per-step cost of small models: ``optree.tree_flatten`` of a
``{name: tensor}`` dict costs about ten times what reading its values in the cached order does.
"""
from __future__ import annotations

from typing import Any

import optree
import torch

__all__ = ["host_number", "FlatDict"]


def host_number(x: Any) -> Any:
    """``x`` as a Python number when reading it is free and cannot end up baked into a trace, else ``x``.

    That is a plain 0-dim CPU tensor in eager code: not a fake, functional or
    batched tensor, not under ``torch.compile`` / ``make_fx`` (``is_compiling``, a dispatch
    mode), not wrapped by a ``torch.func`` transform. Reading such a tensor is a host memory
    read, not a device sync, and ``.tolist()`` runs no aten op. The optimizers use it for the
    step counter and a scheduled lr: their scalar math (bias corrections, step size) is then
    Python floats, as in ``torch.optim``'s for-loop and foreach paths (the same numbers, and
    about ten tiny tensor ops fewer per update). Anything else stays a tensor: a traced or
    device-side counter keeps the sync-free tensor math.

    Example::

        >>> import torch
        >>> from functrain.core.eager import host_number
        >>> host_number(torch.tensor(3)), host_number(2.5)
        (3, 2.5)
    """
    if (type(x) is torch.Tensor and x.is_cpu and x.dim() == 0 and not torch.compiler.is_compiling()
            and not torch._C._len_torch_dispatch_stack() and not torch._C._functorch.is_functorch_wrapped_tensor(x)):
        return x.tolist()
    return x


class FlatDict:
    """``optree.tree_flatten`` for trees that are, call after call, one ``{key: tensor}`` dict.

    The first call (and any call whose tree is not a plain dict of tensors with the same keys in
    the same insertion order) flattens with optree and remembers the spec; the next ones read the
    values in the spec's order. The result is exactly optree's: the same leaves and a spec equal to
    the one ``tree_flatten`` would return, so unflattening gives the same dict, key order included.
    While tracing it is plain ``optree.tree_flatten``.

    Example::

        >>> import torch
        >>> from functrain.core.eager import FlatDict
        >>> flat = FlatDict()
        >>> leaves, spec = flat({"b": torch.ones(1), "a": torch.zeros(1)})
        >>> [float(x) for x in leaves], spec   # optree's order: sorted keys
        ([0.0, 1.0], PyTreeSpec({'a': *, 'b': *}))
        >>> leaves, _ = flat({"b": torch.ones(1) * 2, "a": torch.zeros(1)})   # the fast path
        >>> [float(x) for x in leaves]
        [0.0, 2.0]
    """

    __slots__ = ("_known",)

    def __init__(self) -> None:
        # (spec, insertion order of the dict it came from, optree's leaf order): one attribute, so
        # that a step called from two threads never reads a half-updated cache
        self._known: tuple | None = None

    def __call__(self, tree: Any) -> tuple[list, Any]:
        if torch.compiler.is_compiling():  # traced: plain optree, no cache for Dynamo to guard on
            return optree.tree_flatten(tree)
        known = self._known
        if type(tree) is dict and known is not None and list(tree) == known[1]:
            leaves = [tree[k] for k in known[2]]
            if all(isinstance(x, torch.Tensor) for x in leaves):
                return leaves, known[0]
        leaves, spec = optree.tree_flatten(tree)
        # flat: the root dict's children are its leaves (a one-leaf sub-dict would add a node)
        if (type(tree) is dict and spec.num_leaves == len(tree) and spec.num_nodes == len(tree) + 1
                and all(isinstance(x, torch.Tensor) for x in leaves)):
            self._known = (spec, list(tree), spec.entries())
        return leaves, spec
