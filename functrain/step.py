"""The training step: a pipeline of stages over one state pytree, and the transform protocol.

A step is ``step(state, batch) -> (new_state, metrics)``. It runs these stages,
in this order, whatever order the transforms were wrapped in::

    loss       the loss of one micro-batch            (mixed_precision casts and scales it)
    grad       loss -> gradients                      (accumulate splits the batch and sums)
    reduce     gradients across processes             (data_parallel)
    normalise  ÷ micro-batches, or ÷ total num_items  (built in)
    check      unscale, finite?                       (mixed_precision, skip_nonfinite)
    transform  change the gradients                   (clip, clip_value)
    update     the optimizer                          (built in)
    commit     keep or drop the update                (built in select; loss-scale growth/backoff)
    after      after the update                       (ema)

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

from typing import Any, Callable, Iterable

import optree
import torch
from torch.func import grad_and_value

from . import tree as T
from .layout import SLOT, ShardState  # [sharded state] check in Step.apply
from .state import TrainState

__all__ = ["Step", "Transform", "StepContext", "train_step", "STAGES"]

STAGES = ("loss", "grad", "reduce", "normalise", "check", "transform", "update", "commit", "after")
_HOOKS = ("wrap_loss", "wrap_grad", "reduce", "check", "transform", "commit", "after")

LossFn = Callable[[Any, Any, Any], Any]


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


class Transform:
    """Base class of step transforms: ``Step -> Step`` features that own one state slot.

    A transform has a ``name`` (its slot in ``state.slots``; a step holds at most
    one transform of each name), an ``init(params, buffers)`` that returns its slot
    state (``None`` for none), optionally a ``post_init(state) -> state`` run once on
    the complete initial state, and overrides any of these hooks, each tied to a
    stage (see :data:`STAGES`); ``order`` sorts transforms within a stage (ties by
    name), so the wrapping order never matters:

    * ``wrap_loss(loss_fn, ctx) -> loss_fn`` (stage ``loss``): ``loss_fn(params,
      buffers, batch) -> (objective, out)``, differentiated w.r.t. ``params``.
    * ``wrap_grad(grad_fn, ctx) -> grad_fn`` (stage ``grad``): ``grad_fn(params,
      buffers, batch) -> (grads, out)``; ``out`` holds ``loss``, ``denom``, ``aux``,
      ``weight`` and ``buffers``, all summable.
    * ``reduce(ctx)``, ``check(ctx)``, ``transform(ctx)``, ``commit(ctx)``,
      ``after(ctx)``: read and write the :class:`StepContext`.

    Applying a transform to a step returns a new step; the original is unchanged.

    Example, a transform that adds Gaussian noise to the gradients, with its own
    generator seed in the state::

        import torch, functrain as ft

        class GradNoise(ft.Transform):
            name = "grad_noise"
            order = 50                      # after clip (10) in the "transform" stage

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

    def init(self, params: Any, buffers: Any) -> Any:
        """The slot's initial state (``None``: the transform keeps no state and gets no slot)."""
        return None

    def post_init(self, state: TrainState) -> TrainState:
        """Adjust the complete initial state once, eagerly (data_parallel broadcasts it from rank 0)."""
        return state

    def wrap_loss(self, loss_fn: Callable, ctx: StepContext) -> Callable:
        return loss_fn

    def wrap_grad(self, grad_fn: Callable, ctx: StepContext) -> Callable:
        return grad_fn

    def reduce(self, ctx: StepContext) -> None:
        pass

    def check(self, ctx: StepContext) -> None:
        pass

    def transform(self, ctx: StepContext) -> None:
        pass

    def commit(self, ctx: StepContext) -> None:
        pass

    def after(self, ctx: StepContext) -> None:
        pass

    def __call__(self, step: "Step") -> "Step":
        if not isinstance(step, Step):
            raise TypeError(f"{type(self).__name__} transforms a functrain Step (from ft.train_step); "
                            f"got {type(step).__name__}")
        return step.with_transform(self)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


def _uses(t: Transform, hook: str) -> bool:
    return getattr(type(t), hook) is not getattr(Transform, hook)


class Step:
    """A pure training step ``step(state, batch) -> (new_state, metrics)``.

    Build one with :func:`train_step`, wrap it in transforms, compile it with
    :func:`functrain.compile`. ``step.init(params, buffers)`` makes the initial
    :class:`TrainState`. Calling the step never changes its inputs.
    """

    def __init__(self, loss_fn: LossFn, optimizer: Any, transforms: Iterable[Transform] = ()):
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.transforms: tuple[Transform, ...] = tuple(transforms)
        key = lambda t: (t.order, t.name)  # noqa: E731 - the order within a stage never depends on wrapping
        self._hooks = {h: sorted((t for t in self.transforms if _uses(t, h)), key=key) for h in _HOOKS}

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

    def transform_named(self, name: str) -> Transform | None:
        """The transform with this slot name, or ``None``."""
        return next((t for t in self.transforms if t.name == name), None)

    def __repr__(self) -> str:
        names = ", ".join(t.name for t in self.transforms)
        return f"Step({getattr(self.loss_fn, '__name__', 'loss_fn')}, transforms=[{names}])"

    # -- state ------------------------------------------------------------------------------
    def init(self, params: Any, buffers: Any = None, *, seed: int | None = 0) -> TrainState:
        """The initial state for ``params`` (and ``buffers``).

        ``seed`` seeds the random-number generator state carried in the state
        (dropout draws from it, so a step re-run from the same state draws the
        same numbers); ``seed=None`` carries none and uses torch's global RNG.
        """
        _check_params(params)
        buffers = {} if buffers is None else buffers
        leaves = T.tree_leaves(params)
        device = leaves[0].device if leaves else torch.device("cpu")
        slots = {t.name: t.init(params, buffers) for t in self.transforms}
        slots = {name: slot for name, slot in slots.items() if slot is not None}  # stateless: no slot
        state = TrainState(
            params=params,
            buffers=buffers,
            opt_state=self.optimizer.init(params),
            step=torch.zeros((), dtype=torch.int64, device=device),
            rng=None if seed is None else _rng_init(seed, device),
            slots=slots,
        )
        for t in sorted(self.transforms, key=lambda t: (t.order, t.name)):
            state = t.post_init(state)
        return state

    # -- running ----------------------------------------------------------------------------
    def __call__(self, state: TrainState, batch: Any) -> tuple[TrainState, dict]:
        check_inputs(state, batch)
        return with_rng(self.apply, state, batch, self.rng_rank())

    def rng_rank(self) -> int:
        """The offset this process adds to each step's seed: its rank under data parallelism, else 0."""
        for t in self.transforms:
            rank = getattr(t, "rng_rank", None)
            if rank is not None:
                return rank()
        return 0

    def apply(self, state: TrainState, batch: Any) -> tuple[TrainState, dict]:
        """The pure step without the host-side RNG handling (what :func:`functrain.compile` traces)."""
        # [sharded state] only a data_parallel(shard=...) step can run a sharded state (functrain.layout)
        owner = self.transform_named(SLOT)
        if isinstance(state.slots.get(SLOT), ShardState) and not getattr(owner, "shards_state", False):
            raise ValueError(f"this state is sharded over ranks (it has a {SLOT!r} ShardState slot) but this step "
                             f"{self!r} is not a sharded data_parallel step: use the step that made it, gather it "
                             f"(ft.gather_state) or load its checkpoint into this step's state (ft.load)")
        ctx = StepContext(state, batch)
        hooks = self._hooks

        loss_fn: Callable = self._base_loss
        for t in reversed(hooks["wrap_loss"]):
            loss_fn = t.wrap_loss(loss_fn, ctx)

        def base_grad(params, buffers, batch):
            if torch.compiler.is_compiling():  # traced: torch.func composes with Dynamo
                grads, (_, out) = grad_and_value(_tensor_aux(loss_fn), has_aux=True)(params, buffers, batch)
                return grads, {"denom": 1.0, "weight": 1.0, **out}
            return _autograd_grad(loss_fn, params, buffers, batch)

        grad_fn: Callable = base_grad
        for t in reversed(hooks["wrap_grad"]):
            grad_fn = t.wrap_grad(grad_fn, ctx)
        ctx.grads, out = grad_fn(ctx.params, ctx.buffers, batch)
        ctx.loss, ctx.denom, ctx.aux, ctx.weight = out["loss"], out["denom"], out["aux"], out["weight"]
        ctx.buffers = out["buffers"]

        for t in hooks["reduce"]:
            t.reduce(ctx)

        # normalise: one division by the global denominator (micro-batches or items)
        if not (isinstance(ctx.denom, float) and ctx.denom == 1.0):
            ctx.grads = T.tree_scale(ctx.grads, 1.0 / ctx.denom)
        ctx.metrics["loss"] = ctx.loss / ctx.denom
        for k, v in ctx.aux.items():
            ctx.metrics[k] = v / ctx.weight
        if "num_items" in out:  # the loss is a sum over items: report the global count
            ctx.metrics["num_items"] = ctx.denom

        for t in hooks["check"]:
            t.check(ctx)
        for t in hooks["transform"]:
            t.transform(ctx)

        lr = self.optimizer.learning_rate(ctx.opt_state)
        ctx.metrics["lr"] = torch.as_tensor(lr, dtype=torch.float64)
        old_params, old_opt = ctx.params, ctx.opt_state
        ctx.params, ctx.opt_state = self.optimizer.update(ctx.grads, ctx.opt_state, ctx.params)

        if ctx.apply is not None:
            ctx.params = T.tree_select(ctx.apply, ctx.params, old_params)
            ctx.opt_state = T.tree_select(ctx.apply, ctx.opt_state, old_opt)
        for t in hooks["commit"]:
            t.commit(ctx)
        for t in hooks["after"]:
            t.after(ctx)

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
        # The forward pass may update buffers in place (BatchNorm statistics):
        # give it copies so that the input state is never written.
        buffers = T.tree_map(torch.clone, buffers)
        result = self.loss_fn(params, buffers, batch)
        loss, aux = result if isinstance(result, tuple) else (result, {})
        if isinstance(result, tuple) and len(result) != 2:
            raise TypeError(f"loss_fn must return a scalar loss or (loss, aux_dict); got a tuple of {len(result)}")
        _check_loss(loss)
        if not isinstance(aux, dict):
            raise TypeError(f"loss_fn's aux must be a dict of tensors (metrics); got {type(aux).__name__}")
        aux = dict(aux)
        num_items = aux.pop("num_items", None)
        # Denominators known before the step runs stay Python numbers (a mean loss counts 1 per
        # micro-batch): the graph then divides by a constant, or not at all.
        if num_items is None:
            denom: Any = 1.0
        else:
            denom = torch.as_tensor(num_items, device=loss.device).to(torch.float32).detach()
        aux = {k: torch.as_tensor(v).detach().to(torch.float32) for k, v in aux.items()}
        out = {
            "loss": loss.detach().to(torch.float32),
            "denom": denom,
            "aux": aux,
            "weight": 1.0,
            "buffers": buffers,
        }
        if num_items is not None:
            out["num_items"] = out["denom"]
        return loss, out


def _tensor_aux(loss_fn: Callable) -> Callable:
    """``loss_fn`` with the per-micro-batch constants (``denom``/``weight`` of 1.0) left out of its
    aux output: torch.func transforms return tensors only; ``base_grad`` puts them back."""

    def fn(params, buffers, batch):
        objective, out = loss_fn(params, buffers, batch)
        return objective, {k: v for k, v in out.items() if not isinstance(v, float)}

    return fn


def _autograd_grad(loss_fn: Callable, params: Any, buffers: Any, batch: Any) -> tuple[Any, dict]:
    """The eager path of the grad stage: ``torch.autograd.grad``, the same math as
    ``torch.func.grad_and_value`` at a fraction of its per-call Python cost."""
    leaves, spec = optree.tree_flatten(params)
    live = [p.detach().requires_grad_(True) for p in leaves]
    with torch.enable_grad():
        objective, out = loss_fn(optree.tree_unflatten(spec, live), buffers, batch)
        grads = torch.autograd.grad(objective, live, allow_unused=True)
    grads = [torch.zeros_like(p) if g is None else g for p, g in zip(leaves, grads)]
    out = optree.tree_map(lambda t: t.detach() if torch.is_tensor(t) else t, out)
    return optree.tree_unflatten(spec, grads), out


def train_step(loss_fn: LossFn, optimizer: Any) -> Step:
    """A pure training step from a loss function and a functional optimizer.

    ``loss_fn(params, buffers, batch)`` returns a scalar loss, or ``(loss, aux)``
    where ``aux`` is a dict of tensors that flows into the metrics. If
    ``aux["num_items"]`` is present the loss is taken as a *sum* over that many
    items, and the gradient is normalised by the total item count (over
    micro-batches, and processes with data parallelism).

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
    for attr in ("init", "update", "learning_rate"):
        if not callable(getattr(optimizer, attr, None)):
            raise TypeError(f"optimizer must be a functrain optimizer with init/update/learning_rate "
                            f"(e.g. ft.optim.adamw(1e-3)); got {type(optimizer).__name__} without {attr!r}")
    return Step(loss_fn, optimizer)


# -- checks ---------------------------------------------------------------------------------
def _check_loss(loss: Any) -> None:
    if not torch.is_tensor(loss):
        raise TypeError(f"loss_fn must return a scalar tensor loss (or (loss, aux)); got {type(loss).__name__}")
    if loss.dim() != 0:
        raise ValueError(f"loss_fn must return a scalar loss (shape ()); got shape {tuple(loss.shape)}. "
                         f"Reduce it, e.g. with .mean() or .sum() (with aux['num_items'])")
    if not loss.is_floating_point():
        raise TypeError(f"loss_fn must return a floating-point loss; got dtype {loss.dtype}")


def _check_params(params: Any) -> None:
    leaves = optree.tree_leaves(params)
    if not leaves:
        raise ValueError("params is empty: there is nothing to train")
    for path, leaf in zip(optree.tree_paths(params), leaves):
        name = "/".join(str(p) for p in path) or "<root>"
        if not torch.is_tensor(leaf):
            raise TypeError(f"params must be a pytree of floating-point tensors; {name!r} is {type(leaf).__name__}")
        if not leaf.is_floating_point():
            raise TypeError(f"params must be floating-point tensors; {name!r} has dtype {leaf.dtype}. "
                            f"Move integer tensors to buffers")


def check_inputs(state: Any, batch: Any) -> None:
    """Host-side checks of a step's inputs (cheap: metadata only, no sync)."""
    if not isinstance(state, TrainState):
        raise TypeError(f"the step takes a functrain TrainState (from step.init); got {type(state).__name__}")
    if state.step.numel() == 0:
        raise RuntimeError("this TrainState was donated to an earlier compiled step (donate=True) and its "
                           "buffers now belong to the state that step returned; use that one")
    leaves = optree.tree_leaves(batch)
    for leaf in leaves:
        if not torch.is_tensor(leaf) and not isinstance(leaf, (int, float, bool)):
            bad = [("/".join(map(str, p)) or "<root>", type(x).__name__)
                   for p, x in zip(optree.tree_paths(batch), leaves)
                   if not torch.is_tensor(x) and not isinstance(x, (int, float, bool))]
            raise TypeError(f"the batch must be a pytree (tuple/list/dict) of tensors; leaf {bad[0][0]!r} is "
                            f"{bad[0][1]}. Convert it to a tensor (ft.run converts numpy arrays)")


# -- randomness -----------------------------------------------------------------------------
def _rng_init(seed: int, device: torch.device) -> dict:
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**63:
        raise TypeError(f"seed must be an int in [0, 2**63) or None; got {seed!r}")
    return {"key": torch.tensor([seed, 0], dtype=torch.int64)}


def _mix64(x: int) -> int:
    """splitmix64: a well-mixed 64-bit value from a counter."""
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


def _devices(state: TrainState) -> list[str]:
    device = state.step.device
    return ["cpu"] if device.type != "cuda" else ["cpu", str(device)]


def _get_rng(dev: str) -> torch.Tensor:
    return torch.get_rng_state() if dev == "cpu" else torch.cuda.get_rng_state(dev)


def _set_rng(dev: str, value: torch.Tensor) -> None:
    if dev == "cpu":
        torch.set_rng_state(value)
    else:
        torch.cuda.set_rng_state(value, dev)


def _seed_globals(devices: list[str], seed: int) -> None:
    for dev in devices:
        if dev == "cpu":
            torch.default_generator.manual_seed(seed)
        else:
            torch.cuda.default_generators[torch.device(dev).index or 0].manual_seed(seed)


def with_rng(fn: Callable, state: TrainState, batch: Any, rank: int = 0) -> tuple[TrainState, dict]:
    """Run ``fn(state, batch)`` drawing random numbers from ``state.rng`` (host side).

    ``state.rng["key"]`` is a host int64 tensor ``[seed, counter]``, the same on
    every process. Each step hashes it into a step seed (splitmix64), advances
    the counter (into the new state), seeds the global generators with
    ``step seed + rank`` (so data-parallel ranks draw different dropout masks,
    yet the state stays replicated and a checkpoint holds everything), runs, and
    restores the caller's generators. All of it is host work on host memory:
    no device sync, no torch op that reads a value.
    """
    rng = state.rng
    if rng is None:
        return fn(state, batch)
    seed, counter = (int(v) for v in rng["key"].numpy())  # a host tensor, read without a torch op
    step_seed = _mix64(_mix64(seed) ^ counter) >> 2  # < 2**62, so seed + rank stays a valid seed
    devices = _devices(state)
    saved = {dev: _get_rng(dev) for dev in devices}
    try:
        _seed_globals(devices, step_seed + rank)
        new_state, metrics = fn(state._replace(rng=None), batch)
    finally:
        for dev, value in saved.items():
            _set_rng(dev, value)
    return new_state._replace(rng={"key": torch.tensor([seed, counter + 1], dtype=torch.int64)}), metrics
