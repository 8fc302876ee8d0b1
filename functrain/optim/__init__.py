"""Functional optimizers: pure ``(init, update)`` pairs over pytrees.

Each optimizer matches its ``torch.optim`` counterpart to float32 round-off, is
implemented with multi-tensor ``torch._foreach_*`` kernels, and never writes
into its inputs, so a whole training step compiles with
``torch.compile(fullgraph=True)``. ``lr`` may be a float or a schedule from
:mod:`functrain.optim.schedules`.

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
from . import schedules
from .adam import AdamState, adam, adamw
from .base import Optimizer
from .sgd import SGDState, sgd

__all__ = ["Optimizer", "sgd", "SGDState", "adam", "adamw", "AdamState", "schedules"]
