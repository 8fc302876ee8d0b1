"""Bringing an optimizer from elsewhere: an Optax-style adapter and a protocol check.

``from_torch_functional`` is deliberately absent: ``torch.optim._functional`` is a
private module whose functions mutate their arguments in place, take a
different positional list of state buffers per optimizer (SGD's momentum
buffers start as ``None`` and are created inside), and keep ``step`` as float
tensors; an adapter over that would be one special case per optimizer, and the
functrain ports of SGD/Adam/AdamW already match them bit for bit.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import optree
import torch

from ..core.registry import register_checkpoint_type
# check_optimizer lives in the core layer so that functrain.core.step can call it too.
from ..core.optimizer import check_optimizer
from .base import Optimizer, check_lr, describe, flatten_params, flatten_update, init_count, leaf_path, lr_value

__all__ = ["from_optax_style", "OptaxStyleState", "check_optimizer"]


@register_checkpoint_type("functrain.optim.OptaxStyleState")
class OptaxStyleState(NamedTuple):
    """State of :func:`from_optax_style`.

    ``inner`` is saved in checkpoints as any pytree of tensors; a ``NamedTuple`` of your
    own in it must be registered with :func:`functrain.core.registry.register_checkpoint_type`.

    Attributes:
        count: the number of updates applied, an int64 scalar tensor (0 after ``init``).
        inner: the wrapped transformation's own state, what its ``init`` / ``update`` return.

    Example::

        >>> import torch
        >>> from functrain import optim
        >>> opt = optim.from_optax_style(lambda p: (), lambda g, s, p: ({k: -0.1 * v for k, v in g.items()}, s))
        >>> state = opt.init({"w": torch.ones(2)})
        >>> int(state.count), state.inner
        (0, ())
    """

    count: torch.Tensor
    inner: Any


def from_optax_style(
    init: Callable[[Any], Any],
    update: Callable[[Any, Any, Any], tuple],
    *,
    learning_rate: float | Callable[[Any], Any] | None = None,
) -> Optimizer:
    """A functrain optimizer from an Optax-style gradient transformation on torch tensors.

    The outgoing updates are added to the params (``new_params = params + updates``, so a
    descent step returns ``-lr * direction``). Both functions must be pure functions of
    torch tensors for the step to compile.

    Args:
        init: ``init(params) -> state``, the transformation's state.
        update: ``update(updates, state, params) -> (updates, state)``, where the incoming
            ``updates`` are the gradients; the outgoing ones must be tensors of each param's
            dtype and shape.
        learning_rate: only what the step reports as its ``lr`` metric (the transformation owns
            its lr): a float >= 0, a schedule of the applied-update count, or ``None`` (default:
            the reported lr is NaN).

    Returns:
        An :class:`~functrain.optim.Optimizer` over :class:`OptaxStyleState`.

    Raises:
        TypeError: ``init`` or ``update`` is not callable; at ``update`` time, when the wrapped
            ``update`` does not return ``(updates, state)`` or an update leaf does not match its param.

    Example::

        >>> import torch
        >>> from functrain import optim
        >>> def init(params):
        ...     return {k: torch.zeros_like(p) for k, p in params.items()}
        >>> def update(grads, trace, params):  # SGD with momentum 0.9, lr 0.1
        ...     trace = {k: 0.9 * trace[k] + grads[k] for k in grads}
        ...     return {k: -0.1 * t for k, t in trace.items()}, trace
        >>> opt = optim.from_optax_style(init, update, learning_rate=0.1)
        >>> params = {"w": torch.ones(2)}
        >>> state = opt.init(params)
        >>> params, state = opt.update({"w": torch.ones(2)}, state, params)
        >>> params["w"], int(state.count)
        (tensor([0.9000, 0.9000]), 1)
    """
    for name, fn in (("init", init), ("update", update)):
        if not callable(fn):
            raise TypeError(f"from_optax_style: {name} must be a function; got {describe(fn)}")
    if learning_rate is not None:
        learning_rate = check_lr(learning_rate)
    inner_init, inner_update = init, update

    def opt_init(params: Any) -> OptaxStyleState:
        leaves, _ = flatten_params(params)
        return OptaxStyleState(count=init_count(leaves), inner=inner_init(params))

    def opt_update(grads: Any, state: OptaxStyleState, params: Any) -> tuple[Any, OptaxStyleState]:
        out = inner_update(grads, state.inner, params)
        if not isinstance(out, tuple) or len(out) != 2:
            raise TypeError(f"from_optax_style: update must return (updates, state); got {describe(out)}")
        updates, inner = out
        try:
            unflatten, p, u, _ = flatten_update(updates, params)
        except (ValueError, TypeError) as e:
            raise TypeError(f"from_optax_style: the updates must have the structure of the params: {e}") from None
        for path, pi, ui in zip(optree.tree_paths(params), p, u):
            if not isinstance(ui, torch.Tensor) or ui.shape != pi.shape or ui.dtype != pi.dtype:
                got = describe(ui) if not isinstance(ui, torch.Tensor) else f"{ui.dtype} {tuple(ui.shape)}"
                raise TypeError(
                    f"from_optax_style: the update for param {leaf_path(path)!r} must be a tensor of the "
                    f"param's dtype and shape ({pi.dtype} {tuple(pi.shape)}); got {got}"
                )
        new_p = torch._foreach_add(p, u) if p else p
        return unflatten(new_p), OptaxStyleState(count=state.count + 1, inner=inner)

    def opt_learning_rate(opt_state: Any) -> float | torch.Tensor:
        if learning_rate is None:
            return float("nan")
        return lr_value(learning_rate, opt_state.count)

    return Optimizer(init=opt_init, update=opt_update, learning_rate=opt_learning_rate, schedule=learning_rate)
