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

from ..registry import register_checkpoint_type
from .base import Optimizer, check_lr, describe, flatten_params, flatten_update, init_count, leaf_path, lr_value

__all__ = ["from_optax_style", "OptaxStyleState", "check_optimizer"]

_PROTOCOL = (
    "a functrain optimizer is Optimizer(init, update, learning_rate): init(params) -> opt_state "
    "(with an int64 `count` of applied updates), update(grads, opt_state, params) -> (new_params, "
    "new_opt_state), pure (no writes into its inputs), learning_rate(opt_state) -> lr"
)


@register_checkpoint_type("functrain.optim.OptaxStyleState")
class OptaxStyleState(NamedTuple):
    """State of :func:`from_optax_style`: the applied-update ``count`` and the wrapped
    transformation's own state ``inner``.

    ``inner`` is saved in checkpoints as any pytree of tensors; a ``NamedTuple`` of your
    own in it must be registered with :func:`functrain.registry.register_checkpoint_type`.
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

    ``init(params) -> state`` and ``update(updates, state, params) -> (updates, state)``,
    where the incoming ``updates`` are the gradients and the outgoing ones are added to
    the params (``new_params = params + updates``, so a descent step returns
    ``-lr * direction``). Both must be pure functions of torch tensors for the step to
    compile. ``learning_rate`` (a float or a schedule of the applied-update count) is
    only what the step reports as its ``lr`` metric: the transformation owns its lr;
    without it the reported lr is NaN.

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

    opt_learning_rate.schedule = learning_rate
    return Optimizer(init=opt_init, update=opt_update, learning_rate=opt_learning_rate)


_TORCH_PORTS = {"SGD": "sgd", "Adam": "adam", "AdamW": "adamw"}
_HYPER = {
    "sgd": ("lr", "momentum", "dampening", "weight_decay", "nesterov"),
    "adam": ("lr", "betas", "eps", "weight_decay"),
    "adamw": ("lr", "betas", "eps", "weight_decay"),
}


def _short(obj: Any) -> str:
    text = repr(obj)
    return f"{text[:77]}... ({type(obj).__name__})" if len(text) > 80 else describe(obj)


def _torch_optim_message(obj: Any) -> str:
    cls = obj if isinstance(obj, type) else type(obj)
    head = (f"{cls.__module__}.{cls.__qualname__} is a stateful torch.optim optimizer: it holds the "
            "parameters and mutates them and its state in step(), which a pure, compiled functrain step "
            "cannot call. ")
    port = _TORCH_PORTS.get(cls.__name__)
    if port is None:
        return head + (f"Port it: write init(params) and update(grads, state, params) -> (new_params, state) "
                       "with torch._foreach_* ops that return new tensors (see functrain/optim/adam.py), or "
                       "wrap an Optax-style pair with ft.optim.from_optax_style(init, update); " + _PROTOCOL)
    hint = f"ft.optim.{port}(lr=...)"
    if not isinstance(obj, type) and getattr(obj, "param_groups", None):
        group = obj.param_groups[0]
        args = ", ".join(f"{k}={group[k]!r}" for k in _HYPER[port] if k in group
                         and not (k in ("dampening", "nesterov") and not group[k]))
        hint = f"ft.optim.{port}({args})"
        unsupported = [k for k in ("amsgrad", "maximize", "differentiable") if group.get(k)]
        if unsupported:
            hint += f" (it sets {', '.join(unsupported)}, which functrain's {port} does not have)"
        if len(obj.param_groups) > 1:
            hint += (" (it has several param groups: say per leaf with weight_decay_mask= and "
                     "lr_multipliers=, e.g. weight_decay_mask=ft.optim.masks.no_decay_bias_and_norm)")
    return head + f"Use the functional equivalent, which matches it bit for bit: {hint}."


def check_optimizer(obj: Any) -> Any:
    """Return ``obj`` if it follows the functrain optimizer protocol, else raise a
    ``TypeError`` that says what the protocol is and how to adapt what was given.

    Recognised mistakes: a ``torch.optim`` optimizer (instance or class: it is
    stateful; the message names the functional equivalent with its hyper-parameters),
    an Optax-style ``(init, update)`` pair without ``learning_rate`` (wrap it with
    :func:`from_optax_style`), and an optimizer factory passed uncalled
    (``ft.optim.adamw`` instead of ``ft.optim.adamw(1e-3)``).

    Example::

        >>> import torch
        >>> from functrain import optim
        >>> opt = optim.check_optimizer(optim.adamw(1e-3))
        >>> try:
        ...     optim.check_optimizer(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1))
        ... except TypeError as e:
        ...     print(str(e).split(": ")[-1])
        ft.optim.sgd(lr=0.1, momentum=0, weight_decay=0).
    """
    if isinstance(obj, torch.optim.Optimizer) or (isinstance(obj, type) and issubclass(obj, torch.optim.Optimizer)):
        raise TypeError(_torch_optim_message(obj))
    has = {a: callable(getattr(obj, a, None)) for a in ("init", "update", "learning_rate")}
    if all(has.values()):
        return obj
    if has["init"] and has["update"]:
        raise TypeError(
            f"optimizer {type(obj).__name__} has init and update but no learning_rate: if it is an Optax-style "
            "gradient transformation (update returns updates to add to the params), wrap it: "
            "ft.optim.from_optax_style(tx.init, tx.update, learning_rate=<lr, for the logs>); " + _PROTOCOL
        )
    if callable(obj) and getattr(obj, "__module__", "").startswith("functrain.optim"):
        name = getattr(obj, "__name__", repr(obj))
        raise TypeError(f"optimizer: got the factory ft.optim.{name} itself; call it, e.g. ft.optim.{name}(lr=1e-3)")
    missing = [a for a, ok in has.items() if not ok]
    raise TypeError(
        f"optimizer must be a functrain optimizer (e.g. ft.optim.adamw(1e-3)); got {_short(obj)} without "
        f"{', '.join(missing)}: {_PROTOCOL}. To bring your own: build ft.optim.Optimizer(init, update, "
        "learning_rate), or wrap an Optax-style pair with ft.optim.from_optax_style(init, update)"
    )
