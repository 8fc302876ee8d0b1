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
from typing import Any, Callable, Iterable, Iterator, NamedTuple

import optree
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

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


class RematError(RuntimeError):
    """A marked block cannot be recomputed as it ran (a tensor it reads is not one of its inputs; its
    recomputation drew a random number its forward did not)."""


class Policy(NamedTuple):
    """What a remat block keeps for its backward: ``name`` (for messages), ``saves(op, args, kwargs) -> bool``
    (``None``: keep everything, i.e. no recomputation)."""

    name: str
    saves: Callable[[Any, tuple, dict], bool] | None


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


# -- the forward's record and the backward's replay ----------------------------------------------------
def _key(op: Any, args: tuple, kwargs: dict) -> tuple:
    # an op's kept outputs are found again by the op and its tensor arguments' shapes and dtypes (the
    # recomputation runs under torch.func.vjp, where a few ops decompose otherwise than in the forward, so
    # the order may differ; never the shapes at the same place). A random draw is keyed by the draw, not the
    # overload: torch.func turns dropout's in-place bernoulli_(p) into bernoulli(p), the same numbers
    metas = tuple((tuple(x.shape), x.dtype) for x in optree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor))
    if _is_random(op, args, kwargs):
        return op._schema.name.rstrip("_"), metas
    return op, metas


def _is_random(op: Any, args: tuple, kwargs: dict) -> bool:
    """Whether the op draws random numbers: tagged so, and (attention kernels, tagged for their dropout) not
    called with ``dropout_p=0``."""
    if torch.Tag.nondeterministic_seeded not in op.tags:
        return False
    for i, a in enumerate(op._schema.arguments):
        if a.name == "dropout_p":
            p = kwargs.get(a.name, a.default_value) if a.kwarg_only or i >= len(args) else args[i]
            return p != 0
    return True


def _written(op: Any, args: tuple, kwargs: dict) -> list:
    """The tensors an op writes into (in-place and ``out=`` arguments)."""
    out = []
    for i, a in enumerate(op._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            value = kwargs.get(a.name) if a.kwarg_only or i >= len(args) else args[i]
            out.extend(x for x in optree.tree_leaves(value) if isinstance(x, torch.Tensor))
    return out


def _storage(x: torch.Tensor) -> Any:
    from torch.multiprocessing.reductions import StorageWeakRef
    return StorageWeakRef(x.untyped_storage())


def _returns_alias(op: Any) -> bool:
    return any(r.alias_info is not None for r in op._schema.returns)


class _Entry:
    __slots__ = ("value", "random", "valid")

    def __init__(self, value: Any, random: bool):
        self.value, self.random, self.valid = value, random, True


class _Record(TorchDispatchMode):
    """The forward: runs each op and keeps the outputs the policy saves, and every random draw."""

    def __init__(self, saves: Callable[[Any, tuple, dict], bool]):
        super().__init__()
        self.saves = saves
        self.cache: dict[tuple, list[_Entry]] = {}
        self.by_storage: dict[Any, list[_Entry]] = {}

    def __torch_dispatch__(self, op, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        mutable = op._schema.is_mutable
        if mutable and self.by_storage:
            for x in _written(op, args, kwargs):
                for entry in self.by_storage.pop(_storage(x), ()):
                    # about to be overwritten: a random draw is kept as a copy (it cannot be drawn again),
                    # a saved value is forgotten (recomputed instead: the same number)
                    if entry.random:
                        entry.value = optree.tree_map(torch.clone, entry.value)
                    else:
                        entry.valid = False
        out = op(*args, **kwargs)
        random = _is_random(op, args, kwargs)
        if random or (not _returns_alias(op) and self.saves(op, args, kwargs)):
            value = optree.tree_map(torch.clone, out) if random and mutable else out
            entry = _Entry(value, random)
            self.cache.setdefault(_key(op, args, kwargs), []).append(entry)
            for x in optree.tree_leaves(value):
                if isinstance(x, torch.Tensor):
                    self.by_storage.setdefault(_storage(x), []).append(entry)
        return out


_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _anchors(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point() and x.numel() > 0


def tie(value: Any, anchor: torch.Tensor) -> Any:
    """``value`` (bitwise, NaN and -0.0 included: times an integer one), made to depend on ``anchor``'s data.

    Why: the recomputation computes what the forward computed from the same tensors, and inductor, which
    schedules by data dependencies, would otherwise run it early, next to (or horizontally fused with) the
    forward op it repeats, keeping its result alive until the backward. Tied to the backward's incoming
    gradient (and a kept value to the recomputed tensors that meet it), it runs where the backward needs it.
    """
    if not (isinstance(value, torch.Tensor) and value.is_floating_point()):
        return value
    one = 1 + (anchor.reshape(-1)[:1].view(_INT_OF_SIZE[anchor.element_size()]) & 0)
    return value * one


class _Replay(TorchDispatchMode):
    """The recomputation: an op whose output the forward kept returns it instead of running."""

    def __init__(self, cache: dict, where: str):
        super().__init__()
        self.cache = cache
        self.where = where

    def __torch_dispatch__(self, op, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        queue = self.cache.get(_key(op, args, kwargs))
        while queue:
            entry = queue.pop(0)
            if not entry.valid:
                continue
            anchor = next((x for x in optree.tree_leaves((args, kwargs)) if _anchors(x)), None)
            value = entry.value if anchor is None else optree.tree_map(lambda v: tie(v, anchor), entry.value)
            if op._schema.is_mutable:  # an in-place draw (bernoulli_): write the kept values where it writes
                targets = _written(op, args, kwargs)
                for t, v in zip(targets, optree.tree_leaves(value)):
                    t.copy_(v)
                return targets[0] if len(targets) == 1 else tuple(targets)
            return value
        if _is_random(op, args, kwargs):
            raise RematError(f"remat: recomputing {self.where} drew a random number ({op}) that its forward did "
                             f"not draw with these shapes, so the recomputation cannot reproduce the forward; the "
                             f"block must draw the same random numbers on every call")
        return op(*args, **kwargs)


class _Closures(TorchFunctionMode):
    """The forward's guard: a tensor that needs a gradient but is not an input of the block (a parameter it
    reaches through a closure) would get none through the recomputation: refuse it."""

    def __init__(self, inputs: tuple, where: str):
        super().__init__()
        self.ids = {id(x) for x in inputs}
        # the inputs are the primals of the forward's torch.func.vjp: what they make lives at their level
        self.level = max((torch._C._functorch.maybe_get_level(x) for x in inputs), default=-1)
        self.where = where

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for x in optree.tree_leaves((args, kwargs)):
            if isinstance(x, torch.Tensor) and id(x) not in self.ids and self._tracked(x):
                raise RematError(
                    f"remat: {self.where} reads a tensor of shape {tuple(x.shape)} that needs a gradient but is "
                    f"not one of its inputs (a parameter reached through a closure, a global or another "
                    f"module's attribute); the recomputation could not give it a gradient. Pass it as an "
                    f"argument, or register it in the marked module (its parameters are inputs)")
        return func(*args, **kwargs)

    def _tracked(self, x: torch.Tensor) -> bool:
        # needs a gradient from a level other than the block's own: a parameter of the step's gradient
        # (torch.func, traced) or a leaf of the eager autograd graph
        if not x.requires_grad:
            return False
        return not torch._C._functorch.is_functorch_wrapped_tensor(x) or \
            torch._C._functorch.maybe_get_level(x) != self.level


# -- the autograd Function -------------------------------------------------------------------------------
class _Box:
    """What the forward hands its ``setup_context`` and backward: the run, the policy, what it kept."""

    __slots__ = ("run", "policy", "where", "autocast", "n_params", "cache", "out_spec", "consts", "diff",
                 "recomputing")

    def __init__(self, run: Callable, policy: Policy, where: str, autocast: tuple, n_params: int):
        self.run, self.policy, self.where, self.autocast, self.n_params = run, policy, where, autocast, n_params
        self.recomputing = False
        self.cache: dict | None = None
        self.out_spec = self.consts = self.diff = None


def _autocast_state(devices: Iterable[str]) -> tuple:
    states = []
    for device in sorted(set(devices) | {"cpu"}):
        try:
            if torch.is_autocast_enabled(device):
                states.append((device, torch.get_autocast_dtype(device), torch.is_autocast_cache_enabled()))
        except RuntimeError:  # a device type without autocast
            continue
    return tuple(states)


class _Remat(torch.autograd.Function):
    @staticmethod
    def forward(box: _Box, *inputs: torch.Tensor) -> tuple:  # type: ignore[override]
        with _Closures(inputs, box.where), _Record(box.policy.saves) as record:
            out = box.run(*inputs)
        leaves, box.out_spec = optree.tree_flatten(out)
        box.consts = [None if isinstance(x, torch.Tensor) else x for x in leaves]
        tensors = tuple(x for x in leaves if isinstance(x, torch.Tensor))
        box.diff = tuple(x.is_floating_point() or x.is_complex() for x in tensors)
        box.cache = record.cache
        return tensors

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        box, *xs = inputs
        ctx.box = box
        ctx.save_for_backward(*xs)
        ctx.mark_non_differentiable(*[o for o, d in zip(output, box.diff) if not d])

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        box: _Box = ctx.box
        xs = ctx.saved_tensors
        need = [i for i, n in enumerate(ctx.needs_input_grad[1:]) if n]
        cache, box.cache = box.cache, None  # once: the kept values go when the backward is done with them
        box.recomputing = True

        anchor = next((g for g in grads if _anchors(g)), None)
        n_params = box.n_params

        def again(*diff: torch.Tensor) -> tuple:
            args = list(xs)
            for i, d in zip(need, diff):
                args[i] = d
            if anchor is not None:  # the recomputation starts when the backward reaches the block (see tie)
                args[n_params:] = [tie(x, anchor) for x in args[n_params:]]
            with _Autocast(box.autocast), _Replay(cache, box.where):
                out = box.run(*args)
            tensors = [x for x in optree.tree_leaves(out) if isinstance(x, torch.Tensor)]
            return tuple(t for t, d in zip(tensors, box.diff) if d)

        if not need:
            return (None,) * (1 + len(xs))
        _, vjp = torch.func.vjp(again, *[xs[i] for i in need])
        got = vjp(tuple(g for g, d in zip(grads, box.diff) if d))
        res: list = [None] * len(xs)
        for i, g in zip(need, got):
            res[i] = g
        return (None, *res)


class _Autocast:
    """Re-enter the forward's autocast states for the recomputation (autocast is not active in a backward)."""

    def __init__(self, states: tuple):
        self.managers = [torch.autocast(device, dtype=dtype, cache_enabled=cache) for device, dtype, cache in states]

    def __enter__(self) -> None:
        for m in self.managers:
            m.__enter__()

    def __exit__(self, *exc: Any) -> None:
        for m in reversed(self.managers):
            m.__exit__(*exc)


# -- running a block through it --------------------------------------------------------------------------
class _Holder(torch.nn.Module):
    """Lends a block's parameters to ``fn`` through ``functional_call`` (the block is its child ``m``)."""

    def __init__(self, module: torch.nn.Module, fn: Callable):
        super().__init__()
        self.m = module
        self.fn = fn

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


def _is_diff(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex())


def run_remat(fn: Callable, args: tuple, kwargs: dict, policy: Policy, module: torch.nn.Module | None = None,
              where: str = "a remat block") -> Any:
    """``fn(*args, **kwargs)``, recomputed in the backward under ``policy``. ``module``'s parameters (as they
    are now: under ``functionalize``, the step's) are inputs of the block, lent to ``fn`` for the run."""
    if policy.saves is None or not torch.is_grad_enabled():
        return fn(*args, **kwargs)  # nothing to recompute (no backward will run, or everything is kept)
    if torch.compiler.is_dynamo_compiling():
        raise RematError(f"remat: {where} is marked for recomputation, which ft.compile traces on its direct path "
                         f"only (make_fx); the Dynamo path (fullgraph=False, dynamic=True, capture='dynamo' or "
                         f"extra torch.compile arguments) cannot trace it. Use ft.compile's default capture, or "
                         f"remove the remat marks")
    names: list[str] = []
    params: list[torch.Tensor] = []
    buffers: list[tuple[str, torch.Tensor]] = []
    if module is not None:
        for name, p in module.named_parameters():
            names.append(name)
            params.append(p)
        # the buffers as the block sees them now (under functionalize: the step's copies); the backward runs
        # after the model's functional_call has put the module's own tensors back, so they are lent again
        buffers = [(f"m.{name}", b) for name, b in module.named_buffers()]
    leaves, spec = optree.tree_flatten((args, kwargs))
    pos = [i for i, x in enumerate(leaves) if _is_diff(x)]
    n = len(params)

    def run(*xs: torch.Tensor) -> Any:
        full = list(leaves)
        for i, x in zip(pos, xs[n:]):
            full[i] = x
        a, k = optree.tree_unflatten(spec, full)
        if module is None:
            return fn(*a, **k)
        tensors = {f"m.{nm}": x for nm, x in zip(names, xs[:n])}
        # the recomputation updates copies of the buffers: a running statistic is updated once, by the forward
        tensors.update((nm, b.clone() if box.recomputing else b) for nm, b in buffers)
        return torch.func.functional_call(_Holder(module, fn), tensors, a, k, strict=False)

    inputs = (*params, *[leaves[i] for i in pos])
    devices = {x.device.type for x in inputs}
    box = _Box(run, policy, where, _autocast_state(devices), n)
    tensors = _Remat.apply(box, *inputs)
    it = iter(tensors)
    out = [next(it) if c is None else c for c in box.consts]
    return optree.tree_unflatten(box.out_spec, out)


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
