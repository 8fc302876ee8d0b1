"""From an ``nn.Module`` to a pure function and back."""
from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
from torch.func import functional_call

from . import regions
from .empty import EmptyModule, init_empty
from .regions import Blocks
from .remat import checkpointing_layers, route_checkpointing

__all__ = ["functionalize", "init_empty", "to_module"]


def functionalize(module: torch.nn.Module) -> tuple[Callable[..., Any], dict, dict]:
    """Split ``module`` into a pure function and its tensors.

    Returns ``(apply_fn, params, buffers)`` where ``apply_fn(params, buffers, *args,
    **kwargs)`` runs ``module(*args, **kwargs)`` with the given tensors (through
    ``torch.func.functional_call``), ``params`` is ``{name: tensor}`` of the
    trainable parameters and ``buffers`` of the buffers. The tensors are detached
    and share storage with the module (no copy); functrain's steps never write
    into them unless you opt into donation (``ft.compile(step, donate=True)``).
    Tied parameters appear once, as ``named_parameters()`` lists them. Blocks marked with
    :func:`functrain.remat` recompute in the backward; so do Hugging Face layers after the model's
    ``gradient_checkpointing_enable()``: while ``apply_fn`` runs they use functrain's
    :func:`~functrain.core.remat.checkpoint` (which runs under ``torch.func``, so in a compiled step).
    A module built on the meta device (:func:`functrain.init_empty`, or ``with torch.device("meta"):``) gives meta
    tensors, which a params-sharded ``step.init`` (``ft.data_parallel(shard="params")``) makes as each rank's
    shard, replaying the module's own ``reset_parameters()`` one module at a time (:mod:`functrain.core.empty`).
    While ``ft.compile(step, reuse_blocks=True)`` traces a step, the module's repeated blocks (a
    transformer's layers) are traced once each and reused (:mod:`functrain.core.regions`).

    Args:
        module: the ``torch.nn.Module`` to split (left as it is: its tensors are shared, not copied).

    Returns:
        ``(apply_fn, params, buffers)``: the pure function and two ``{name: tensor}`` dicts.

    Example::

        >>> import torch, functrain as ft
        >>> model = torch.nn.Linear(3, 1)
        >>> apply_fn, params, buffers = ft.functionalize(model)
        >>> apply_fn(params, buffers, torch.ones(2, 3)).shape
        torch.Size([2, 1])
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"functionalize expects a torch.nn.Module; got {type(module).__name__}")
    params = {name: p.detach() for name, p in module.named_parameters() if p.requires_grad}
    frozen = {name: p.detach() for name, p in module.named_parameters() if not p.requires_grad}
    buffers = {**frozen, **{name: b.detach() for name, b in module.named_buffers()}}
    EmptyModule.record(module, {**buffers, **params})  # (meta tensors: noted for a sharded step.init to make)

    # Untying is a walk over all submodules on every call: only pay for it when weights are tied.
    tied = (len(list(module.named_parameters(remove_duplicate=False))) != len(list(module.named_parameters()))
            or len(list(module.named_buffers(remove_duplicate=False))) != len(list(module.named_buffers())))

    blocks = Blocks(module)  # repeated blocks: traced once each by ft.compile(reuse_blocks=True) (core.regions)
    # Hugging Face layers with gradient checkpointing on recompute through functrain's remat while the model
    # runs (torch.utils.checkpoint cannot run under the compiled step's torch.func gradient)
    layers = checkpointing_layers(module)

    def apply_fn(params: Any, buffers: Any, *args: Any, **kwargs: Any) -> Any:
        tensors = {**(buffers or {}), **params}
        if layers or (blocks and regions.active()):
            with contextlib.ExitStack() as stack:
                if layers:
                    stack.enter_context(route_checkpointing(layers))
                if blocks and regions.active():
                    stack.enter_context(blocks.patched())
                return functional_call(module, tensors, args, kwargs, tie_weights=tied, strict=False)
        return functional_call(module, tensors, args, kwargs, tie_weights=tied, strict=False)

    apply_fn.module = module  # type: ignore[attr-defined]
    return apply_fn, params, buffers


def to_module(module: torch.nn.Module, params: dict, buffers: dict | None = None) -> torch.nn.Module:
    """Copy trained ``params`` (and ``buffers``) into ``module`` in place and return it.

    The way back from :func:`functionalize`: use the result for inference,
    ``torch.save(module.state_dict())`` or export. Every name must exist in the
    module with the same shape; a missing or extra name raises ``KeyError``.

    Args:
        module: the module to write into (in place).
        params: ``{name: tensor}`` of its parameters (a state's ``params`` or ``ema``).
        buffers: ``{name: tensor}`` of its buffers, or ``None`` to leave them.

    Returns:
        ``module`` itself.

    Raises:
        KeyError: a name the module does not have, or one of its names missing.
        ValueError: a shape that differs, or a module still on the meta device (``module.to_empty(device=...)``
            first).

    Example::

        >>> import torch, functrain as ft
        >>> model = torch.nn.Linear(3, 1)
        >>> _, params, _ = ft.functionalize(model)
        >>> _ = ft.to_module(model, {k: torch.zeros_like(v) for k, v in params.items()})
        >>> float(model.weight.detach().abs().sum())
        0.0
    """
    own = dict(module.named_parameters())
    own.update(dict(module.named_buffers()))
    given = {**(buffers or {}), **params}
    unknown = sorted(set(given) - set(own))
    if unknown:
        raise KeyError(f"to_module: {unknown} are not parameters or buffers of {type(module).__name__}; "
                       f"it has {sorted(own)}")
    with torch.no_grad():
        for name, value in given.items():
            target = own[name]
            if target.is_meta and not value.is_meta:
                raise ValueError(f"to_module: {name!r} of {type(module).__name__} is on the meta device (built under "
                                 f"ft.init_empty() or torch.device('meta')), which holds no values: give the module "
                                 f"memory first (module.to_empty(device='cpu')), then to_module")
            if target.shape != value.shape:
                raise ValueError(f"to_module: {name!r} has shape {tuple(value.shape)}, "
                                 f"the module's is {tuple(target.shape)}")
            if target.data_ptr() != value.data_ptr():
                target.copy_(value)
    return module
