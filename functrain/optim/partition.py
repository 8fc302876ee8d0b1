"""Several optimizers over one params tree, each over its named leaves: torch.optim's param groups run as torch runs them.

A translated ``torch.optim`` optimizer (:func:`functrain.optim.from_torch`) with several
param groups, or one group that leaves some params out, runs one functional optimizer per
group, built with that group's own hyper-parameters (its lr or lr table, betas, eps, weight
decay, momentum): the arithmetic of each group is then the arithmetic torch runs for it,
whatever the lrs (an lr multiplier would round ``base * (lr / base)`` differently). A leaf in
no group is not updated, as torch does not update a param it does not hold.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

import optree
import torch

from ..core.registry import register_checkpoint_type
from ..core.validate import path_str

__all__ = ["GroupedState", "named_leaves", "grouped_init", "grouped_update", "grouped_params", "grouped_eval"]


@register_checkpoint_type("functrain.optim.GroupedState")
class GroupedState(NamedTuple):
    """State of a translated ``torch.optim`` optimizer with several param groups.

    Attributes:
        count: the number of updates applied, an int64 scalar tensor.
        groups: one state per param group, in torch's group order; each is the state of the
            group's functional optimizer (``AdamState``, ``SGDState``, ...) over the group's params
            as a flat dict ``{name: tensor}`` (``state.groups[1].exp_avg["fc.bias"]``).

    Example::

        >>> import torch
        >>> from functrain.optim import sgd
        >>> from functrain.optim.partition import grouped_init
        >>> state = grouped_init([sgd(0.1), sgd(0.01, momentum=0.9)], [["w"], ["b"]],
        ...                      {"w": torch.ones(2), "b": torch.ones(1)})
        >>> int(state.count), state.groups[1].momentum_buffer
        (0, {'b': tensor([0.])})
    """

    count: torch.Tensor
    groups: tuple


def named_leaves(params: Any) -> tuple[list[str], list[torch.Tensor], Any]:
    """``(names, leaves, treespec)`` of ``params``: each leaf's path joined by ``/`` (the key of a flat dict).

    Example::

        >>> import torch
        >>> from functrain.optim.partition import named_leaves
        >>> named_leaves({"b": torch.ones(1), "a": {"w": torch.ones(1)}})[0]
        ['a/w', 'b']
    """
    paths, leaves, spec = optree.tree_flatten_with_path(params)
    return [path_str(p) for p in paths], leaves, spec


def grouped_params(names: Sequence[str], values: Sequence[Any], group: Sequence[str]) -> dict:
    """The flat dict ``{name: value}`` of one group's leaves (``values`` in the order of ``names``)."""
    index = {n: i for i, n in enumerate(names)}
    return {n: values[index[n]] for n in group}


def grouped_init(optimizers: Sequence[Any], groups: Sequence[Sequence[str]], params: Any) -> GroupedState:
    """Each optimizer's ``init`` over its group's leaves (by name), under one ``count``."""
    names, leaves, _ = named_leaves(params)
    states = tuple(o.init(grouped_params(names, leaves, g)) for o, g in zip(optimizers, groups))
    device = leaves[0].device if leaves else None
    return GroupedState(count=torch.zeros((), dtype=torch.int64, device=device), groups=states)


def grouped_update(optimizers: Sequence[Any], groups: Sequence[Sequence[str]], grads: Any, state: GroupedState,
                   params: Any) -> tuple[Any, GroupedState]:
    """Each optimizer's ``update`` over its group's leaves; leaves in no group come back as they are."""
    names, leaves, spec = named_leaves(params)
    flat_grads = spec.flatten_up_to(grads)
    index = {n: i for i, n in enumerate(names)}
    out = list(leaves)
    new_states = []
    for o, g, s in zip(optimizers, groups, state.groups):
        sub_grads = {n: flat_grads[index[n]] for n in g}
        new_p, new_s = o.update(sub_grads, s, {n: leaves[index[n]] for n in g})
        for n in g:
            out[index[n]] = new_p[n]
        new_states.append(new_s)
    return optree.tree_unflatten(spec, out), GroupedState(count=state.count + 1, groups=tuple(new_states))


def grouped_eval(eval_fns: Sequence[Callable[[Any, Any], Any]], groups: Sequence[Sequence[str]], params: Any,
                 state: GroupedState) -> Any:
    """Each group's evaluation weights (``eval_fns[i](group params, group state)``), merged back by name."""
    names, leaves, spec = named_leaves(params)
    index = {n: i for i, n in enumerate(names)}
    out = list(leaves)
    for fn, g, s in zip(eval_fns, groups, state.groups):
        x = fn({n: leaves[index[n]] for n in g}, s)
        for n in g:
            out[index[n]] = x[n]
    return optree.tree_unflatten(spec, out)
