"""A stage probe: read what a transform sees at one stage of the step (the gradients, the params, the update),
as host copies after an eager call, or as outputs of a compiled one. Re-exported by :mod:`functrain.testing`."""
from __future__ import annotations

from typing import Any, Callable

import torch

from ..core import tree as T
from ..core.eager import tracing
from ..core.step import Step
from ..core.transform import STAGE_HOOKS, StepContext, Transform
from ..core.validate import check_choice, check_int, describe

__all__ = ["Probe", "probe", "PROBE_FIELDS"]

LAST = 10**6
"""The default ``order`` of a probe: after every built-in transform of its stage (innermost for a wrapping hook)."""

PROBE_FIELDS: dict[str, tuple[str, ...]] = {
    "loss": ("params", "buffers", "batch", "loss"),
    "grad": ("grads", "loss", "params", "batch"),
    "reduce": ("grads", "params", "opt_state", "step"),
    "check": ("grads", "params", "opt_state", "step"),
    "transform": ("grads", "params", "opt_state", "step"),
    "update": ("grads", "params", "opt_state", "step", "new_params", "new_opt_state", "updates"),
    "commit": ("grads", "params", "opt_state", "step"),
    "after": ("grads", "params", "opt_state", "step"),
}
"""What a probe records at each stage (a probe with ``fields=None`` records all of them):

* ``loss`` (the loss function as the loss stage hands it on): the ``params``, ``buffers`` and ``batch`` it is
  called with (cast by ``mixed_precision`` when the probe is inside it, as by default) and the ``loss`` (the
  differentiated objective) it returns; once per micro-batch.
* ``grad`` (the gradient function): the micro-batch's ``grads`` (sum form: before the division by the
  micro-batch count) and ``loss``, with the ``params`` and ``batch`` it got; once per call of the gradient function
  it wraps (once per micro-batch inside ``accumulate``, as by default).
* ``reduce``, ``check``, ``transform``, ``commit``, ``after``: the step's ``grads``, ``params`` and
  ``opt_state`` as they are at the probe's place in the stage, and the input state's ``step`` counter.
* ``update`` (the optimizer's update): the ``grads`` the optimizer receives, the ``params`` and ``opt_state``
  it starts from, what it returns (``new_params``, ``new_opt_state``) and ``updates = new_params - params``.
"""

_HOOK = {stage: hook for stage, hook in STAGE_HOOKS if hook}


def _host(tree: Any) -> Any:
    """A host copy of ``tree``'s tensors (detached, on the CPU, never sharing storage with the step's)."""
    return T.tree_map(lambda x: x.detach().to("cpu", copy=True) if torch.is_tensor(x) else x, tree)


def _detached(tree: Any) -> Any:
    """``tree``'s tensors as fresh outputs (a compiled step returns them; no view of a donated input)."""
    return T.tree_map(lambda x: x.detach().clone() if torch.is_tensor(x) else x, tree)


class Probe(Transform):
    """Records what a transform sees at one stage of the step, without changing the step's result.

    Make one with :func:`probe` (which picks the stage's hook). The probe keeps no slot (the probed step takes
    the unprobed step's states), changes nothing it reads, and its state and metrics are bitwise those of
    the step without it (unless ``outputs=True``, which adds one metric).

    Attributes:
        stage: the stage probed (one of :data:`functrain.core.step.STAGES` that has a hook).
        fields: the names recorded at each call (:data:`PROBE_FIELDS`).
        outputs: ``False``: host copies in :attr:`records` (eager calls only); ``True``: what it sees returned
            in ``metrics[probe.key]`` (eager and compiled alike).
        records: with ``outputs=False``, one ``{field: host copy}`` per hook call, oldest first.
    """

    stage: str = ""
    fields: tuple[str, ...] = ()
    outputs: bool = False
    needs = "elementwise"  # it copies what it sees: under a sharded step, from "reduce" on, this rank's flat shard

    def __init__(self, name: str, order: int, fields: tuple[str, ...], outputs: bool):
        self.name, self.order, self.fields, self.outputs = name, order, fields, outputs
        self.records: list[dict] = []

    @property
    def key(self) -> str:
        """The metric that holds what an ``outputs=True`` probe saw: ``"probe/<name>"``, a list of
        ``{field: tensors}`` (one per hook call in the step)."""
        return f"probe/{self.name}"

    @property
    def last(self) -> dict:
        """The latest record (``outputs=False``); raises if the probe saw nothing yet."""
        if not self.records:
            raise LookupError(f"{self!r} has recorded nothing: call the probed step first (eagerly: a compiled "
                              f"step records through outputs=True)")
        return self.records[-1]

    def clear(self) -> None:
        """Forget every record."""
        self.records.clear()

    def _record(self, ctx: StepContext, seen: dict[str, Callable[[], Any]]) -> None:
        values = {f: seen[f]() for f in self.fields}
        if self.outputs:
            ctx.metrics.setdefault(self.key, []).append(_detached(values))
            return
        if tracing():
            raise RuntimeError(f"{self!r} records host copies, which only an eager call can make; this step is "
                               f"being compiled. Probe a compiled step with outputs=True (what it sees comes back "
                               f"in metrics[{self.key!r}]), or call the probed step eagerly")
        self.records.append(_host(values))

    def _from_ctx(self, ctx: StepContext) -> None:
        self._record(ctx, {"grads": lambda: ctx.grads, "params": lambda: ctx.params,
                           "opt_state": lambda: ctx.opt_state, "step": lambda: ctx.state.step})

    def __repr__(self) -> str:
        return f"Probe({self.name!r}, stage={self.stage!r}, order={self.order})"


class _LossProbe(Probe):
    stage = "loss"

    def wrap_loss(self, loss_fn: Callable, ctx: StepContext) -> Callable:
        def seen_loss(params, buffers, batch):
            objective, out = loss_fn(params, buffers, batch)
            self._record(ctx, {"params": lambda: params, "buffers": lambda: buffers, "batch": lambda: batch,
                               "loss": lambda: objective})
            return objective, out
        return seen_loss


class _GradProbe(Probe):
    stage = "grad"

    def wrap_grad(self, grad_fn: Callable, ctx: StepContext) -> Callable:
        def seen_grad(params, buffers, batch):
            grads, out = grad_fn(params, buffers, batch)
            self._record(ctx, {"grads": lambda: grads, "loss": lambda: out["loss"], "params": lambda: params,
                               "batch": lambda: batch})
            return grads, out
        return seen_grad


class _ReduceProbe(Probe):
    stage = "reduce"

    def reduce(self, ctx: StepContext) -> None:
        self._from_ctx(ctx)


class _CheckProbe(Probe):
    stage = "check"

    def check(self, ctx: StepContext) -> None:
        self._from_ctx(ctx)


class _TransformProbe(Probe):
    stage = "transform"

    def transform(self, ctx: StepContext) -> None:
        self._from_ctx(ctx)


class _UpdateProbe(Probe):
    stage = "update"

    def wrap_update(self, update_fn: Callable, ctx: StepContext) -> Callable:
        def seen_update(grads, opt_state, params):
            new_params, new_opt_state = update_fn(grads, opt_state, params)
            self._record(ctx, {"grads": lambda: grads, "params": lambda: params, "opt_state": lambda: opt_state,
                               "step": lambda: ctx.state.step, "new_params": lambda: new_params,
                               "new_opt_state": lambda: new_opt_state,
                               "updates": lambda: T.tree_map(torch.sub, new_params, params)})
            return new_params, new_opt_state
        return seen_update


class _CommitProbe(Probe):
    stage = "commit"

    def commit(self, ctx: StepContext) -> None:
        self._from_ctx(ctx)


class _AfterProbe(Probe):
    stage = "after"

    def after(self, ctx: StepContext) -> None:
        self._from_ctx(ctx)


_PROBES: dict[str, type[Probe]] = {p.stage: p for p in (_LossProbe, _GradProbe, _ReduceProbe, _CheckProbe,
                                                         _TransformProbe, _UpdateProbe, _CommitProbe, _AfterProbe)}
assert set(_PROBES) == set(_HOOK), "a stage with a hook has no probe"


def probe(step: Step | None = None, stage: str = "transform", *, fields: Any = None, order: int = LAST,
          name: str | None = None, outputs: bool = False) -> Any:
    """A transform that records what a transform sees at ``stage``; with ``step``, that step probed.

    The probe is a :class:`functrain.Transform` implementing the stage's one hook
    (:data:`functrain.core.transform.STAGE_HOOKS`), at ``order`` among the stage's transforms (by default after
    all of them: in a wrapping stage, innermost). It keeps no slot and writes nothing, so the probed step's
    states and metrics are bitwise the step's own, and the probed step takes the step's states.

    Under ``ft.data_parallel(shard="optimizer" | "params")`` a hook from the ``reduce`` stage on sees this rank's
    flat shard of the gradients and params (``{dtype: 1-D tensor}``), and the probe records that (it declares
    ``needs = "elementwise"``); ``ft.gather_state`` gives the whole state after the step.

    Eagerly (``outputs=False``, the default) each hook call appends host copies (detached CPU tensors) of what it
    sees to ``probe.records`` (``probe.last`` is the latest). A compiled step cannot hand host copies out while
    it runs: tracing an ``outputs=False`` probe raises ``RuntimeError`` saying so. With ``outputs=True`` the
    probe returns what it sees instead, in ``metrics[probe.key]`` (``"probe/<name>"``: a list, one
    ``{field: tensors}`` per hook call), eagerly and compiled alike; the state is still unchanged, the
    metrics gain that one key.

    Args:
        step: the :class:`~functrain.Step` to probe, or ``None`` (default) to get the probe alone (apply it
            yourself: ``probe(step)``).
        stage: the stage to read (default ``"transform"``): ``"loss"``, ``"grad"``, ``"reduce"``, ``"check"``,
            ``"transform"``, ``"update"``, ``"commit"`` or ``"after"`` (``"normalise"`` has no hook: probe
            ``"check"`` at order ``-1`` to see the normalised gradients first).
        fields: the names to record, a subset of :data:`PROBE_FIELDS` ``[stage]`` (default ``None``: all).
        order: its place in the stage (default after every built-in; a lower ``order`` than your transform's
            reads what your transform gets, a higher one what it leaves).
        name: its slot name (default ``"probe_<stage>"``; two probes on one step need two names).
        outputs: see above (default ``False``).

    Returns:
        ``(probed step, probe)`` when ``step`` is given, else the probe.

    Raises:
        ValueError: an unknown stage or field, naming what is allowed (``BadValue``, also a ``TypeError``).

    Example:
        >>> import torch, functrain as ft, functrain.testing as ftt
        >>> step = ft.clip(1.0)(ft.train_step(lambda p, b, x: (p["w"] * x).sum(), ft.optim.sgd(0.1)))
        >>> probed, seen = ftt.probe(step, "update", fields=("grads", "updates"))
        >>> _ = probed(probed.init({"w": torch.zeros(2)}), torch.tensor([3.0, 4.0]))
        >>> seen.last["grads"]["w"], seen.last["updates"]["w"]    # clipped to norm 1, then times -lr
        (tensor([0.6000, 0.8000]), tensor([-0.0600, -0.0800]))
    """
    stages = tuple(_PROBES)
    if stage == "normalise":
        raise ValueError("probe: stage 'normalise' has no hook (it is built in); probe stage 'check' with "
                         "order=-1 to read the normalised gradients before any check")
    check_choice("probe: stage", stage, stages)
    allowed = PROBE_FIELDS[stage]
    if fields is None:
        fields = allowed
    elif isinstance(fields, str):
        fields = (fields,)
    fields = tuple(fields)
    for f in fields:
        if f not in allowed:
            raise ValueError(f"probe: stage {stage!r} records {', '.join(allowed)}; got field {f!r}")
    if not fields:
        raise ValueError(f"probe: fields is empty; stage {stage!r} records {', '.join(allowed)}")
    check_int("probe: order", order)
    if name is None:
        name = f"probe_{stage}"
    elif not isinstance(name, str) or not name:
        raise ValueError(f"probe: name must be a non-empty str; got {describe(name)}")
    if not isinstance(outputs, bool):
        raise ValueError(f"probe: outputs must be True or False; got {describe(outputs)}")
    p = _PROBES[stage](name, order, fields, outputs)
    if step is None:
        return p
    if not isinstance(step, Step):
        raise TypeError(f"probe: step must be a functrain Step (from ft.train_step) or None; got {describe(step)}")
    return p(step), p
