"""Functional optimizers: pure ``(init, update)`` pairs over pytrees.

Each optimizer matches its ``torch.optim`` counterpart (bit for bit in eager
float32 in the tests), is implemented with multi-tensor ``torch._foreach_*``
kernels, and never writes into its inputs, so a whole training step compiles
with ``torch.compile(fullgraph=True)``. ``lr`` may be a float or a schedule
from :mod:`functrain.optim.schedules`. ``weight_decay_mask=`` and
``lr_multipliers=`` replace torch.optim's param groups (:mod:`.groups`,
:mod:`.masks`); :func:`lion` is the one optimizer without a torch.optim twin;
:func:`from_optax_style` adapts an Optax-style gradient transformation and
:func:`check_optimizer` explains the protocol to whoever passes something else. A ``torch.optim``
optimizer (and its lr scheduler) given where a functrain one is expected is translated
(:func:`from_torch`: functional ports of SGD, Adam, AdamW and schedule-free AdamW
(:func:`adamw_schedulefree`), any other optimizer by its own ``step()``, :func:`torch_step`).

Example::

    >>> import torch
    >>> from functrain import optim
    >>> opt = optim.adamw(lr=optim.schedules.linear_warmup(1e-3, warmup_steps=100))
    >>> params = {"w": torch.zeros(3), "b": torch.zeros(1)}
    >>> state = opt.init(params)
    >>> grads = {"w": torch.ones(3), "b": torch.ones(1)}
    >>> params, state = opt.update(grads, state, params)
    >>> int(state.count)
    1
"""
from . import groups, masks, schedules
from .adam import AdamState, adam, adamw
from .base import Optimizer
from .interop import OptaxStyleState, check_optimizer, from_optax_style
from .lion import LionState, lion
from .partition import GroupedState
from .schedulefree import ScheduleFreeState, adamw_schedulefree
from .sgd import SGDState, sgd
from .torch_optim import eval_params, from_torch
from .torch_schedules import TorchLRSchedule, from_torch_scheduler
from .torch_step import TorchStepState, torch_step

__all__ = [
    "Optimizer", "sgd", "SGDState", "adam", "adamw", "AdamState", "lion", "LionState",
    "from_optax_style", "OptaxStyleState", "check_optimizer", "groups", "masks", "schedules",
    "adamw_schedulefree", "ScheduleFreeState", "eval_params", "from_torch", "GroupedState", "torch_step",
    "TorchStepState", "from_torch_scheduler", "TorchLRSchedule",
]
