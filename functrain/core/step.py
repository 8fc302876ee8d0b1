"""The training step: a pipeline of stages over one state pytree (the protocol is :mod:`.transform`).

A step is ``step(state, batch) -> (new_state, metrics)``. It runs the stages of
:data:`PIPELINE`, in this order, whatever order the transforms were wrapped in::

    stage      what it does                           hook          (built-in users)
    loss       the loss of one micro-batch            wrap_loss     (mixed_precision casts and scales it)
    grad       loss -> gradients                      wrap_grad     (accumulate splits the batch and sums)
    reduce     gradients across processes             reduce        (data_parallel)
    normalise  ÷ micro-batches, or ÷ total num_items  -             (built in)
    check      unscale, finite?                       check         (mixed_precision, skip_nonfinite)
    transform  change the gradients                   transform     (clip, clip_value)
    update     the optimizer                          wrap_update   (built in; a sharded state wraps it)
    commit     keep or drop the update                commit        (built-in select; loss-scale growth/backoff)
    after      after the update                       after         (ema)

Gradients travel in *sum form* until ``normalise``: each micro-batch
contributes the gradient of its loss and a denominator (1 for a mean loss, the
item count when ``aux["num_items"]`` is given), so accumulation and data
parallelism only add, and the division happens once, by the global total.

Every decision on a tensor value (skip a non-finite update, update the EMA
every ``m`` steps) is a ``torch.where`` select on the device: the step has no
Python branch on data and no host sync, so ``torch.compile(fullgraph=True)``
captures it as one graph.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Iterable, NamedTuple

import torch

from . import tree as T
from .eager import TreespecCache, divide, tracing
from .grad import base_loss, micro_grad
from .checks import Expected, check_batch, check_inputs, check_params
from .checks import check_state as _check_state
from .flat import SLOT, ShardState
from .flat import flat as to_flat
from .rng import rng_init, with_rng
from .optimizer import check_optimizer
from .state import TrainState
from .transform import HOOKS, STAGE_HOOKS, InitContext, StepContext, Transform

__all__ = ["Step", "Transform", "StepContext", "InitContext", "Stage", "train_step", "STAGES", "PIPELINE", "HOOKS",
           "check_inputs", "with_rng", "STAGE_MARK", "marking"]

LossFn = Callable[[Any, Any, Any], Any]


def _uses(t: Transform, hook: str) -> bool:
    return getattr(type(t), hook) is not getattr(Transform, hook)


# -- the stages -------------------------------------------------------------------------------
# Each built-in is ``run(step, ctx, hooks)``: the stage's own work around ``hooks``, the bound
# hook methods of the transforms that implement it, sorted by (order, name).

STAGE_MARK = "functrain/stage/"
"""The prefix of the profiler range of each stage (``functrain/stage/grad``): an eager step run under
``torch.profiler`` marks its stages (:func:`marking`); the loss's range is its forward, inside ``grad``'s."""


def marking() -> bool:
    """Whether the stages mark their ranges: a profiler is recording and the step runs eagerly (a traced step gets
    no profiler nodes, so its graph is the same profiled or not)."""
    return not tracing() and torch.autograd._profiler_enabled()  # (tracing first: Dynamo never sees the call)


def _marked(name: str, fn: Callable) -> Callable:
    def marked(*args: Any) -> Any:
        with torch.profiler.record_function(STAGE_MARK + name):
            return fn(*args)
    return marked


def _loss_stage(step: "Step", ctx: StepContext, hooks: tuple) -> None:
    loss_fn: Callable = step._base_loss
    for hook in reversed(hooks):
        loss_fn = hook(loss_fn, ctx)
    ctx._loss_fn = _marked("loss", loss_fn) if marking() else loss_fn


def _grad_stage(step: "Step", ctx: StepContext, hooks: tuple) -> None:
    loss_fn, flatten = ctx._loss_fn, step._flatten

    def base_grad(params, buffers, batch):
        return micro_grad(loss_fn, params, buffers, batch, flatten)

    grad_fn: Callable = base_grad
    for hook in reversed(hooks):
        grad_fn = hook(grad_fn, ctx)
    ctx.grads, out = grad_fn(ctx.params, ctx.buffers, ctx.batch)
    ctx.loss, ctx.denom, ctx.aux, ctx.weight = out["loss"], out["denom"], out["aux"], out["weight"]
    ctx.buffers = out["buffers"]
    ctx._counts_items = "num_items" in out


def _normalise_stage(step: "Step", ctx: StepContext, hooks: tuple) -> None:
    # one division by the global denominator (micro-batches or items)
    if not (isinstance(ctx.denom, float) and ctx.denom == 1.0):
        leaves, spec = step._flatten(ctx.grads)
        ctx.grads = T.tree_unflatten(spec, torch._foreach_mul(leaves, 1.0 / ctx.denom)) if leaves else ctx.grads
    ctx.metrics["loss"] = divide(ctx.loss, ctx.denom)
    for k, v in ctx.aux.items():
        ctx.metrics[k] = v / ctx.weight
    if ctx._counts_items:  # the loss is a sum over items: report the global count
        ctx.metrics["num_items"] = ctx.denom


def _update_stage(step: "Step", ctx: StepContext, hooks: tuple) -> None:
    lr = step.optimizer.learning_rate(ctx.opt_state)
    ctx.metrics["lr"] = torch.as_tensor(lr, dtype=torch.float64)
    update_fn: Callable = step.optimizer.update
    for hook in reversed(hooks):
        update_fn = hook(update_fn, ctx)
    ctx._before_update = (ctx.params, ctx.opt_state)
    ctx.params, ctx.opt_state = update_fn(ctx.grads, ctx.opt_state, ctx.params)


def _commit_stage(step: "Step", ctx: StepContext, hooks: tuple) -> None:
    if ctx.apply is not None:
        old_params, old_opt = ctx._before_update
        ctx.params = T.tree_select(ctx.apply, ctx.params, old_params)
        ctx.opt_state = T.tree_select(ctx.apply, ctx.opt_state, old_opt)
    for hook in hooks:
        hook(ctx)


def _hooks_stage(step: "Step", ctx: StepContext, hooks: tuple) -> None:
    for hook in hooks:
        hook(ctx)


class Stage(NamedTuple):
    """One stage of the step: its ``name``, the :class:`Transform` method a transform
    implements to act there (``hook``, or ``None``), and the built-in ``run(step,
    ctx, hooks)`` that does the stage's own work around those hooks."""

    name: str
    hook: str | None
    run: Callable[["Step", StepContext, tuple], None]


# The built-in work of each stage (its hooks run inside it); the order is transform.STAGE_HOOKS's.
_BUILT_IN: dict[str, Callable[["Step", StepContext, tuple], None]] = {
    "loss": _loss_stage,            # loss_fn -> (objective, out); buffers copied
    "grad": _grad_stage,            # the micro-batch gradient (core.grad.micro_grad); accumulate wraps it
    "reduce": _hooks_stage,         # data_parallel
    "normalise": _normalise_stage,  # ÷ the global denominator
    "check": _hooks_stage,          # unscale, finite?
    "transform": _hooks_stage,      # clip, clip_value
    "update": _update_stage,        # the optimizer
    "commit": _commit_stage,        # select(apply, new, old); loss-scale growth
    "after": _hooks_stage,          # ema
}

PIPELINE: tuple[Stage, ...] = tuple(Stage(name, hook, _BUILT_IN[name]) for name, hook in STAGE_HOOKS)
"""The stages in the order every step runs them (:data:`functrain.core.transform.STAGE_HOOKS`), each with its
built-in work: what :meth:`Step.apply` iterates."""

STAGES: tuple[str, ...] = tuple(s.name for s in PIPELINE)
"""The stage names, in order: ``("loss", "grad", ..., "after")``."""


def _by_hook(ordered: tuple, hook: str) -> list:
    """The transforms in the order of ``hook`` (``Transform.hook_order``, else ``order``; ties by name)."""
    return sorted(ordered, key=lambda t: (t.hook_order.get(hook, t.order), t.name))


class Step:
    """A pure training step ``step(state, batch) -> (new_state, metrics)``.

    Build one with :func:`train_step`, wrap it in transforms, compile it with
    :func:`functrain.compile`. ``step.init(params, buffers)`` makes the initial
    :class:`TrainState`. Calling the step never changes its inputs.

    Attributes: ``loss_fn``, ``optimizer``, ``transforms`` (in the order applied) and
    :attr:`micro_batches`.

    Args:
        loss_fn: as :func:`train_step` takes it.
        optimizer: a functrain optimizer.
        transforms: the transforms applied (each at its stage; see :class:`Transform`).

    Example::

        >>> import torch, functrain as ft
        >>> step = ft.clip(1.0)(ft.train_step(lambda p, b, x: (p["w"] * x).sum(), ft.optim.sgd(0.1)))
        >>> [t.name for t in step.transforms], step.micro_batches
        (['clip'], 1)

    """

    loss_fn: LossFn
    optimizer: Any
    transforms: tuple[Transform, ...]

    def __init__(self, loss_fn: LossFn, optimizer: Any, transforms: Iterable[Transform] = ()):
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.transforms = tuple(transforms)
        ordered = sorted(self.transforms, key=lambda t: (t.order, t.name))  # never by wrapping order
        self._ordered = tuple(ordered)
        # PIPELINE, resolved for this step's transforms: (built-in, the bound hooks that run there); a transform
        # that shards the state adapts the others' hooks to what they declare they need (Transform.adapt_hook)
        sharder = next((t for t in ordered if t.shards_state), None)

        def bound(t: Transform, hook: str) -> Callable:
            fn = getattr(t, hook)
            return fn if sharder is None or t is sharder else sharder.adapt_hook(t, hook, fn)

        self._stages = tuple((s.run, tuple(bound(t, s.hook) for t in _by_hook(ordered, s.hook)
                                           if _uses(t, s.hook)) if s.hook else ()) for s in PIPELINE)
        self._offsets = tuple(t.rng_offset for t in ordered if _uses(t, "rng_offset"))
        self._agree = tuple(t.agree for t in ordered if _uses(t, "agree"))
        self._shards_state = any(t.shards_state for t in self.transforms)
        self._expected: Expected | None = None  # check_state's expectations, found once
        self._flatten = TreespecCache()  # flattens the params (and the gradients, shaped alike) eagerly

    # -- building ---------------------------------------------------------------------------
    def with_transform(self, transform: Transform) -> "Step":
        """A new step with ``transform`` added (what ``transform(step)`` calls)."""
        if not isinstance(transform, Transform):
            raise TypeError(f"expected a functrain Transform; got {type(transform).__name__}")
        if not transform.name:
            raise ValueError(f"{type(transform).__name__} has no name; a transform needs a unique slot name")
        for t in self.transforms:
            if t.name == transform.name:
                raise ValueError(f"transform {transform.name!r} is already applied to this step ({t!r}); "
                                 f"each transform may be applied once")
        return Step(self.loss_fn, self.optimizer, self.transforms + (transform,))

    @property
    def micro_batches(self) -> int:
        """How many micro-batches one call's batch holds: the product of the transforms'
        :attr:`Transform.micro_batches` (``accumulate(4)``: 4; 1 without accumulation)."""
        return math.prod(t.micro_batches for t in self.transforms)

    def __repr__(self) -> str:
        names = ", ".join(t.name for t in self.transforms)
        return f"Step({getattr(self.loss_fn, '__name__', 'loss_fn')}, transforms=[{names}])"

    # -- state ------------------------------------------------------------------------------
    def init(self, params: Any, buffers: Any = None, *, seed: int | None = 0, flat: bool | str = False) -> TrainState:
        """The initial state for ``params`` (and ``buffers``).

        ``seed`` seeds the random-number generator state carried in the state
        (dropout draws from it, so a step re-run from the same state draws the
        same numbers); ``seed=None`` carries none and uses torch's global RNG.
        ``flat=True`` holds the params, the optimizer state and the EMA as one
        buffer per dtype (:func:`functrain.flat`; a copy of ``params``): same
        results, fewer and larger kernels. ``flat="blocks"`` gives each repeated
        block buffers of its own (``ft.flat(..., blocks=True)``: identical blocks
        trace alike; see docs/compiling.md for what it costs and gains).
        """
        if flat not in (False, True, "blocks"):
            raise ValueError(f"init: flat must be False, True (one buffer per dtype) or 'blocks' (a buffer per "
                             f"repeated block); got {flat!r}")
        check_params(params)
        if not self._shards_state and any(x.is_meta for x in T.tree_leaves(params)):
            raise ValueError("init: the params are on the meta device (a model built under ft.init_empty() or "
                             "torch.device('meta')): they hold no values, and this step would train a state of "
                             "meta tensors. ft.data_parallel(shard='params') makes them (each rank its shard, with "
                             "the model's own reset_parameters); otherwise build the model normally")
        if flat:
            if self._shards_state:
                raise ValueError("init(flat=True): this step is a sharded data_parallel step, which holds the "
                                 "params, moments and EMA in its own flat shard layout already; drop flat=True")
            params = to_flat(params, blocks=flat == "blocks")
        buffers = {} if buffers is None else buffers
        leaves = T.tree_leaves(params)
        device = leaves[0].device if leaves else torch.device("cpu")
        # a sharding transform hands the optimizer and the params-shaped slot fields this rank's parts
        # (Transform.init_parts): the moments and an EMA are made as shards, never whole on any rank
        parts = params
        for t in self._ordered:
            if t.shards_state:
                parts = t.init_parts(params)
        slots = {t.name: t.init(parts if t.params_fields else params, buffers) for t in self.transforms}
        slots = {name: slot for name, slot in slots.items() if slot is not None}  # stateless: no slot
        state = TrainState(
            params=params,
            buffers=buffers,
            opt_state=self.optimizer.init(parts),
            step=torch.zeros((), dtype=torch.int64, device=device),
            rng=None if seed is None else rng_init(seed, device),
            slots=slots,
        )
        del parts  # (a sharded init: the shard it viewed is freed before post_init makes the rest)
        init = InitContext({t.name: tuple(t.params_fields) for t in self.transforms
                            if t.params_fields and t.name in slots})
        for t in self._ordered:
            state = t.post_init(state, init)
        if self._expected is None:  # what check_state expects, known for free here
            self._expected = Expected.of(state)
        return state

    def check_state(self, state: Any) -> None:
        """Raise unless ``state`` is a state of this step: cheap, metadata only, no device sync.

        Checks the state's kind and fields (a :class:`TrainState`, not donated; an
        int64 scalar ``step``; an ``rng`` of ``None`` or ``{"key": int64 host tensor
        [seed, counter]}``; the optimizer state's type) and its slots: one per
        stateful transform of this step, of the type its ``init`` makes, and no
        other. The difference is named (a :class:`TypeError` that is also a
        :class:`ValueError`)::

            state.slots has 'ema' but this step has no 'ema' transform; expected slots ['mixed_precision']

        What a step expects is found once (from :meth:`init`, or by running the
        transforms' ``init`` on meta tensors shaped like ``state.params``) and cached.
        Every call of the step runs this check; call it yourself to test a loaded
        checkpoint against a step before training.

        Example::

            >>> import torch, functrain as ft
            >>> step = ft.ema(0.9)(ft.train_step(lambda p, b, x: (p["w"] * x).sum(), ft.optim.sgd(0.1)))
            >>> plain = ft.train_step(lambda p, b, x: (p["w"] * x).sum(), ft.optim.sgd(0.1))
            >>> plain.check_state(step.init({"w": torch.ones(2)}))
            Traceback (most recent call last):
            ...
            functrain.core.validate.BadValue: the state does not match this step: state.slots has 'ema' ...
        """
        self._refuse_foreign_shards(state)
        _check_state(self, state)

    def _refuse_foreign_shards(self, state: Any) -> None:
        # a state sharded over ranks (functrain.core.flat's ShardState slot) runs only in a sharded
        # data_parallel step, and a sharded step takes only such a state: say so before the generic
        # slot mismatch would
        slots = getattr(state, "slots", None)
        if not isinstance(slots, dict):
            return  # check_state names that
        sharded = isinstance(slots.get(SLOT), ShardState)
        if sharded and not self._shards_state:
            raise ValueError(f"this state is sharded over ranks (it has a {SLOT!r} ShardState slot) but this step "
                             f"{self!r} is not a sharded data_parallel step: use the step that made it, gather it "
                             f"(ft.gather_state) or load its checkpoint into this step's state (ft.load)")
        if self._shards_state and not sharded:
            raise ValueError(f"this step {self!r} takes a sharded state (from its init, or ft.load(path, "
                             f"step.init(params, buffers))); this state is not sharded (it has no {SLOT!r} "
                             f"slot): it was made by an unsharded step")

    # -- running ----------------------------------------------------------------------------
    def __call__(self, state: TrainState, batch: Any) -> tuple[TrainState, dict]:
        return self.host_call(self.apply, state, batch)

    def host_call(self, fn: Callable, state: TrainState, batch: Any) -> tuple[TrainState, dict]:
        """Run ``fn(state, batch)`` (``self.apply`` or its compiled form) with the host-side work of a call:
        :meth:`check_state`, the batch check, and the RNG hand-over (:func:`functrain.core.rng.with_rng`) with
        this process's :meth:`rng_offset`. ``Step.__call__`` and ``CompiledStep.__call__`` are this."""
        self._refuse_foreign_shards(state)
        _check_state(self, state, rng=False)  # with_rng checks state.rng as it reads the key
        check_batch(batch)
        offsets = self._offsets
        return with_rng(fn, state, batch, sum(f() for f in offsets) if offsets else 0)

    def rng_offset(self) -> int:
        """What this process adds to each step's seed: the transforms' :meth:`Transform.rng_offset`
        summed (its rank under data parallelism), else 0."""
        return sum(f() for f in self._offsets)

    def agree(self, value: "int | tuple[float, ...]") -> "int | tuple[float, ...]":
        """The least ``value`` any process running this step holds (:meth:`Transform.agree` of its transforms;
        ``value`` itself on one process); a tuple of floats is agreed elementwise. A host collective: every
        process must call it at the same step.

        Example::

            >>> import torch, functrain as ft
            >>> ft.train_step(lambda p, b, x: (p["w"] * x).sum(), ft.optim.sgd(0.1)).agree(1)
            1
        """
        for fn in self._agree:
            value = fn(value)
        return value

    def apply(self, state: TrainState, batch: Any) -> tuple[TrainState, dict]:
        """The pure step without the host-side work (what :func:`functrain.compile` traces):
        the stages of :data:`PIPELINE`, in order."""
        ctx = StepContext(state, batch)
        if marking():  # under torch.profiler, eagerly: a range per stage (the loss's is its forward, in grad's)
            for name, (run, hooks) in zip(STAGES, self._stages):
                if name != "loss":
                    with torch.profiler.record_function(STAGE_MARK + name):
                        run(self, ctx, hooks)
                else:
                    run(self, ctx, hooks)
        else:
            for run, hooks in self._stages:
                run(self, ctx, hooks)
        new_state = TrainState(
            params=ctx.params,
            buffers=ctx.buffers,
            opt_state=ctx.opt_state,
            step=state.step + 1,
            rng=state.rng,
            slots=ctx.slots,
        )
        return new_state, ctx.metrics

    def _base_loss(self, params: Any, buffers: Any, batch: Any) -> tuple[torch.Tensor, dict]:
        return base_loss(self.loss_fn, params, buffers, batch)


def train_step(loss_fn: LossFn, optimizer: Any) -> Step:
    """A pure training step from a loss function and a functional optimizer.

    ``loss_fn(params, buffers, batch)`` returns a scalar loss, or ``(loss, aux)``
    where ``aux`` is a dict of tensors that flows into the metrics. If
    ``aux["num_items"]`` is present the loss is taken as a *sum* over that many
    items, and the gradient is normalised by the total item count (over
    micro-batches, and processes with data parallelism).

    Args:
        loss_fn: ``loss_fn(params, buffers, batch) -> loss | (loss, aux)``, pure (no in-place writes to its inputs).
        optimizer: a functrain optimizer (``ft.optim.adamw(1e-3)``, ...), or a ``torch.optim`` optimizer instance,
            an ``(optimizer, lr_scheduler)`` pair or a scheduler, translated by :func:`functrain.optim.from_torch`.

    Returns:
        The :class:`Step`; wrap it in transforms (``ft.clip(1.0)(step)``) and compile it (``ft.compile(step)``).

    Example::

        >>> import torch, functrain as ft
        >>> model = torch.nn.Linear(4, 1)
        >>> apply_fn, params, buffers = ft.functionalize(model)
        >>> def loss_fn(params, buffers, batch):
        ...     x, y = batch
        ...     return torch.nn.functional.mse_loss(apply_fn(params, buffers, x), y)
        >>> step = ft.train_step(loss_fn, ft.optim.adamw(lr=1e-3))
        >>> state = step.init(params, buffers)
        >>> state, metrics = step(state, (torch.randn(8, 4), torch.randn(8, 1)))
        >>> int(state.step), metrics["loss"].shape
        (1, torch.Size([]))
    """
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable(params, buffers, batch) -> loss; got {type(loss_fn).__name__}")
    # a torch.optim optimizer comes back translated (functrain.optim registers the translation); else explains
    optimizer = check_optimizer(optimizer)
    return Step(loss_fn, optimizer)


