"""Eager-only shortcuts that read a host scalar, and the test of when that is safe.

A functrain step is written once for both eager calls and tracing (``torch.compile``,
``make_fx``): every decision on a tensor is a device-side select and every scalar a
tensor, so a trace never syncs. Eagerly, with the value in host memory, that costs a
dozen tiny tensor ops per step where Python arithmetic gives the same numbers. Code
that takes the shortcut asks :func:`host_number` and keeps the tensor path otherwise.
"""
from __future__ import annotations

from typing import Any

import torch

__all__ = ["host_number"]


def host_number(x: Any) -> Any:
    """``x`` as a Python number when reading it is free and cannot end up baked into a trace, else ``x``.

    That is a plain 0-dim CPU tensor in eager code: not a fake, functional or
    batched tensor, not under ``torch.compile`` / ``make_fx`` (``is_compiling``, a dispatch
    mode), not wrapped by a ``torch.func`` transform. Reading such a tensor is a host memory
    read, not a device sync, and ``.tolist()`` runs no aten op. The optimizers use it for the
    step counter and a scheduled lr: their scalar math (bias corrections, step size) is then
    Python floats, as in ``torch.optim``'s for-loop and foreach paths (the same numbers, and
    about ten tiny tensor ops fewer per update). Anything else stays a tensor: a traced or
    device-side counter keeps the sync-free tensor math.

    Example::

        >>> import torch
        >>> from functrain._host import host_number
        >>> host_number(torch.tensor(3)), host_number(2.5)
        (3, 2.5)
    """
    if (type(x) is torch.Tensor and x.is_cpu and x.dim() == 0 and not torch.compiler.is_compiling()
            and not torch._C._len_torch_dispatch_stack() and not torch._C._functorch.is_functorch_wrapped_tensor(x)):
        return x.tolist()
    return x
