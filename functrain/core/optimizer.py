"""The functrain optimizer protocol check (core layer: ``functrain.core.step`` may call it).

Public as :func:`functrain.optim.check_optimizer`.
"""
from __future__ import annotations

from typing import Any

import torch

from .validate import describe

__all__ = ["check_optimizer"]

_PROTOCOL = (
    "a functrain optimizer is Optimizer(init, update, learning_rate): init(params) -> opt_state "
    "(with an int64 `count` of applied updates), update(grads, opt_state, params) -> (new_params, "
    "new_opt_state), pure (no writes into its inputs), learning_rate(opt_state) -> lr; optional fields "
    "per_param (updates by parameter name) and schedule (the lr it was built with)"
)


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
    head = (f"{cls.__module__}.{cls.__qualname__} is a stateful torch.optim optimizer, not a functrain "
            "optimizer: it holds the "
            "parameters and mutates them and its state in step(), which a pure, compiled functrain step "
            "cannot call. ")
    port = _TORCH_PORTS.get(cls.__name__)
    if port is None:
        return head + ("Port it: write init(params) and update(grads, state, params) -> (new_params, state) "
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

    Args:
        obj: what was given as the optimizer.

    Returns:
        ``obj`` itself, when it follows the protocol.

    Raises:
        TypeError: it does not, with what to use instead.

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
