"""Which name each param of a ``torch.optim`` optimizer is (the functional params are named, torch's are objects).

Shared by the translation (:func:`functrain.optim.from_torch`) and the escape hatch
(:func:`functrain.optim.torch_step`).
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from .base import describe

__all__ = ["named_params", "match_names", "MATCH_HINT"]

MATCH_HINT = ("the params given to init must be the model's own (ft.functionalize(model) returns views of its "
              "Parameters); for copies (moved to another device, init(flat=True), a sharded data_parallel) name them: "
              "ft.optim.from_torch(torch_optimizer, model)")


def named_params(params: Any, owner: str) -> list[tuple[str, torch.Tensor]] | None:
    """``params`` (a module, a dict ``{name: tensor}``, ``(name, tensor)`` pairs, or ``None``) as a list of pairs.

    Example::

        >>> import torch
        >>> from functrain.optim.torch_names import named_params
        >>> [n for n, _ in named_params(torch.nn.Linear(2, 1), "from_torch")]
        ['weight', 'bias']
    """
    if params is None:
        return None
    if isinstance(params, torch.nn.Module):
        return list(params.named_parameters())
    items = list(params.items()) if isinstance(params, Mapping) else list(params)
    for item in items:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
                and isinstance(item[1], torch.Tensor)):
            raise TypeError(f"{owner}: params must be the module, a dict {{name: tensor}} or (name, tensor) pairs "
                            f"(model.named_parameters()); got an item {describe(item)[:100]}")
    return items


def _key(t: torch.Tensor) -> tuple:
    return (t.device, t.dtype, t.data_ptr(), tuple(t.shape), t.stride())


def match_names(torch_groups: list[list[torch.Tensor]], named: list[tuple[str, torch.Tensor]], source: str,
                cls: str) -> list[list[str | None]]:
    """The name of each param of each torch param group: the named tensor that is it, or a view of its memory.

    A param is matched by identity, else by ``(device, dtype, address, shape, stride)``: the
    detached views ``ft.functionalize`` returns share their ``Parameter``'s. A frozen param
    (``requires_grad=False``) is named ``None``: functionalize keeps it with the buffers, and
    torch never updates it (it has no gradient).

    Args:
        torch_groups: the params of each torch param group.
        named: ``(name, tensor)`` pairs to find them among.
        source: what ``named`` is, for messages.
        cls: the optimizer's class, for messages.

    Returns:
        Per group, per param: its name, or ``None`` for a frozen param.

    Raises:
        ValueError: a trainable param matches none or several of ``named``, or is in two groups.

    Example::

        >>> import torch, functrain as ft
        >>> from functrain.optim.torch_names import match_names
        >>> model = torch.nn.Linear(2, 1)
        >>> _, params, _ = ft.functionalize(model)
        >>> match_names([[model.bias], [model.weight]], list(params.items()), "params", "SGD")
        [['bias'], ['weight']]
    """
    by_id = {id(t): n for n, t in named}
    by_key: dict[tuple, list[str]] = {}
    for n, t in named:
        if n not in by_key.setdefault(_key(t), []):
            by_key[_key(t)].append(n)
    out, seen = [], {}
    for i, group in enumerate(torch_groups):
        names: list[str | None] = []
        for j, p in enumerate(group):
            if not p.requires_grad:  # frozen: ft.functionalize puts it in the buffers, and torch never updates it
                names.append(None)
                continue
            name = by_id.get(id(p))
            if name is None:
                found = by_key.get(_key(p), [])
                if len(found) > 1:
                    raise ValueError(f"{cls} param {j} of param group {i} ({tuple(p.shape)} {p.dtype}) shares its "
                                     f"memory with several of {source}: {found}; name the params: "
                                     f"ft.optim.from_torch(torch_optimizer, model)")
                name = found[0] if found else None
            if name is None:
                raise ValueError(f"{cls} param {j} of param group {i} ({tuple(p.shape)} {p.dtype}) is none of {source} "
                                 f"({len(named)}: {[n for n, _ in named][:6]}...): {MATCH_HINT}")
            if name in seen:
                raise ValueError(f"{cls}: param {name!r} is in param group {seen[name]} and in param group {i}")
            seen[name] = i
            names.append(name)
        out.append(names)
    return out
