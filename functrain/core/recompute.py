"""The mechanism of :mod:`functrain.core.remat`: run a block so that its backward recomputes it.

:func:`run_remat` runs ``fn(*args, **kwargs)`` as one :class:`torch.autograd.Function` whose inputs are the
block's parameters (lent to it through ``functional_call``) and the floating tensors of its arguments:

* forward: ``fn`` under two modes: :class:`_Record` (a dispatch mode) keeps the outputs the policy saves and
  every random draw, :class:`_Closures` (a function mode) refuses a tensor that needs a gradient but is no
  input (it would get none). Autograd keeps only the inputs (``save_for_backward``); the kept outputs live on
  the Function's context until its backward.
* backward: ``fn`` again under ``torch.func.vjp`` with :class:`_Replay`, which hands each kept output back in
  place of the op that made it, on copies of the block's buffers (a running statistic is updated once), under
  the forward's autocast state; the recomputation is tied to the incoming gradient (:func:`tie`), so a
  compiler that schedules by data dependencies runs it where the backward needs it.

Both run the same eagerly (autograd calls the backward) and traced (``torch.func`` supports
``setup_context`` Functions, and make_fx records the recomputation in the backward half of the graph).
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable, Iterable, Iterator, NamedTuple

import optree
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["Policy", "RematError", "run_remat", "tie", "Lent", "Lender", "lending"]


class RematError(RuntimeError):
    """A marked block cannot be recomputed as it ran (a tensor it reads is not one of its inputs; its
    recomputation drew a random number its forward did not)."""


class Policy(NamedTuple):
    """What a remat block keeps for its backward: ``name`` (for messages), ``saves(op, args, kwargs) -> bool``
    (``None``: keep everything, i.e. no recomputation)."""

    name: str
    saves: Callable[[Any, tuple, dict], bool] | None


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


# -- lent parameters: a block whose parameters are made from other inputs ---------------------------------
class Lent(NamedTuple):
    """What a :class:`Lender` gives a block: ``inputs``, the tensors the block is differentiated through in
    place of its parameters, and ``params(inputs) -> {name: tensor}``, the block's parameters (its own
    ``named_parameters()`` names) made from them: differentiable, run before the block's forward and again
    before its recomputation, so nothing it makes is kept between them."""

    inputs: tuple
    params: Callable[[tuple], dict]


class Lender:
    """Makes the parameters of some blocks from other tensors while it is active (:func:`lending`): sharded
    data parallelism gathers a block's parameters from this rank's shard of them (``functrain.distributed``)."""

    def lend(self, module: torch.nn.Module) -> Lent | None:  # pragma: no cover - the protocol
        """``module``'s :class:`Lent`, or ``None`` (the block uses its parameters as they are)."""
        raise NotImplementedError


_LENDER: "contextvars.ContextVar[Lender | None]" = contextvars.ContextVar("functrain_lender", default=None)


@contextlib.contextmanager
def lending(lender: Lender) -> Iterator[None]:
    """While it is active, marked blocks for which ``lender`` lends run with the parameters it makes."""
    token = _LENDER.set(lender)
    try:
        yield
    finally:
        _LENDER.reset(token)


def _not_of(saves: Callable[[Any, tuple, dict], bool], made: set) -> Callable[[Any, tuple, dict], bool]:
    """``saves``, except for an op whose tensor arguments are all lent parameters (a cast of a weight): the
    backward makes the parameters again, so what is made of them alone is made again too."""
    def keep(op: Any, args: tuple, kwargs: dict) -> bool:
        tensors = [x for x in optree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        if tensors and all(id(x) in made for x in tensors):
            return False
        return saves(op, args, kwargs)

    return keep


# -- the autograd Function -------------------------------------------------------------------------------
class _Box:
    """What the forward hands its ``setup_context`` and backward: the run, the policy, what it kept."""

    __slots__ = ("run", "policy", "where", "autocast", "n_params", "cache", "out_spec", "consts", "diff",
                 "recomputing", "lent")

    def __init__(self, run: Callable, policy: Policy, where: str, autocast: tuple, n_params: int,
                 lent: "Lent | None" = None):
        self.run, self.policy, self.where, self.autocast, self.n_params = run, policy, where, autocast, n_params
        self.lent = lent  # the block's parameters are made from its inputs (Lent.params), outside the modes
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
        n = box.n_params
        params = inputs[:n]
        saves = box.policy.saves
        if box.lent is not None:
            # the parameters are made (gathered) before the block runs, outside the record: what makes them
            # is never kept, and neither is an op of the parameters alone (a cast): the backward makes them again
            anchor = next((x for x in inputs[n:] if _anchors(x)), None)
            params = box.lent.params(tuple(tie(x, anchor) for x in params) if anchor is not None else params)
            made = {id(x) for x in optree.tree_leaves(params)}
            saves = _not_of(saves, made)
        with _Closures(inputs + tuple(optree.tree_leaves(params)), box.where), _Record(saves) as record:
            out = box.run(params, *inputs[n:])
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
                start = 0 if box.lent is not None else n_params  # lent: its parameters are made again too
                args[start:] = [tie(x, anchor) for x in args[start:]]
            params = tuple(args[:n_params]) if box.lent is None else box.lent.params(tuple(args[:n_params]))
            with _Autocast(box.autocast), _Replay(cache, box.where):
                out = box.run(params, *args[n_params:])
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
    are now: under ``functionalize``, the step's) are inputs of the block, lent to ``fn`` for the run; while a
    :class:`Lender` is active (:func:`lending`) and lends for ``module``, its :class:`Lent` inputs are the
    block's inputs instead and its parameters are made from them, in the forward and again in the backward."""
    lent = None
    if module is not None and not torch.compiler.is_dynamo_compiling():  # (Dynamo cannot read a ContextVar;
        lender = _LENDER.get()                                          # it refuses marked blocks below)
        lent = lender.lend(module) if lender is not None else None
    if lent is None and (policy.saves is None or not torch.is_grad_enabled()):
        return fn(*args, **kwargs)  # nothing to recompute (no backward will run, or everything is kept)
    if lent is not None and not torch.is_grad_enabled():
        tensors = {f"m.{nm}": x for nm, x in lent.params(lent.inputs).items()}
        tensors.update((f"m.{nm}", b) for nm, b in module.named_buffers())
        return torch.func.functional_call(_Holder(module, fn), tensors, args, kwargs, strict=False)
    if torch.compiler.is_dynamo_compiling():
        raise RematError(f"remat: {where} is marked for recomputation, which ft.compile traces on its direct path "
                         f"only (make_fx); the Dynamo path (fullgraph=False, dynamic=True, capture='dynamo' or "
                         f"extra torch.compile arguments) cannot trace it. Use ft.compile's default capture, or "
                         f"remove the remat marks")
    if lent is not None and policy.saves is None:  # keep every output; only the parameters are made again
        policy = Policy(policy.name, lambda op, args, kwargs: True)
    names: list[str] = []
    params: list[torch.Tensor] = []
    buffers: list[tuple[str, torch.Tensor]] = []
    if module is not None:
        if lent is None:
            for name, p in module.named_parameters():
                names.append(name)
                params.append(p)
        else:
            params = list(lent.inputs)
        # the buffers as the block sees them now (under functionalize: the step's copies); the backward runs
        # after the model's functional_call has put the module's own tensors back, so they are lent again
        buffers = [(f"m.{name}", b) for name, b in module.named_buffers()]
    leaves, spec = optree.tree_flatten((args, kwargs))
    pos = [i for i, x in enumerate(leaves) if _is_diff(x)]
    n = len(params)

    def run(block_params: Any, *xs: torch.Tensor) -> Any:
        full = list(leaves)
        for i, x in zip(pos, xs):
            full[i] = x
        a, k = optree.tree_unflatten(spec, full)
        if module is None:
            return fn(*a, **k)
        named = block_params.items() if isinstance(block_params, dict) else zip(names, block_params)
        tensors = {f"m.{nm}": x for nm, x in named}
        # the recomputation updates copies of the buffers: a running statistic is updated once, by the forward
        tensors.update((nm, b.clone() if box.recomputing else b) for nm, b in buffers)
        return torch.func.functional_call(_Holder(module, fn), tensors, a, k, strict=False)

    inputs = (*params, *[leaves[i] for i in pos])
    devices = {x.device.type for x in inputs}
    box = _Box(run, policy, where, _autocast_state(devices), n, lent)
    tensors = _Remat.apply(box, *inputs)
    it = iter(tensors)
    out = [next(it) if c is None else c for c in box.consts]
    return optree.tree_unflatten(box.out_spec, out)


