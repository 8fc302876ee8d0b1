"""Why a runner captured its step again: what changed between two input signatures.

A runner (:class:`functrain.compiler.runtime.Runner`) records the old and the new
:class:`~functrain.compiler.capture.Signature` of every capture it makes after another (``runner.recaptures``);
:func:`signature_changes` names each difference by the leaf it is in (``batch[0]``, ``state.params['w']``) and
what changed (structure, shape, stride, dtype, device, type or value), and :func:`describe` says it in one line.

Example::

    >>> import torch, functrain as ft
    >>> from functrain.bench.recompiles import describe, signature_changes
    >>> step = ft.train_step(lambda p, b, x: (p["w"] * x).sum(), ft.optim.sgd(0.1))
    >>> run = ft.compile(step, backend="aot_eager").runner()
    >>> state = step.init({"w": torch.ones(3)})
    >>> state, _ = run(state, torch.ones(4, 3))
    >>> state, _ = run(state, torch.ones(2, 3))        # a short batch: a new signature, captured again
    >>> describe(signature_changes(*run.recaptures[0]))
    'batch: shape (4, 3) -> (2, 3)'
"""
from __future__ import annotations

from typing import Any

import optree

from ..compiler.capture import Signature

__all__ = ["signature_changes", "describe", "leaf_names"]

_LIMIT = 200  # characters of a structure or value shown


def leaf_names(spec: Any) -> list[str]:
    """The name of each leaf of a ``(state, batch)`` treespec: ``state.params['w']``, ``batch[0]``, ``batch``."""
    names = []
    for accessor in optree.treespec_accessors(spec):
        entries = list(accessor)
        if not entries:
            names.append("(state, batch)")
            continue
        root = ("state", "batch")[entries[0].entry] if entries[0].entry in (0, 1) else "input"
        names.append(optree.PyTreeAccessor(entries[1:]).codify(root))
    return names


def _cut(text: str) -> str:
    return text if len(text) <= _LIMIT else text[:_LIMIT - 3] + "..."


def _plain(value: Any) -> Any:
    """A JSON-friendly form of a shape, stride, dtype or device."""
    return list(value) if isinstance(value, tuple) else str(value)


def signature_changes(old: Signature, new: Signature) -> list[dict[str, Any]]:
    """What differs from ``old`` to ``new``: ``[{"leaf", "what", "old", "new"}]``, ``what`` one of
    ``"structure"`` (the state's or the batch's tree: other keys, types or lengths), ``"shape"``, ``"stride"``,
    ``"dtype"``, ``"device"``, ``"type"`` (a tensor leaf became a Python value, or the reverse; or the value's
    type changed) and ``"value"`` (a Python value of the batch, a constant of the graph). Empty when they agree."""
    if old.spec != new.spec:
        changes = []
        old_parts, new_parts = old.spec.children(), new.spec.children()
        for k, part in enumerate(("state", "batch")):
            a = old_parts[k] if k < len(old_parts) else None
            b = new_parts[k] if k < len(new_parts) else None
            if a != b:
                changes.append({"leaf": part, "what": "structure", "old": _cut(str(a)), "new": _cut(str(b))})
        return changes or [{"leaf": "(state, batch)", "what": "structure", "old": _cut(str(old.spec)),
                            "new": _cut(str(new.spec))}]
    names = leaf_names(new.spec)
    old_leaf = _leaves(old)
    new_leaf = _leaves(new)
    changes = []
    for pos in sorted(new_leaf):
        a, b = old_leaf[pos], new_leaf[pos]
        if a[0] != b[0]:  # a tensor on one side, a Python value on the other
            changes.append({"leaf": names[pos], "what": "type", "old": a[0], "new": b[0]})
        elif a[0] == "Tensor":
            (shape, stride, dtype, device), (shape2, stride2, dtype2, device2) = a[1], b[1]
            for what, x, y in (("shape", shape, shape2), ("dtype", dtype, dtype2), ("device", device, device2)):
                if x != y:
                    changes.append({"leaf": names[pos], "what": what, "old": _plain(tuple(x) if what == "shape"
                                                                                      else x),
                                    "new": _plain(tuple(y) if what == "shape" else y)})
            if shape == shape2 and stride != stride2:  # (a new shape has new strides: not worth saying)
                changes.append({"leaf": names[pos], "what": "stride", "old": _plain(tuple(stride)),
                                "new": _plain(tuple(stride2))})
        elif a[1] != b[1]:
            changes.append({"leaf": names[pos], "what": "value", "old": _cut(repr(a[1])), "new": _cut(repr(b[1]))})
    return changes


def _leaves(sig: Signature) -> dict[int, tuple]:
    """Leaf position -> ``("Tensor", meta)`` or ``(type name, value)``."""
    out: dict[int, tuple] = {pos: ("Tensor", meta) for pos, meta in zip(sig.tensor_pos, sig.metas)}
    for pos, typ, value in sig.consts:
        out[pos] = (typ.__name__, value)
    return out


def describe(changes: list[dict[str, Any]], limit: int = 4) -> str:
    """One line: ``"batch[0]: shape (32, 8) -> (16, 8); state.step: dtype torch.int64 -> torch.int32"`` (at most
    ``limit`` changes, then how many more)."""
    if not changes:
        return "the same signature (captured again)"

    def show(v: Any) -> str:
        return "(" + ", ".join(map(str, v)) + ("," if len(v) == 1 else "") + ")" if isinstance(v, list) else str(v)

    parts = [f"{c['leaf']}: {c['what']} {show(c['old'])} -> {show(c['new'])}" for c in changes[:limit]]
    if len(changes) > limit:
        parts.append(f"and {len(changes) - limit} more")
    return "; ".join(parts)
