"""Rematerialisation: recompute marked blocks in the backward instead of keeping their activations.

A step differentiates its loss inside the one graph (``torch.func.grad_and_value`` traced,
``torch.autograd.grad`` eagerly: :mod:`functrain.core.grad`), so no partitioner decides what
to keep between forward and backward: everything the backward reads stays alive, and the peak
grows with depth x batch x sequence. :func:`remat` marks what to recompute instead::

    ft.remat(model.blocks)                          # each block keeps its inputs, recomputes the rest
    ft.remat(model.blocks, "dots_saveable")         # ... and keeps its matmul outputs too
    f = ft.remat(block_fn, "nothing_saveable")      # a function: f(*args) recomputes block_fn

How: a marked block runs as one :class:`torch.autograd.Function` whose forward keeps only the
block's inputs (its parameters and tensor arguments) and what the policy saves, and whose backward
runs the block again under ``torch.func.vjp``, handing the saved values back in place of the
ops that made them. The same code is the eager recomputation (autograd calls the backward) and
the traced one (``torch.func`` supports ``setup_context`` Functions; make_fx records the
recomputation as ordinary ops in the backward half of the one graph: no graph break, no host
sync). Inductor keeps it there: it has no pass that merges the recomputed ops back into the
forward, and its peak-memory reordering schedules them where the backward needs them.

Policies (the names of ``jax.checkpoint_policies``; a policy decides which op outputs inside
the block are kept for the backward, the rest is recomputed):

* ``"nothing_saveable"``: keep nothing but the block's inputs (full activation checkpointing).
* ``"dots_saveable"``: keep the outputs of matmuls (``mm``, ``addmm``, ``bmm``, ``baddbmm``) and of
  fused attention (``scaled_dot_product_attention``'s kernels), recompute the elementwise rest.
* ``"dots_with_no_batch_dims_saveable"``: keep 2-D matmuls only (the weight matmuls: ``mm``,
  ``addmm``), recompute attention and the rest.
* ``"everything_saveable"``: keep everything (no recomputation; the block stays marked).
* a collection of aten ops to keep (``{torch.ops.aten.mm.default, ...}``, the list form of
  ``torch.utils.checkpoint.create_selective_checkpoint_contexts``), or a function ``policy(ctx,
  op, *args, **kwargs)`` returning a ``torch.utils.checkpoint.CheckpointPolicy`` or a bool
  (``True``: keep), the policy function of torch's selective activation checkpointing.

Random draws (dropout) are always kept, whatever the policy: the recomputation reuses the
forward's draws, so it computes the same values. Buffers a block updates in place (BatchNorm's
running statistics) are updated once: the recomputation runs on copies of them.

Hugging Face models' ``gradient_checkpointing_enable()`` (``activation_checkpointing_enable()``)
marks use this too: :func:`functrain.functionalize` hands those layers :func:`checkpoint` in place
of ``torch.utils.checkpoint.checkpoint`` while the model runs. A direct
``torch.utils.checkpoint.checkpoint`` call inside a loss works eagerly (torch recomputes) but
cannot be traced through ``torch.func``'s gradient (it is built on saved-tensor hooks, which
``torch.func`` refuses): the compiled step says so and names :func:`remat`.
"""
from __future__ import annotations

import contextlib
import functools
import warnings
from typing import Any, Callable, Iterator, NamedTuple

import torch

from .recompute import Policy, RematError, run_remat
from .validate import BadValue, describe

__all__ = ["remat", "checkpoint", "Policy", "POLICIES", "marked_blocks", "policy_of", "resolve_policy", "RematError",
           "checkpointing_layers", "route_checkpointing"]

_aten = torch.ops.aten
_BATCHED = frozenset({_aten.bmm.default, _aten.baddbmm.default})
_MATMULS = frozenset({_aten.mm.default, _aten.addmm.default})
_ATTENTION = frozenset(getattr(_aten, name).default for name in (
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")
    if hasattr(_aten, name))


def _ops(ops: frozenset) -> Callable[[Any, tuple, dict], bool]:
    return lambda op, args, kwargs: op in ops


POLICIES: dict[str, Policy] = {
    "nothing_saveable": Policy("nothing_saveable", lambda op, args, kwargs: False),
    "dots_saveable": Policy("dots_saveable", _ops(_MATMULS | _BATCHED | _ATTENTION)),
    "dots_with_no_batch_dims_saveable": Policy("dots_with_no_batch_dims_saveable", _ops(_MATMULS)),
    "everything_saveable": Policy("everything_saveable", None),
}
"""The named policies (see the module docstring)."""


def resolve_policy(policy: Any) -> Policy:
    """A :class:`Policy` from a name of :data:`POLICIES`, a collection of aten ops to keep, or a torch
    selective-checkpoint policy function ``policy(ctx, op, *args, **kwargs) -> CheckpointPolicy | bool``.

    Example::

        >>> from functrain.core.remat import resolve_policy
        >>> resolve_policy("dots_saveable").name
        'dots_saveable'
        >>> resolve_policy("dots")
        Traceback (most recent call last):
        ...
        functrain.core.validate.BadValue: remat: policy must be one of ('nothing_saveable', 'dots_saveable', \
'dots_with_no_batch_dims_saveable', 'everything_saveable'), a collection of aten ops to keep, or a function \
policy(ctx, op, *args, **kwargs) -> CheckpointPolicy | bool; got 'dots' (str)
    """
    if isinstance(policy, Policy):
        return policy
    if isinstance(policy, str):
        if policy in POLICIES:
            return POLICIES[policy]
    elif isinstance(policy, (set, frozenset, list, tuple)) and policy:
        ops = frozenset(policy)
        bad = [op for op in ops if not isinstance(op, (torch._ops.OpOverload, torch._ops.OpOverloadPacket))]
        if bad:
            raise BadValue(f"remat: a policy given as ops to keep must hold aten ops (torch.ops.aten.mm.default "
                           f"or torch.ops.aten.mm); got {describe(bad[0])}")
        packets = frozenset(op for op in ops if isinstance(op, torch._ops.OpOverloadPacket))
        exact = ops - packets
        return Policy(f"ops {sorted(map(str, ops))}",
                      lambda op, args, kwargs: op in exact or op.overloadpacket in packets)
    elif callable(policy) and not isinstance(policy, type):
        return Policy(getattr(policy, "__name__", "policy function"), _torch_policy(policy))
    raise BadValue(f"remat: policy must be one of {tuple(POLICIES)}, a collection of aten ops to keep, or a "
                   f"function policy(ctx, op, *args, **kwargs) -> CheckpointPolicy | bool; got {describe(policy)}")


def _torch_policy(fn: Callable) -> Callable[[Any, tuple, dict], bool]:
    from torch.utils.checkpoint import CheckpointPolicy, SelectiveCheckpointContext

    ctx = SelectiveCheckpointContext(is_recompute=False)
    keep = (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE)

    def saves(op, args, kwargs):
        decision = fn(ctx, op, *args, **kwargs)
        return decision in keep if isinstance(decision, CheckpointPolicy) else bool(decision)

    return saves


def checkpoint(function: Callable, *args: Any, use_reentrant: bool | None = None, context_fn: Any = None,
               policy: Any = "nothing_saveable", **kwargs: Any) -> Any:
    """``function(*args, **kwargs)`` recomputed in the backward: a drop-in for ``torch.utils.checkpoint.checkpoint``
    that also runs under ``torch.func`` (so in a compiled functrain step).

    ``function`` may be a module, a module's bound method, or a ``functools.partial`` of a module's function
    with the module first (what Hugging Face layers pass): that module's parameters become inputs of the
    block. ``use_reentrant``, ``preserve_rng_state``, ``determinism_check``, ``debug`` and ``early_stop`` are
    accepted and have no effect (random draws are always kept; the recomputation runs whole). ``context_fn``
    (torch's selective-checkpoint contexts) is refused: pass ``policy=`` instead.

    Example::

        >>> import torch
        >>> from functrain.core.remat import checkpoint
        >>> w = torch.ones(3, requires_grad=True)
        >>> y = checkpoint(lambda x, w: (x * w).sin().sum(), torch.arange(3.0), w)
        >>> torch.autograd.grad(y, w)[0]
        tensor([ 0.0000,  0.5403, -0.8323])
    """
    if context_fn is not None and getattr(context_fn, "__name__", "") != "noop_context_fn":
        raise BadValue("functrain's checkpoint: context_fn (torch's selective-checkpoint contexts) is not "
                       "supported; give the policy as policy= (a name, the ops to keep, or torch's policy "
                       f"function); got context_fn={describe(context_fn)}")
    for k in ("preserve_rng_state", "determinism_check", "debug", "early_stop"):
        kwargs.pop(k, None)
    return _call(function, args, kwargs, resolve_policy(policy))


def _call(function: Callable, args: tuple, kwargs: dict, policy: Policy) -> Any:
    where = _name_of(function)
    if isinstance(function, functools.partial):  # its bound tensors are inputs of the block too
        args, kwargs = function.args + args, {**function.keywords, **kwargs}
        function = function.func
        module = args[0] if args and isinstance(args[0], torch.nn.Module) else None
    else:
        module, function = _module_of(function)
    return run_remat(function, args, kwargs, policy, module, where=where)


def _module_of(function: Callable) -> tuple[torch.nn.Module | None, Callable]:
    """The module whose parameters ``function`` uses (itself, or a bound method's owner), and ``function``."""
    if isinstance(function, torch.nn.Module):
        return function, function
    owner = getattr(function, "__self__", None)
    return (owner if isinstance(owner, torch.nn.Module) else None), function


def _name_of(function: Any) -> str:
    if isinstance(function, functools.partial):
        function = function.args[0] if function.args and isinstance(function.args[0], torch.nn.Module) \
            else function.func
    if isinstance(function, torch.nn.Module):
        return f"the block {type(function).__name__}"
    return f"the function {getattr(function, '__qualname__', type(function).__name__)}"


# -- marks on modules ------------------------------------------------------------------------------------
_MARK = "_functrain_remat"


class _Mark(NamedTuple):
    policy: Policy
    forward: Any  # the instance's own forward it replaced, or None (the class's)


def _marked_forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    mark: _Mark = self.__dict__[_MARK]
    inner = mark.forward if mark.forward is not None else type(self).forward.__get__(self)
    return run_remat(inner, args, kwargs, mark.policy, self, where=f"the block {type(self).__name__}")


_CONTAINERS = (torch.nn.ModuleList, torch.nn.Sequential, torch.nn.ModuleDict)


def remat(target: Any, policy: Any = "nothing_saveable") -> Any:
    """Recompute ``target`` in the backward instead of keeping its activations (activation checkpointing).

    Args:
        target: what to recompute. A module is one block: its ``forward`` is marked in place (its
            parameters, state_dict and hooks are unchanged; a copy of the module keeps the mark). A
            ``ModuleList``/``Sequential``/``ModuleDict`` or a list of modules marks each child as a block
            (``ft.remat(model.blocks)``). A function returns its recomputed form (its tensor arguments are
            the block's inputs; a parameter it reads through a closure is refused, see :class:`RematError`).
        policy: what each block keeps for its backward: a name of :data:`POLICIES`
            (``"nothing_saveable"``, ``"dots_saveable"``, ``"dots_with_no_batch_dims_saveable"``,
            ``"everything_saveable"``), a collection of aten ops to keep, or torch's selective-checkpoint
            policy function. Marking a module again replaces its policy.

    Returns:
        ``target`` (modules, marked), or the recomputed function.

    Law: remat changes memory, never the update: a step with marked blocks computes the same gradients
    as without (to float rounding), eager and compiled, with every transform.

    Example::

        >>> import torch, functrain as ft
        >>> model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())
        ...                               for _ in range(3)])
        >>> _ = ft.remat(model, "dots_saveable")           # each of the three blocks
        >>> [type(m).__name__ for m in ft.core.remat.marked_blocks(model)]
        ['Sequential', 'Sequential', 'Sequential']
        >>> apply_fn, params, buffers = ft.functionalize(model)
        >>> step = ft.train_step(lambda p, b, x: apply_fn(p, b, x).square().mean(), ft.optim.sgd(0.1))
        >>> state, metrics = step(step.init(params, buffers), torch.randn(8, 4))
    """
    policy = resolve_policy(policy)
    if isinstance(target, torch.nn.Module):
        blocks = list(target.values() if isinstance(target, torch.nn.ModuleDict) else target) \
            if isinstance(target, _CONTAINERS) else [target]
        for b in blocks:
            _mark(b, policy)
        return target
    if isinstance(target, (list, tuple)):
        if not target:
            raise BadValue("remat: got an empty list; give a module, a list of modules (the blocks) or a function")
        for i, b in enumerate(target):
            if not isinstance(b, torch.nn.Module):
                raise BadValue(f"remat: item {i} of the list is {describe(b)}; a list marks each of its items as "
                               f"a block, so each must be a torch.nn.Module")
        for b in target:  # all checked first: a refused list marks nothing
            _mark(b, policy)
        return target
    if callable(target) and not isinstance(target, type):
        @functools.wraps(target)
        def recomputed(*args: Any, **kwargs: Any) -> Any:
            return _call(target, args, kwargs, policy)

        return recomputed
    raise BadValue(f"remat: target must be a torch.nn.Module (a block), a ModuleList/Sequential/ModuleDict or list "
                   f"of modules (each a block), or a function; got {describe(target)}")


def _mark(module: torch.nn.Module, policy: Policy) -> None:
    old = module.__dict__.get(_MARK)
    if old is not None:
        inner = old.forward
    else:
        own = module.__dict__.get("forward")
        inner = own if own is not None else None
    object.__setattr__(module, _MARK, _Mark(policy, inner))
    # the instance's forward (a bound method: a deepcopy of the module rebinds it to the copy)
    object.__setattr__(module, "forward", _marked_forward.__get__(module))


def marked_blocks(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The submodules of ``module`` (itself included) marked by :func:`remat`, in ``modules()`` order
    (a marked block's own submodules are not listed)."""
    out = []
    skip: set[int] = set()
    for m in module.modules():
        if id(m) in skip:
            continue
        if _MARK in m.__dict__:
            out.append(m)
            skip.update(id(s) for s in m.modules())
    return out


def policy_of(module: torch.nn.Module) -> Policy | None:
    """The policy ``module`` was marked with, or ``None``."""
    mark = module.__dict__.get(_MARK)
    return None if mark is None else mark.policy


# -- Hugging Face's gradient-checkpointing marks -----------------------------------------------------------
# A Hugging Face layer (transformers' GradientCheckpointingLayer, and PreTrainedModel stacks) declares a
# boolean ``gradient_checkpointing`` and, once gradient_checkpointing_enable() ran, calls
# ``self._gradient_checkpointing_func(partial(forward, self, **kwargs), *args)``: transformers' own seam for
# a custom checkpoint function (its _set_gradient_checkpointing(gradient_checkpointing_func=...)). While a
# functionalized model runs, functrain puts its checkpoint there, so those marks recompute under torch.func.
# gradient_checkpointing_enable() also hooks the input embeddings to call output.requires_grad_(True) (so that
# torch's reentrant checkpoint sees an input needing grad); torch.func refuses requires_grad_ inside its
# transforms, and functrain's checkpoint needs no such input: those hooks (the model's _require_grads_hooks
# handles) are set aside while the model runs, then put back in their places.
_HF_FLAG, _HF_FUNC, _HF_HOOKS = "gradient_checkpointing", "_gradient_checkpointing_func", "_require_grads_hooks"
_warned_offload = False


def checkpointing_layers(module: torch.nn.Module) -> tuple[torch.nn.Module, ...]:
    """The submodules of ``module`` that declare Hugging Face's ``gradient_checkpointing`` flag, and the
    Hugging Face models among them (``supports_gradient_checkpointing``: they hold the input-grad hooks)."""
    return tuple(m for m in module.modules() if isinstance(getattr(type(m), _HF_FLAG, None), bool)
                 or isinstance(m.__dict__.get(_HF_FLAG), bool)
                 or isinstance(getattr(type(m), "supports_gradient_checkpointing", None), bool))


def _routed(original: Any) -> Callable:
    global _warned_offload
    from torch.utils.checkpoint import checkpoint as torch_checkpoint

    func = original.func if isinstance(original, functools.partial) else original
    keywords = dict(original.keywords) if isinstance(original, functools.partial) else {}
    if func is not torch_checkpoint and not _warned_offload:
        _warned_offload = True
        warnings.warn(f"this model's gradient-checkpointing function is {describe(func)}, not "
                      f"torch.utils.checkpoint.checkpoint (e.g. activation_checkpointing_enable(offload=True)); "
                      f"functrain recomputes those layers with its own checkpoint, which keeps their inputs "
                      f"where they are (no offloading to the host)", RuntimeWarning, stacklevel=4)
    return functools.partial(checkpoint, **keywords)


@contextlib.contextmanager
def route_checkpointing(layers: tuple[torch.nn.Module, ...]) -> Iterator[None]:
    """While it is active, the layers among ``layers`` with gradient checkpointing on use :func:`checkpoint`."""
    swapped = []
    for m in layers:
        own = m.__dict__.get(_HF_FUNC)
        if own is not None and m.__dict__.get(_HF_FLAG, getattr(type(m), _HF_FLAG, False)) is True:
            swapped.append((m, own))
            m.__dict__[_HF_FUNC] = _routed(own)
    aside = []  # (hook dict, its items before) for each input-grad hook set aside
    if swapped:
        for m in layers:
            for handle in m.__dict__.get(_HF_HOOKS) or ():
                hooks = handle.hooks_dict_ref()
                if hooks is not None and handle.id in hooks:
                    aside.append((hooks, list(hooks.items())))
                    del hooks[handle.id]
    try:
        yield
    finally:
        for m, own in swapped:
            m.__dict__[_HF_FUNC] = own
        for hooks, items in reversed(aside):
            hooks.clear()
            hooks.update(items)
