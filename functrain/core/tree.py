"""Pytree helpers over optree.

Every container functrain uses (dicts, lists, tuples, ``NamedTuple`` states) is a
pytree that optree understands natively and that ``torch.compile`` traces without
graph breaks (Dynamo has polyfills for optree's functions and treats named tuples
as plain Python values). The helpers below are the few operations the step
needs on top of ``optree``; they work eagerly and inside a compiled step.

Example::

    >>> import torch, functrain as ft
    >>> tree = {"w": torch.ones(2), "b": torch.zeros(1)}
    >>> float(ft.tree.global_norm(tree))
    1.4142135381698608
"""
from __future__ import annotations

from typing import Any

import optree
import torch

__all__ = [
    "tree_map",
    "tree_leaves",
    "tree_flatten",
    "tree_unflatten",
    "tree_structure",
    "tree_select",
    "tree_zeros_like",
    "tree_add",
    "tree_scale",
    "global_norm",
    "tree_all_finite",
    "tree_allclose",
    "tree_equal",
    "find_nodes",
]

# optree treats ``None`` as an empty subtree; keep that convention everywhere.
tree_map = optree.tree_map
tree_leaves = optree.tree_leaves
tree_flatten = optree.tree_flatten
tree_unflatten = optree.tree_unflatten
tree_structure = optree.tree_structure


def find_nodes(tree: Any, match: Any) -> list:
    """The nodes of ``tree`` for which ``match(node)`` is true, in tree order: a walk through dicts' values, lists
    and tuples (NamedTuples included), which goes on inside a node that matched. Any node may match, containers too
    (optree's leaves are only the ends: this finds a state's ``NamedTuple`` holders or a structure's placeholders).

    Example::

        >>> from functrain.core.tree import find_nodes
        >>> find_nodes({"a": [1, "x", (2, "y")]}, lambda n: isinstance(n, str))
        ['x', 'y']
    """
    found: list = []

    def walk(x: Any) -> None:
        if match(x):
            found.append(x)
        if isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    walk(tree)
    return found


def tree_select(pred: torch.Tensor, on_true: Any, on_false: Any) -> Any:
    """Leafwise ``torch.where(pred, on_true, on_false)`` for a scalar boolean tensor ``pred``.

    This is how a step skips an update without a host sync: both branches are
    computed and the scalar predicate picks one on the device.
    """
    return optree.tree_map(lambda a, b: torch.where(pred, a, b), on_true, on_false)


def tree_zeros_like(tree: Any) -> Any:
    """A tree of zeros shaped like ``tree``."""
    return optree.tree_map(torch.zeros_like, tree)


def tree_add(a: Any, b: Any) -> Any:
    """Leafwise ``a + b`` with one multi-tensor (``_foreach_add``) kernel launch."""
    la, spec = optree.tree_flatten(a)
    lb = spec.flatten_up_to(b)
    if not la:
        return a
    return optree.tree_unflatten(spec, torch._foreach_add(la, lb))


def tree_scale(tree: Any, factor: Any) -> Any:
    """Leafwise ``leaf * factor`` (``factor`` a Python number or a scalar tensor)."""
    leaves, spec = optree.tree_flatten(tree)
    if not leaves:
        return tree
    return optree.tree_unflatten(spec, torch._foreach_mul(leaves, factor))


def global_norm(tree: Any) -> torch.Tensor:
    """The L2 norm of all leaves taken together, in float32 (or the widest leaf dtype)."""
    leaves = optree.tree_leaves(tree)
    if not leaves:
        return torch.zeros(())
    norms = torch._foreach_norm(leaves, 2.0)
    dtype = torch.promote_types(norms[0].dtype, torch.float32)
    return torch.linalg.vector_norm(torch.stack([n.to(dtype) for n in norms]), 2.0)


def tree_all_finite(tree: Any) -> torch.Tensor:
    """A scalar boolean tensor: every element of every leaf is finite.

    Uses the fact that ``sum`` propagates inf/nan, so one reduction per leaf
    suffices and the result stays on the device.
    """
    leaves = optree.tree_leaves(tree)
    if not leaves:
        return torch.ones((), dtype=torch.bool)
    sums = torch.stack([leaf.float().sum() for leaf in leaves])
    return torch.isfinite(sums.sum())


def tree_allclose(a: Any, b: Any, rtol: float = 1e-5, atol: float = 1e-8, equal_nan: bool = False) -> bool:
    """True when both trees have the same structure and every leaf pair is ``torch.allclose``."""
    la, sa = optree.tree_flatten(a)
    lb, sb = optree.tree_flatten(b)
    if sa != sb:
        return False
    return all(
        x.shape == y.shape and x.dtype == y.dtype and torch.allclose(x, y, rtol=rtol, atol=atol, equal_nan=equal_nan)
        for x, y in zip(la, lb)
    )


def tree_equal(a: Any, b: Any) -> bool:
    """True when both trees have the same structure and bitwise-equal leaves.

    Floating leaves are compared through an integer view of their bits, so NaNs
    with the same payload are equal and ``-0.0 != 0.0``: this is the test for
    bit-exact reproducibility.
    """
    la, sa = optree.tree_flatten(a)
    lb, sb = optree.tree_flatten(b)
    if sa != sb:
        return False
    for x, y in zip(la, lb):
        if not (torch.is_tensor(x) and torch.is_tensor(y)):
            if torch.is_tensor(x) or torch.is_tensor(y) or x != y:
                return False
            continue
        if x.shape != y.shape or x.dtype != y.dtype or x.device != y.device:
            return False
        if x.is_floating_point() or x.is_complex():
            x, y = _bits(x), _bits(y)
        if not torch.equal(x, y):
            return False
    return True


def _bits(x: torch.Tensor) -> torch.Tensor:
    ints = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8, 16: torch.int64}
    x = x.detach().contiguous()
    if x.is_complex():
        x = torch.view_as_real(x)
    return x.view(ints[x.element_size()])
