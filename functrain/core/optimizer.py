"""The functrain optimizer protocol check (core layer: ``functrain.core.step`` may call it).

Public as :func:`functrain.optim.check_optimizer`. A ``torch.optim`` optimizer (or an
``(optimizer, lr_scheduler)`` pair, or a scheduler) given where a functrain optimizer is
expected is handed to the *adapters* registered here: the core cannot import
:mod:`functrain.optim`, which sits above it, so ``functrain.optim`` registers its
translation (:func:`functrain.optim.from_torch`) with :func:`register_adapter` when it is
imported, as the optimizers register their state types in :mod:`functrain.core.registry`.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from .validate import describe

__all__ = ["check_optimizer", "register_adapter", "is_torch_optimizer"]

# adapter(obj, num_steps) -> a functrain optimizer, or None when it does not take obj; filled by functrain.optim
_ADAPTERS: list[Callable[[Any, Any], Any]] = []

_PROTOCOL = (
    "a functrain optimizer is Optimizer(init, update, learning_rate): init(params) -> opt_state "
    "(with an int64 `count` of applied updates), update(grads, opt_state, params) -> (new_params, "
    "new_opt_state), pure (no writes into its inputs), learning_rate(opt_state) -> lr; optional fields "
    "per_param (updates by parameter name) and schedule (the lr it was built with)"
)


_TORCH_PORTS = {"SGD": "sgd", "Adam": "adam", "AdamW": "adamw"}


def _short(obj: Any) -> str:
    text = repr(obj)
    return f"{text[:77]}... ({type(obj).__name__})" if len(text) > 80 else describe(obj)


def _torch_optim_message(obj: Any) -> str:
    if isinstance(obj, (tuple, list)):
        obj = obj[0]
    cls = obj if isinstance(obj, type) else type(obj)
    name = f"{cls.__module__}.{cls.__qualname__}"
    if not issubclass(cls, torch.optim.Optimizer):
        return (f"{name} is a torch.optim learning-rate scheduler{' class' * isinstance(obj, type)}: give an instance "
                "with its optimizer, as the pair (optimizer, scheduler) or the scheduler alone (its optimizer comes "
                "with it), and functrain translates both (ft.optim.from_torch)")
    if not isinstance(obj, type):  # no adapter took it: functrain.optim (which registers the translation) is absent
        return (f"{name} is a stateful torch.optim optimizer; its translation into a functrain optimizer is "
                "registered by functrain.optim: import functrain (or functrain.optim) first")
    port = _TORCH_PORTS.get(cls.__name__)
    instead = (f"the functional equivalent, which matches it bit for bit: ft.optim.{port}(lr=...)" if port else
               "a functional port (see functrain/optim/adam.py), or ft.optim.from_optax_style(init, update)")
    return (f"{name} is a torch.optim optimizer class, not a functrain optimizer: pass an instance, "
            f"{cls.__name__}(model.parameters(), ...), and functrain translates it (ft.optim.from_torch); or use "
            f"{instead}; {_PROTOCOL}")


def register_adapter(adapter: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    """Register ``adapter(obj, num_steps) -> functrain optimizer | None`` for the ``torch.optim``
    objects :func:`check_optimizer` is given (an optimizer, a scheduler, an ``(optimizer,
    scheduler)`` pair); ``functrain.optim`` registers its translation when it is imported.
    Registering the same function twice keeps one.

    Example::

        >>> from functrain.core.optimizer import register_adapter
        >>> adapter = register_adapter(lambda obj, num_steps: None)   # takes nothing: the refusal stays
    """
    if not callable(adapter):
        raise TypeError(f"register_adapter takes a function adapter(obj, num_steps); got {describe(adapter)}")
    if adapter not in _ADAPTERS:
        _ADAPTERS.append(adapter)
    return adapter


def is_torch_optimizer(obj: Any) -> bool:
    """Whether ``obj`` is a ``torch.optim`` optimizer or scheduler (instance or class), or an
    ``(optimizer, scheduler)`` pair: what the adapters are asked to translate.

    Example::

        >>> import torch
        >>> from functrain.core.optimizer import is_torch_optimizer
        >>> is_torch_optimizer(torch.optim.SGD), is_torch_optimizer(3)
        (True, False)
    """
    kinds = (torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
    if isinstance(obj, kinds) or (isinstance(obj, type) and issubclass(obj, kinds)):
        return True
    return isinstance(obj, (tuple, list)) and len(obj) == 2 and isinstance(obj[0], torch.optim.Optimizer)


def check_optimizer(obj: Any, *, num_steps: int | None = None) -> Any:
    """Return ``obj`` if it follows the functrain optimizer protocol, its functional
    translation if it is a ``torch.optim`` optimizer, else raise a ``TypeError`` that says
    what the protocol is and how to adapt what was given.

    A ``torch.optim`` optimizer *instance*, an ``(optimizer, lr_scheduler)`` pair or a
    scheduler (whose optimizer comes with it) is translated by the registered adapters
    (:func:`functrain.optim.from_torch`): SGD, Adam, AdamW and schedule-free AdamW to their
    functional ports, any other optimizer to the escape hatch (:func:`functrain.optim.torch_step`);
    what a port cannot hold (``amsgrad=True``, a tensor lr, ...) is refused by name.
    Recognised mistakes: a ``torch.optim`` class (not an instance: the message names the
    functional equivalent), an Optax-style ``(init, update)`` pair without
    ``learning_rate`` (wrap it with :func:`from_optax_style`), and an optimizer factory
    passed uncalled (``ft.optim.adamw`` instead of ``ft.optim.adamw(1e-3)``).

    Args:
        obj: what was given as the optimizer.
        num_steps: the number of updates of the run, when known (the trainer's
            ``train_num_steps``): the horizon of a translated ``torch.optim.lr_scheduler``
            that has no end of its own (``StepLR``, ...).

    Returns:
        ``obj`` itself when it follows the protocol, or the translation of a torch.optim one.

    Raises:
        TypeError: it does not, with what to use instead (a :class:`ValueError` or a ``TypeError``
            from the translation names what of a torch.optim optimizer functrain cannot hold).

    Example::

        >>> import torch
        >>> from functrain import optim
        >>> opt = optim.check_optimizer(optim.adamw(1e-3))
        >>> try:
        ...     optim.check_optimizer(torch.optim.SGD)
        ... except TypeError as e:
        ...     print(str(e).split(":")[0])
        torch.optim.sgd.SGD is a torch.optim optimizer class, not a functrain optimizer
        >>> sgd = optim.check_optimizer(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1))
        >>> type(sgd).__name__       # translated (functrain.optim.from_torch)
        'Optimizer'
    """
    if is_torch_optimizer(obj):
        if not isinstance(obj, type):
            for adapter in _ADAPTERS:
                translated = adapter(obj, num_steps)
                if translated is not None:
                    return translated
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
