"""The transform protocol: what a transform may implement, and what its hooks read and write.

A transform is a ``Step -> Step`` feature that owns one slot of the state and acts at
the stages of the step (see :mod:`functrain.core.step`, which runs them). The protocol
is closed: :class:`Transform` declares everything a transform may implement (one hook
per stage, ``init``/``post_init``, ``rng_offset``, ``agree``) and every capability the core or
``data_parallel`` asks of it (``params_fields``, ``shards_state``, ``micro_batches``,
``accessors``, ``needs``, ``adapt_hook``); the step calls nothing else and reads nothing else.
:class:`StepContext` is what the hooks read and write while one step runs;
:class:`InitContext` what ``post_init`` may read about the step being initialised.

:data:`STAGE_HOOKS` is the one place the order of the stages is written:
``functrain.core.step.PIPELINE`` pairs each stage with its built-in work.
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Any, Callable, ClassVar, Mapping

import torch

from . import tree as T
from .state import TrainState, register_accessor

__all__ = ["Transform", "StepContext", "InitContext", "STAGE_HOOKS", "HOOKS", "NEEDS"]

STAGE_HOOKS: tuple[tuple[str, str | None], ...] = (
    ("loss", "wrap_loss"),        # loss_fn -> (objective, out); mixed_precision casts and scales
    ("grad", "wrap_grad"),        # the gradient of each micro-batch; accumulate splits and sums
    ("reduce", "reduce"),         # across processes: data_parallel
    ("normalise", None),          # built in: ÷ the global denominator
    ("check", "check"),           # unscale, finite?
    ("transform", "transform"),   # clip, clip_value
    ("update", "wrap_update"),    # the optimizer
    ("commit", "commit"),         # built-in select(apply, new, old); loss-scale growth
    ("after", "after"),           # ema
)
"""``(stage, hook)`` in the order every step runs the stages; ``hook`` is the :class:`Transform` method a
transform implements to act there (``None``: the stage is built in only)."""

HOOKS: tuple[str, ...] = tuple(h for _, h in STAGE_HOOKS if h)
"""The stage hooks a :class:`Transform` may implement, in stage order."""

NEEDS: tuple[str, ...] = ("elementwise", "global", "leaves")
"""What a transform may declare it needs of the gradients, params and updates its hooks see
(:attr:`Transform.needs`): ``"elementwise"`` (each element on its own: any cut of a flat buffer gives the
same result), ``"global"`` (also reductions over the whole tree, each summed with
:meth:`StepContext.global_sum`), ``"leaves"`` (whole named leaves with their shapes)."""

# Method names a transform might define expecting a call that never comes: refused when the class is made.
_NOT_HOOKS = {"loss": "wrap_loss", "grad": "wrap_grad", "normalise": None, "update": "wrap_update",
              "rng_rank": "rng_offset"}


class StepContext:
    """What a transform's hooks read and write while one step runs (or is traced).

    Attributes (all tensors live on the device):
        state:    the input :class:`TrainState` (never modified).
        batch:    the batch given to the step.
        params, buffers, opt_state: current values; after ``update`` the new ones.
        grads:    the gradient pytree (sum form before ``normalise``).
        loss, denom, aux, weight: the summed loss, its denominator, the summed aux
                  metrics and how many micro-batches contributed to them. ``denom``
                  and ``weight`` are Python floats while they are known without
                  running the step (no ``num_items``), tensors otherwise.
        finite:   ``None`` or a bool scalar: were the loss and gradients finite?
        apply:    ``None`` or a bool scalar: is this step's update kept? (see :meth:`keep_if`)
        boundary: ``None`` or a bool scalar: does this call end an update window?
                  (streaming accumulation sets it; loss scaling only adapts there)
        metrics:  the dict returned to the caller.
        shard_group: ``None``, or (while ``grads`` is one rank's shard) the process group whose ranks hold the
                  shards: :meth:`global_sum` sums over it

    Args:
        state: the step's input state.
        batch: the step's batch.

    A step makes one per call (transforms never construct it); a hook reads and sets its attributes.

    Example::

        >>> import torch, functrain as ft
        >>> class Seen(ft.Transform):
        ...     name = "seen"
        ...     def after(self, ctx):
        ...         ctx.metrics["grad_norm"] = ft.tree.global_norm(ctx.grads)
        >>> step = Seen()(ft.train_step(lambda p, b, x: (p["w"] * x).sum(), ft.optim.sgd(0.1)))
        >>> _, metrics = step(step.init({"w": torch.ones(2)}), torch.tensor([3.0, 4.0]))
        >>> float(metrics["grad_norm"])
        5.0

    """

    def __init__(self, state: TrainState, batch: Any):
        self.state = state
        self.batch = batch
        self.params = state.params
        self.buffers = state.buffers
        self.opt_state = state.opt_state
        self.slots = dict(state.slots)
        self.grads: Any = None
        self.loss: Any = None
        self.denom: Any = None
        self.aux: dict = {}
        self.weight: Any = None
        self.finite: torch.Tensor | None = None
        self.apply: torch.Tensor | None = None
        self.boundary: torch.Tensor | None = None
        self.metrics: dict = {}
        self.shard_group: Any = None  # set by sharded data_parallel (data: the group, not a callable)
        self._loss_fn: Callable | None = None   # the loss stage's result, differentiated by the grad stage
        self._counts_items = False              # the loss is a sum over aux["num_items"] items
        self._before_update: tuple = ()         # (params, opt_state) the commit stage falls back to

    def slot(self, transform: "Transform") -> Any:
        """The transform's slot as it is now in this step."""
        return self.slots[transform.name]

    def set_slot(self, transform: "Transform", value: Any) -> None:
        """Set the transform's slot in the new state."""
        self.slots[transform.name] = value

    def keep_if(self, pred: torch.Tensor) -> None:
        """Keep this step's update only where ``pred`` (a bool scalar tensor) holds.

        Predicates from several transforms are and-ed; the ``commit`` stage then
        selects new or old params and optimizer state on the device.
        """
        self.apply = pred if self.apply is None else self.apply & pred

    def global_sum(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` summed over the gradient's shards (an in-graph all-reduce while ``grads`` is one rank's shard, else
        ``x``): how a transform reads a global property of the gradient, e.g. ``ctx.global_sum(sq).sqrt()``."""
        if self.shard_group is None:
            return x
        from torch.distributed import _functional_collectives as funcol  # (torch's; in the graph when traced)

        return funcol.wait_tensor(funcol.all_reduce(x, "sum", self.shard_group))

    def skip_unless_finite(self) -> torch.Tensor:
        """Drop this step's update unless the loss and the gradients, as they are now, are finite.

        The one "skip a non-finite update" rule, shared by every transform that
        needs it (``skip_nonfinite``, fp16 loss scaling): and-s the result into
        :attr:`finite`, keeps the update only where it holds (:meth:`keep_if`) and
        sets ``metrics["skipped"]``. Returns this check's own bool scalar. Call it
        in the ``check`` stage, after unscaling.

        Example (a transform's ``check`` hook)::

            def check(self, ctx):
                finite = ctx.skip_unless_finite()
                ctx.set_slot(self, {"bad": ctx.slot(self)["bad"] + (~finite).to(torch.int64)})
        """
        bad = self.global_sum((~T.tree_all_finite(self.grads)).to(torch.float32))  # shards: any rank's counts
        finite = (bad == 0) & torch.isfinite(self.metrics["loss"])
        self.finite = finite if self.finite is None else self.finite & finite
        self.keep_if(finite)
        self.metrics["skipped"] = ~self.finite
        return finite


class InitContext:
    """What ``Transform.post_init`` may read about the step being initialised: the other transforms'
    declarations, never the transforms themselves.

    Attributes:
        params_fields: ``{slot name: field names}`` from each stateful transform's
            :attr:`Transform.params_fields` (only slots that declare some).
    """

    __slots__ = ("params_fields",)

    def __init__(self, params_fields: dict[str, tuple[str, ...]]):
        self.params_fields = params_fields

    def map_params_like(self, slots: dict, fn: Callable[[Any], Any]) -> dict:
        """``slots`` with ``fn(tree)`` in place of each declared params-shaped field (new containers;
        the other fields are the same objects)."""
        out = dict(slots)
        for name, fields in self.params_fields.items():
            if name in out:
                out[name] = _replace_fields(out[name], fields, fn)
        return out


def check_needs(value: Any, owner: str) -> None:
    """Refuse a :attr:`Transform.needs` that is not ``None`` or one of :data:`NEEDS`, naming ``owner``."""
    if value is not None and value not in NEEDS:
        raise ValueError(f"{owner}.needs = {value!r}: a transform declares what its hooks need of the gradients "
                         f"and params as one of {', '.join(map(repr, NEEDS))} (or leaves it None: undeclared)")


def _replace_fields(slot: Any, fields: tuple[str, ...], fn: Callable[[Any], Any]) -> Any:
    if isinstance(slot, tuple) and hasattr(slot, "_fields"):  # a NamedTuple slot
        return slot._replace(**{f: fn(getattr(slot, f)) for f in fields})
    if isinstance(slot, dict):
        return {k: fn(v) if k in fields else v for k, v in slot.items()}
    raise TypeError(f"params_fields {fields!r}: the slot is a {type(slot).__name__}; declared fields need a "
                    f"NamedTuple or dict slot")


class Transform:
    """Base class of step transforms: ``Step -> Step`` features that own one state slot.

    The protocol is closed: a transform implements only the methods declared here,
    and a step calls nothing else on it.

    * ``name`` (its slot in ``state.slots``; a step holds at most one transform of
      each name) and ``order`` (sorts transforms within a stage, ties by name, so
      the wrapping order never matters); ``hook_order``: ``{hook: order}`` for the hooks
      that sort otherwise (a per-block sharded step wraps the loss outermost, so that
      mixed precision casts what it gathers).
    * ``init(params, buffers)`` returns its slot's initial state (``None``: no slot,
      and the state's structure does not depend on the transform); ``post_init(state,
      init) -> state`` adjusts the complete initial state once, eagerly (``init`` is the
      :class:`InitContext`: what the step's transforms declared).
    * ``params_fields`` (class attribute): the fields of the slot (``NamedTuple`` field
      names or dict keys) that hold a tree shaped like the params and updated with them
      (an EMA's ``params``, Lookahead's slow weights). A sharded data-parallel step holds
      1/N of each on each rank and hands the transform this rank's shard, as it does the
      params and the optimizer moments; other fields stay whole and replicated.
    * ``shards_state`` (class attribute): whether the transform cuts the state over
      ranks (the sharded ``data_parallel``): a step with one takes only sharded states.
      ``init_parts(params)`` (such a transform only) gives what the optimizer and the
      ``params_fields`` transforms initialise from: this rank's parts, so no rank builds
      the whole optimizer state or EMA.
    * ``needs`` (class attribute): what its hooks need of the gradients, params and updates
      they see, one of :data:`NEEDS`: ``"elementwise"`` (per-element ops: any cut of a flat
      buffer gives the same result; a slot's ``params_fields`` included), ``"global"`` (also
      reductions over the whole tree, each summed with :meth:`StepContext.global_sum`, as
      ``clip``'s norm), ``"leaves"`` (whole named leaves with their shapes: a per-layer
      scale, a per-row mean). ``None`` by default: undeclared. A sharded data-parallel step
      hands most hooks one flat shard per dtype, so it refuses by name, when it is built, a
      transform that declares nothing and implements such a hook, and gathers the whole
      leaves for a ``"leaves"`` transform's ``check`` and ``transform`` hooks (refusing its
      other such hooks); elsewhere ``needs`` changes nothing (docs/transforms.md, "What a
      transform needs").
    * ``adapt_hook(transform, hook, fn) -> fn`` (a ``shards_state`` transform only): how
      another transform's bound ``hook`` runs in a step with this one: ``fn`` itself, a
      wrapper, or a ``ValueError`` naming it. :class:`functrain.core.step.Step` asks it once
      per hook when it is built.
    * ``micro_batches``: how many micro-batches one call's batch holds (``accumulate(n)``
      splits it into ``n``; 1 by default, and for a streaming accumulation, which takes one
      micro-batch per call). :attr:`functrain.core.step.Step.micro_batches` is the product
      over a step's transforms; the trainer loads batches of that many micro-batches.
    * ``accessors`` (class attribute): ``{attribute: fn(slot)}`` conveniences on
      :class:`TrainState` (``state.ema`` comes from ``ft.ema``'s class).
    * ``rng_offset()``: added to each step's random seed on this process (the
      rank, under data parallelism); 0 by default.
    * ``agree(value) -> int``: the least host int any process of the transform's
      group holds (a bounded collective; data parallelism's MIN all-reduce), ``value``
      by default: how the ranks decide together, e.g. when to switch to the compiled step.
    * One hook per stage (see :data:`STAGE_HOOKS`):

      - ``wrap_loss(loss_fn, ctx) -> loss_fn`` (stage ``loss``): ``loss_fn(params,
        buffers, batch) -> (objective, out)``, differentiated w.r.t. ``params``;
        ``out`` holds tensors only (``loss``, ``aux``, ``buffers``; ``denom`` and
        ``num_items`` when the loss counts items).
      - ``wrap_grad(grad_fn, ctx) -> grad_fn`` (stage ``grad``): ``grad_fn(params,
        buffers, batch) -> (grads, out)``; ``out`` holds ``loss``, ``denom``, ``aux``,
        ``weight`` and ``buffers``, all summable.
      - ``wrap_update(update_fn, ctx) -> update_fn`` (stage ``update``):
        ``update_fn(grads, opt_state, params) -> (params, opt_state)``, the
        optimizer's update; a sharded-state transform updates its shard only.
      - ``reduce(ctx)``, ``check(ctx)``, ``transform(ctx)``, ``commit(ctx)``,
        ``after(ctx)``: read and write the :class:`StepContext`.

      Wrapping hooks compose with the lowest ``order`` outermost.

    Write each hook once, for eager calls and traces alike: decide with tensor
    selects, never a Python branch on a tensor value. Where the eager step can take a
    host shortcut (a counter read on the host, a host-side choice, an in-place sum into
    tensors the step made) call :mod:`functrain.core.eager` (``host_number``,
    ``select``, ``Sum``, ...), which takes it only where it gives the same numbers and
    cannot end up baked into a graph; ``ft.ema``'s ``after`` is the example.

    Applying a transform to a step returns a new step; the original is unchanged.

    Args:
        (none: a subclass takes its own options in ``__init__``; calling a transform on a step, ``t(step)``,
        returns the new step.)

    Example::

        >>> import torch, functrain as ft
        >>> class Halve(ft.Transform):
        ...     name, order = "halve", 50
        ...     def transform(self, ctx):
        ...         ctx.grads = ft.tree.tree_scale(ctx.grads, 0.5)
        >>> step = Halve()(ft.train_step(lambda p, b, x: (p["w"] * x).sum(), ft.optim.sgd(1.0)))
        >>> state, _ = step(step.init({"w": torch.zeros(2)}), torch.tensor([2.0, 4.0]))
        >>> state.params["w"]
        tensor([-1., -2.])

    Example, a transform that adds Gaussian noise to the gradients, with a count
    in its slot and ``state.noise_count`` to read it::

        import torch, functrain as ft

        class GradNoise(ft.Transform):
            name = "grad_noise"
            order = 50                      # after clip (10) in the "transform" stage
            accessors = {"noise_count": lambda slot: slot["count"]}

            def __init__(self, std):
                self.std = std

            def init(self, params, buffers):
                return {"count": torch.zeros((), dtype=torch.int64)}

            def transform(self, ctx):
                ctx.grads = ft.tree.tree_map(
                    lambda g: g + self.std * torch.randn_like(g), ctx.grads)
                ctx.set_slot(self, {"count": ctx.slot(self)["count"] + 1})

        step = GradNoise(1e-3)(ft.clip(1.0)(ft.train_step(loss_fn, ft.optim.sgd(0.1))))
    """

    name: str = ""
    order: int = 0
    hook_order: Mapping[str, int] = MappingProxyType({})
    accessors: ClassVar[dict[str, Callable[[Any], Any]]] = {}
    params_fields: ClassVar[tuple[str, ...]] = ()
    shards_state: ClassVar[bool] = False
    needs: ClassVar[str | None] = None  # one of NEEDS; None: undeclared (refused where a sharded step cuts)
    micro_batches: int = 1

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for attr, hook in _NOT_HOOKS.items():
            if callable(cls.__dict__.get(attr)):
                where = f"; the hook is {hook!r}" if hook else ""
                raise TypeError(f"{cls.__qualname__}.{attr}: Transform has no hook {attr!r}{where}. "
                                f"The hooks are {', '.join(HOOKS)} (see functrain.core.transform.STAGE_HOOKS)")
        accessors = cls.__dict__.get("accessors")
        if accessors:
            if not isinstance(accessors, dict):
                raise TypeError(f"{cls.__qualname__}.accessors must be a dict {{attribute: fn(slot)}}; "
                                f"got {type(accessors).__name__}")
            if not isinstance(cls.__dict__.get("name", cls.name), str) or not cls.name:
                raise TypeError(f"{cls.__qualname__} declares accessors, so it needs a class-level slot name")
            for attr, fn in accessors.items():
                register_accessor(attr, cls.name, fn, owner=f"{cls.__module__}.{cls.__qualname__}")
        check_needs(cls.__dict__.get("needs"), cls.__qualname__)

    def init(self, params: Any, buffers: Any) -> Any:
        """The slot's initial state (``None``: the transform keeps no state and gets no slot)."""
        return None

    def post_init(self, state: TrainState, init: "InitContext") -> TrainState:
        """Adjust the complete initial state once, eagerly (data_parallel broadcasts it from rank 0)."""
        return state

    def init_parts(self, params: Any) -> Any:
        """What the optimizer's ``init`` and the ``init`` of transforms declaring :attr:`params_fields` build
        from on this process: ``params`` itself by default. A transform with :attr:`shards_state` returns this
        rank's parts of (rank 0's) params instead, so that the moments and the declared fields are made as
        this rank's shard, never whole; its ``post_init`` turns them into its shard trees. Called once per
        ``step.init``, before any ``init``, for the transforms with ``shards_state`` only."""
        return params

    def adapt_hook(self, transform: "Transform", hook: str, fn: Callable) -> Callable:
        """A ``shards_state`` transform's say on how ``transform``'s bound ``hook`` (``fn``) runs in its step:
        ``fn`` itself (the default), a wrapper that hands it what its :attr:`needs` declares, or a ``ValueError``
        naming the transform, the hook and what to declare. The step asks once per hook, when it is built."""
        return fn

    def rng_offset(self) -> int:
        """What this process adds to each step's random seed (data_parallel: its rank); 0 by default."""
        return 0

    def agree(self, value: "int | tuple[float, ...]") -> "int | tuple[float, ...]":
        """The least ``value`` held by any process this transform spans: a bounded host collective (the
        data-parallel transforms all-reduce a CPU int with MIN over their group); ``value`` by default (this
        process alone). ``value`` is an int, or a tuple of floats (then the least of each element, a tuple of the
        same length: one collective for several votes). Every process must call it at the same point, with the
        same kind and length of value. Background compilation asks it once per step, until it switches, whether
        every rank's compiled step is ready (and, the first time, the compile policy's numbers: one decision from
        the same numbers on every rank), so replicated ranks switch at the same step."""
        return value

    def wrap_loss(self, loss_fn: Callable, ctx: StepContext) -> Callable:
        """Stage ``loss``: return a replacement of ``loss_fn(params, buffers, batch) -> (objective, out)``."""
        return loss_fn

    def wrap_grad(self, grad_fn: Callable, ctx: StepContext) -> Callable:
        """Stage ``grad``: return a replacement of ``grad_fn(params, buffers, batch) -> (grads, out)``."""
        return grad_fn

    def reduce(self, ctx: StepContext) -> None:
        """Stage ``reduce``: combine the sum-form gradients and counts across processes."""

    def check(self, ctx: StepContext) -> None:
        """Stage ``check``: unscale, decide finiteness (:meth:`StepContext.skip_unless_finite`)."""

    def transform(self, ctx: StepContext) -> None:
        """Stage ``transform``: change the normalised gradients ``ctx.grads``."""

    def wrap_update(self, update_fn: Callable, ctx: StepContext) -> Callable:
        """Stage ``update``: return a replacement of ``update_fn(grads, opt_state, params) -> (params, opt_state)``.

        The default is the optimizer's own update. A transform that keeps the
        optimizer state sharded would slice ``grads``/``params`` to its shard, call
        ``update_fn`` on them and gather the new params; ``commit`` then keeps or
        drops the result as for any update.
        """
        return update_fn

    def commit(self, ctx: StepContext) -> None:
        """Stage ``commit``: after the built-in keep-or-drop select of params and optimizer state."""

    def after(self, ctx: StepContext) -> None:
        """Stage ``after``: read the committed params (``ema``)."""

    def __call__(self, step: "Step") -> "Step":
        """``step`` with this transform added: :meth:`functrain.core.step.Step.with_transform`."""
        try:  # the declared Step.with_transform (this module cannot import Step: step.py builds on it)
            with_transform = step.with_transform
        except AttributeError:
            raise TypeError(f"{type(self).__name__} transforms a functrain Step (from ft.train_step); "
                            f"got {type(step).__name__}") from None
        return with_transform(self)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"

