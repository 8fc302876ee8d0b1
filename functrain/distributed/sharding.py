"""Sharded data parallelism inside the pure step (ZeRO-2 / ZeRO-3), and :func:`gather_state`.

``ft.data_parallel(shard="optimizer")`` keeps the params whole on every rank and
shards the optimizer state and the EMA; ``shard="params"`` shards the params at
rest too. The layout is :class:`functrain.core.flat.FlatLayout`: one flat buffer per
dtype, padded to a multiple of the world size, rank ``r`` owning slice ``r``.

How a sharded step runs (the stages of :mod:`functrain.core.step`; this transform has
order 1000, so it acts last within each stage)::

    grad       shard="params": all-gather the param shards (functional all-gather), unflatten to the
               user's {name: tensor}, differentiate w.r.t. that transient copy (with blocks=model the
               loss gathers instead, block by block, and the gradient is of the shard itself, already
               summed over the ranks: see functrain.distributed.blockwise)
    reduce     the loss, denominators and aux metrics are all-reduced (as by data_parallel()); the
               gradient is laid into its padded flat buffers (FlatLayout.flatten) and each buffer is
               reduce-scattered (one functional reduce-scatter per dtype, sum): from here on ctx.grads is
               this rank's summed shard {dtype: 1-D tensor}, ctx.params is cut alike (shard="optimizer";
               with "params" it already is one), and ctx.shard_group is the group ctx.global_sum all-reduces over
    normalise  ÷ the global denominator, on the shard
    check      fp16's unscale on the shard; the finite check (StepContext.skip_unless_finite, used by
               fp16 loss scaling and skip_nonfinite) sums every rank's "my shard is not finite" flag
               through ctx.global_sum, so an overflow in one rank's shard skips the update on every rank
    transform  clip's global norm is sqrt(global_sum(|local shard|^2)) (the zero padding adds nothing),
               the same on every rank; clip_value is elementwise
               (a transform declaring needs="leaves" gets the whole named gradient and params in its check and
               transform hooks: gathered before, cut back after: see adapt_hook)
    update     the optimizer on the shard (an elementwise optimizer: sgd, adam, adamw)
    commit     the keep-or-drop select on the shard
    after      the EMA blends its shard; then (shard="optimizer") one all-gather rebuilds the whole params

So every transform keeps its law (the sharded step's state, gathered, equals the
one-process step on the whole batch), and each element of the new params is
computed by one rank and copied by the all-gather: the params are bitwise
identical on every rank. A transform of one's own that reads a global property
of the gradient (a norm, a count of non-finite values) sums its local value with
``ctx.global_sum(x)`` (``x`` itself when the gradient is whole); one that reads
``ctx.params`` next to ``ctx.grads`` gets matching shard trees. What each hook
gets is decided when the step is built, from what the transform declares
(``Transform.needs``, :meth:`ShardedDataParallel.adapt_hook`): ``"elementwise"``
and ``"global"`` hooks run on the shard; a ``"leaves"`` transform's ``check`` and
``transform`` hooks run on the whole named leaves (one all-gather of the
gradient and one of the params per hook and step, the result cut back), its
other hooks that would see a shard are refused; and a transform that declares
nothing is refused by name for any hook that would see a shard. All collectives
are functional (in the compiled graph, no host sync); gloo implements the
reduce-scatter, so every backend runs the same collectives (except the
all-gather, which gloo runs as a sum: see ``_all_gather``; gloo's cost below).

At init no rank builds the whole optimizer state or EMA: ``init_parts`` (the
protocol's hook for a state-sharding transform) sends each rank its shard of
rank 0's params (rank 0 cuts and sends one shard at a time), and the optimizer's
``init`` and the ``init`` of each transform declaring ``params_fields`` run on this
rank's *parts* (:meth:`FlatLayout.parts`: a :class:`~functrain.FlatParams` of the
leaves' elements in this rank's slice, views of that shard): their zeros and copies
are this rank's shard, flat, and ``post_init`` pads them into shard trees (no
communication); the rest of the state is broadcast. So those ``init`` functions
must map over the params they are given, elementwise (the elementwise optimizers
and ``ft.ema`` do); a declared field that is not parts-shaped is refused by name.
The params themselves are whole on every rank until ``step.init`` returns (the
caller made them); with ``shard="params"`` the state holds only the shard. A model
built on the meta device (``ft.init_empty``) is never whole: with ``shard="params"``
each rank makes its own shard, replaying the module's ``reset_parameters`` one module
at a time (:mod:`functrain.distributed.meta_init`); the other modes refuse it.

On gloo the reduce-scatter is gloo's own, which allocates a whole-size buffer
inside (measured: +358 MiB of peak for a 190 MiB input, vs +262 MiB for an
all-reduce of it) and takes about 1.3x the all-reduce's time at 100 MB on 2
ranks: on CPU it saves no transient memory; on NCCL it is the native collective.
"""
from __future__ import annotations

import copy
from typing import Any, Callable

import optree
import torch
import torch.distributed as dist

from ..core.empty import empty_source
from ..core.flat import SLOT, FlatLayout, ShardState, find_shard_trees
from ..core.hyper import to_device as hyper_to_device
from ..core.state import TrainState
from ..core.step import Step
from ..core.transform import InitContext, StepContext, Transform, check_needs
from .meta_init import make_shard, with_made

__all__ = ["ShardedDataParallel", "gather_state"]

MODES = ("optimizer", "params")

# The hooks that see this rank's shard (of the gradients, the params or both) under each mode; wrap_loss never
# does (its loss function is handed the whole named params; with blocks=, each block's inside the block), nor,
# with shard="optimizer", wrap_grad (whole params in, whole gradients out)
SEES_SHARD = {"optimizer": ("reduce", "check", "transform", "wrap_update", "commit", "after"),
              "params": ("wrap_grad", "reduce", "check", "transform", "wrap_update", "commit", "after")}
WHOLE_LEAVES = ("check", "transform")  # where a needs="leaves" hook is handed the gathered whole leaves
_DECLARE = ('needs = "elementwise" (per-element ops: any cut of the flat buffer gives the same result), '
            'needs = "global" (also reductions over the whole gradient, each summed over the ranks with '
            'ctx.global_sum(x)) or needs = "leaves" (whole named leaves with their shapes: the sharded step gathers '
            'them for the check and transform hooks, one all-gather of the gradient and one of the params per hook '
            'and step). A hook that draws random numbers for them (gradient noise) keeps no one-process result under '
            'any of these: each rank draws its own (seed + rank)')


def _world_of(group: Any) -> int:
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def _reduce_scatter(flat: torch.Tensor, group: Any) -> torch.Tensor:
    """This rank's slice of ``flat`` summed over the ranks (``flat``'s length a multiple of the world size):
    a functional reduce-scatter (gloo implements it too, so no backend needs a fallback)."""
    from torch.distributed import _functional_collectives as funcol

    if flat.numel() == 0:  # only empty leaves of this dtype: nothing to send
        return flat
    scatter = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor  # (renamed in 2.1x)
    return funcol.wait_tensor(scatter(flat, "sum", 0, group))


def _all_gather(shard: torch.Tensor, group: Any, world: int) -> torch.Tensor:
    """The shards of every rank, concatenated in rank order (functional collectives: traceable)."""
    if world == 1:
        return shard
    from torch.distributed import _functional_collectives as funcol

    if dist.get_backend(group) == "gloo":
        # gloo's allgather is several times slower than its allreduce (2 ranks, 400 MB: 2.3 s vs 0.36 s), so
        # sum a buffer holding this rank's shard and -0.0 elsewhere: x + (-0.0) == x for every float x
        # (+0.0 and -0.0 included), so the sum is the exact concatenation, in any reduction order
        rank, size = dist.get_rank(group), shard.numel()
        pad = lambda n: torch.full((n,), -0.0, dtype=shard.dtype, device=shard.device)  # noqa: E731
        buf = torch.cat([pad(rank * size), shard.reshape(-1), pad((world - 1 - rank) * size)])
        return funcol.wait_tensor(funcol.all_reduce(buf, "sum", group))
    gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor  # (renamed in torch 2.1x)
    return funcol.wait_tensor(gather(shard.contiguous(), 0, group))


class _Cut:
    """A shard tree already cut at init (marks it so the broadcast of the slots' other leaves skips it)."""

    __slots__ = ("shard",)

    def __init__(self, shard: dict):
        self.shard = shard


class ShardedDataParallel(Transform):
    """``data_parallel(shard="optimizer" | "params")``: data parallelism with the state sharded over the ranks.

    Law: N ranks, each stepping on its 1/N of a batch, reach a state whose
    :func:`gather_state` equals the one-process step on the whole batch (and
    the params are bitwise identical on every rank), with every other transform
    in the step keeping its own law (clip's norm and the finite checks are
    summed over the shards; a ``needs="leaves"`` transform's check and transform
    hooks get the whole leaves) or refused by name when the step is built (a
    transform that declares no ``needs``: :meth:`adapt_hook`). The gradient is
    reduce-scattered, so from the ``reduce`` stage on each rank holds, and updates, 1/N of it. At rest rank
    r holds 1/N of the optimizer moments and of the EMA (``"optimizer"``), and
    of the params too (``"params"``); buffers, counters and the loss scale stay
    replicated.

    ``step.init(params, buffers)`` broadcasts rank 0's initial state (as
    ``data_parallel()``), computes the layout and cuts the state; the step needs
    it to have run in this process (or ``ft.load(path, step.init(...))``). The
    optimizer must be elementwise (``ft.optim.sgd``/``adam``/``adamw`` are): it
    runs on a flat slice that crosses parameter boundaries.
    """

    name = SLOT
    shards_state = True  # Step.apply runs a sharded state only in a step with such a transform
    needs = "global"  # it reduces over the ranks itself
    order = 1000  # last in each stage: reduce-scatter after any other reduction, gather after the EMA

    def __init__(self, replicated: Transform, shard: str, blocks: torch.nn.Module | None = None):
        self.replicated = replicated  # data_parallel(): the reduction, the broadcast at init, the rank offset
        self.shard = shard
        self.blocks = blocks  # shard="params": the model whose ft.remat-marked blocks are gathered one at a time
        if blocks is not None:  # the gather wraps the loss outermost: mixed precision casts what it gathers
            self.hook_order = {"wrap_loss": -1000}
        self._plan: Any = None  # (the layout, the marked blocks) -> its blockwise.BlockPlan
        self._lenders: list = []  # this call's lenders (one per micro-batch), until the reduce stage
        self.layout: FlatLayout | None = None
        self._params_shard: dict | None = None  # init_parts' shard of rank 0's params, until post_init
        self._made: dict | None = None  # a meta-built model's buffers made by init_parts, until post_init

    def __call__(self, step: Any) -> Any:
        # per_param: a declared, optional field of the optimizer protocol (functrain.optim.Optimizer's)
        if isinstance(step, Step) and getattr(step.optimizer, "per_param", False):
            raise ValueError(f"data_parallel(shard={self.shard!r}) updates flat per-dtype shards, which have no "
                             f"parameter names: this optimizer's weight_decay_mask / lr_multipliers groups cannot "
                             f"apply there; use shard='none' or an optimizer without per-parameter groups")
        t = copy.copy(self)  # one layout per step: the same transform object may wrap several steps
        t.layout, t._params_shard, t._plan, t._lenders, t._made = None, None, None, [], None
        return Transform.__call__(t, step)

    @property
    def group(self) -> Any:
        return self.replicated.group

    def _group(self) -> Any:
        return self.group if self.group is not None else dist.group.WORLD

    def _world(self) -> int:
        return _world_of(self.group)

    def rng_offset(self) -> int:
        """The replicated data_parallel's per-rank seed offset (each rank draws its own dropout)."""
        return self.replicated.rng_offset()

    def agree(self, value: "int | tuple[float, ...]") -> "int | tuple[float, ...]":
        """The replicated data_parallel's :meth:`~functrain.Transform.agree` (a MIN over the group's ranks)."""
        return self.replicated.agree(value)

    # -- the other transforms' hooks: as they are, on whole leaves, or refused by name ----------------------
    def adapt_hook(self, transform: Transform, hook: str, fn: Callable) -> Callable:
        """``transform``'s bound ``hook`` as it runs in this sharded step, from its declared ``needs``: ``fn``
        where the hook sees no shard in this mode or the transform works on shards ("elementwise", "global");
        on the whole named leaves for a "leaves" check or transform hook; else a ``ValueError`` naming the
        transform, the hook, this mode and what to declare or do. Called when the step is built: before step 1."""
        needs = transform.needs
        check_needs(needs, type(transform).__qualname__)
        if hook not in SEES_SHARD[self.shard] or needs in ("elementwise", "global"):
            return fn
        who = f"{transform!r} (class {type(transform).__qualname__})"
        sees = (f"under {self!r} the {hook} hook sees this rank's flat shard of the gradients and params "
                f"({{dtype: 1-D tensor}}: no leaf names, no shapes)")
        if needs is None:
            raise ValueError(f"{who} implements {hook} and declares no `needs`; {sees}, so the step cannot tell "
                             f"whether it keeps its law there. Declare on the class what it needs: {_DECLARE}. Or "
                             f"use data_parallel(shard='none'), which hands every hook whole leaves "
                             f"(docs/transforms.md, \"What a transform needs\")")
        if hook not in WHOLE_LEAVES:
            raise ValueError(f"{who} declares needs = \"leaves\" and implements {hook}; {sees}, and the sharded "
                             f"step gathers whole leaves only for the check and transform hooks. Do the per-leaf "
                             f"work in a transform hook (on ctx.grads, before the optimizer), or use "
                             f"data_parallel(shard='none') (docs/transforms.md, \"What a transform needs\")")
        if transform.params_fields:
            raise ValueError(f"{who} declares needs = \"leaves\" and params_fields {tuple(transform.params_fields)!r}: "
                             f"under {self!r} its {hook} hook gets the whole leaves but its slot holds this rank's "
                             f"1/N of those fields. Drop params_fields (the fields then stay whole, the same on "
                             f"every rank) or use data_parallel(shard='none')")
        return self._on_whole_leaves(fn)

    def _on_whole_leaves(self, fn: Callable) -> Callable:
        def on_whole_leaves(ctx: StepContext) -> None:
            # the whole named gradient and params on every rank (the gathers are exact, so every rank computes
            # the same), the hook on them, then this rank's shard of what it made
            grads, params, shard_group = ctx.grads, ctx.params, ctx.shard_group
            whole = self._gather(params, ctx)
            ctx.grads, ctx.params, ctx.shard_group = self._gather(grads, ctx), whole, None
            fn(ctx)
            ctx.grads = self.layout.shard_of(ctx.grads)
            ctx.params = params if ctx.params is whole else self.layout.shard_of(ctx.params)
            ctx.shard_group = shard_group

        return on_whole_leaves

    # -- init: this rank's parts, then its shards ---------------------------------------------------------
    def init_parts(self, params: Any) -> Any:
        # Rank 0's params, cut: each rank receives only its shard of them (rank 0 sends one shard at a time),
        # and the optimizer and the params_fields transforms initialise from its parts (FlatLayout.parts:
        # views of that shard), so the moments, an EMA or slow weights are made as shards on every rank
        rep = self.replicated
        rep.ensure_group()
        world = self._world()
        rank = dist.get_rank(self._group()) if world > 1 else 0
        self.layout = layout = FlatLayout.from_params(params, world, rank)
        source = empty_source(params)
        if source is None:
            self._params_shard = self._scatter(layout, params)
        else:  # built on the meta device: this rank makes its shard itself, with the module's own initialisers
            if self.shard != "params":
                raise ValueError(f"{self!r}: the params are on the meta device (ft.init_empty), but "
                                 f"shard={self.shard!r} holds the whole params on every rank; use "
                                 f"shard='params', which makes only each rank's shard, or build the model normally")
            self._params_shard, self._made = make_shard(layout, source, self.group)
        return layout.parts(self._params_shard)

    def post_init(self, state: TrainState, init: InitContext) -> TrainState:
        # The parts-shaped trees (the optimizer's moments, the slots' declared params_fields) become this rank's
        # shard trees where they are (no communication: each rank made its own from rank 0's params); every
        # other leaf is broadcast from rank 0 as by data_parallel() (the params too, with shard="optimizer")
        rep, layout, params_shard = self.replicated, self.layout, self._params_shard
        if layout is None or params_shard is None:
            raise RuntimeError(f"{self!r}.post_init runs inside step.init, after init_parts")
        self._params_shard = None  # shard="params": the state holds it; "optimizer": freed before the broadcast
        if self._made is not None:  # built on the meta device: the buffers and the counter made real here
            state = self._made_real(state, params_shard.get(layout.keys[0]).device)
        if self.shard != "params":
            params_shard = None
        parts = layout.is_parts
        cut = layout.from_parts
        nodes, spec = optree.tree_flatten(state.opt_state, is_leaf=parts)
        opt_state = optree.tree_unflatten(spec, [cut(n) if parts(n) else rep.broadcast(n) for n in nodes])
        marked = init.map_params_like(state.slots, lambda tree: _Cut(self._declared(tree)))
        slots = optree.tree_map(lambda x: x.shard if isinstance(x, _Cut) else rep.broadcast(x), marked,
                                is_leaf=lambda x: isinstance(x, _Cut))
        slots[SLOT] = layout.slot(self.shard == "params", state.step.device)
        params = params_shard if self.shard == "params" else rep.broadcast(state.params)
        return TrainState(params, rep.broadcast(state.buffers), opt_state, rep.broadcast(state.step),
                          rep.broadcast(state.rng), slots)

    def _made_real(self, state: TrainState, device: torch.device) -> TrainState:
        made, self._made = self._made, None
        step = torch.zeros((), dtype=torch.int64, device=device) if state.step.is_meta else state.step
        state = state._replace(buffers=with_made(state.buffers, made), step=step,
                               slots=hyper_to_device(state.slots, device))
        for name, slot in state.slots.items():
            if any(torch.is_tensor(x) and x.is_meta for x in optree.tree_leaves(slot)):
                raise ValueError(f"{self!r}: the {name!r} transform's init made tensors on the meta device from the "
                                 f"whole params, which were built there (ft.init_empty); a transform whose state "
                                 f"is shaped like the params declares those fields in params_fields, so that it "
                                 f"is made from this rank's parts")
        return state

    def _declared(self, tree: Any) -> dict[str, torch.Tensor]:
        if not self.layout.is_parts(tree):
            raise ValueError(f"{self!r}: a slot field declared in params_fields is not shaped like this rank's "
                             f"parts of the params (its transform's init must map over the params it is given, "
                             f"elementwise: under a sharded step it is given this rank's parts); got "
                             f"{type(tree).__name__}")
        return self.layout.from_parts(tree)

    def _scatter(self, layout: FlatLayout, tree: Any) -> dict[str, torch.Tensor]:
        """This rank's shard tree of rank 0's params-like ``tree``: rank 0 cuts each other rank's shard and sends
        it, one at a time (point to point: no rank, rank 0 included, ever holds more than two shards of it)."""
        if layout.world == 1:
            return layout.shard_of(tree, copy=True)
        group = self._group()
        glob = (lambda r: dist.get_global_rank(group, r)) if self.group is not None else int  # noqa: E731
        device = optree.tree_leaves(tree)[0].device
        if layout.rank == 0:
            for r in range(1, layout.world):
                for k, shard in layout.shard_of(tree, rank=r).items():
                    if shard.numel():
                        dist.send(shard.contiguous(), dst=glob(r), group=group)
            return layout.shard_of(tree, copy=True)
        out = {}
        for k in layout.keys:
            shard = torch.empty(layout.size[k], dtype=layout.dtypes[k], device=device)
            if shard.numel():
                dist.recv(shard, src=glob(0), group=group)
            out[k] = shard
        return out

    # -- the step ----------------------------------------------------------------------------------
    def _check(self, ctx: StepContext) -> FlatLayout:
        """Trace-time checks of the state's structure and shapes (no tensor value is read)."""
        layout = self.layout
        if layout is None:
            raise RuntimeError(f"{self!r}: step.init(params, buffers) has not run in this process; it computes "
                               f"the shard layout. Call it first (to resume: ft.load(path, step.init(params, "
                               f"buffers)))")
        world = self._world()
        if world != layout.world:
            raise RuntimeError(f"{self!r}: the state was cut for {layout.world} ranks at step.init but the "
                               f"process group now has {world}")
        if not isinstance(ctx.slots.get(SLOT), ShardState):
            raise ValueError(f"{self!r} takes a sharded state (from this step's init, or ft.load(path, "
                             f"step.init(params, buffers))); this state is not sharded (it has no "
                             f"{SLOT!r} slot): it was made by an unsharded step")
        params_ok = layout.is_shard_tree if self.shard == "params" else layout.is_params_like
        if not params_ok(ctx.params):
            other = "params" if self.shard == "optimizer" else "optimizer"
            if self.shard == "optimizer" and find_shard_trees(ctx.params, layout.keys):
                raise ValueError(f"{self!r}: state.params is a shard tree: this state was sharded with "
                                 f"shard={other!r}; convert it through a checkpoint (ft.save, then "
                                 f"ft.load(path, step.init(params, buffers)))")
            self._cut_elsewhere(ctx.params, "params")
            raise ValueError(f"{self!r}: state.params does not match the layout computed at step.init "
                             f"(expected {'a shard tree' if self.shard == 'params' else 'the params tree'})")
        self._cut_elsewhere(ctx.opt_state, "opt_state")
        for name, slot in ctx.slots.items():
            if name != SLOT:
                self._cut_elsewhere(slot, f"slots/{name}")
        return layout

    def _cut_elsewhere(self, tree: Any, where: str) -> None:
        layout = self.layout
        for path, node in find_shard_trees(tree, layout.keys):
            if not layout.is_shard_tree(node):
                k = layout.keys[0]
                got = tuple(node[k].shape) if torch.is_tensor(node[k]) else node[k]
                raise ValueError(
                    f"{self!r}: {where}/{path} holds a {k} shard of shape {got}, but on {layout.world} rank(s) "
                    f"this rank's shard of the {layout.numel[k]} {k} elements has {layout.size[k]}: the state "
                    f"was sharded for another world size (or another model). A sharded state changes world "
                    f"size only through a checkpoint: ft.save(path, state) on the old group, then "
                    f"ft.load(path, step.init(params, buffers)) on the new one")

    def _gather(self, shards: dict, ctx: StepContext) -> Any:
        layout, group, world = self.layout, self._group(), self.layout.world
        flats = {k: _all_gather(shards[k], group, world) for k in layout.keys}
        return layout.tree(flats, like=ctx.slots[SLOT].layout)

    def _block_plan(self) -> Any:
        from .blockwise import BlockPlan
        from ..core.remat import marked_blocks

        key = (self.layout, tuple(id(m) for m in marked_blocks(self.blocks)))
        if self._plan is None or self._plan[0] != key:
            self._plan = (key, BlockPlan(self.layout, self.blocks))
        return self._plan[1]

    def wrap_loss(self, loss_fn: Callable, ctx: StepContext) -> Callable:
        if self.blocks is None:
            return loss_fn
        from ..core.recompute import lending
        from .blockwise import BlockLender

        self._check(ctx)
        self._lenders.clear()  # (a trace that failed before its reduce stage left its own)
        plan, group, world = self._block_plan(), self._group(), self.layout.world

        def blockwise(shards, buffers, batch):
            # differentiated with respect to this rank's shard: the parameters outside the blocks are gathered
            # here, each block's when it runs (and again in the backward); the gradient comes out summed
            if torch.compiler.is_dynamo_compiling():
                raise RuntimeError(f"{self!r}: per-block gathering is traced by ft.compile's direct path (make_fx) "
                                   f"only; the Dynamo path (capture='dynamo', fullgraph=False, dynamic=True or "
                                   f"extra torch.compile arguments) cannot trace it. Use ft.compile's default "
                                   f"capture, or data_parallel(shard='params') without blocks=")
            lender = BlockLender(plan, shards, group if world > 1 else None, world)
            self._lenders.append(lender)  # (the reduce stage waits for what its backward prefetched in vain)
            none_ran = (f"{self!r}: no marked block of blocks={type(self.blocks).__name__} ran in the loss; "
                        f"blocks= must be the module given to ft.functionalize, whose blocks are marked with "
                        f"ft.remat")
            try:
                with lending(lender):
                    result = loss_fn(lender.params(), buffers, batch)
            except (RuntimeError, NotImplementedError) as e:
                if "meta" not in str(e):
                    raise
                # a block's parameters are meta placeholders outside the block: something read one there
                raise RuntimeError(none_ran if not lender.lent else (
                    f"{self!r}: a parameter of a marked block was read outside the block ({e}); with blocks= a "
                    f"block's parameters exist only while it runs: a loss that reads them elsewhere (a tied "
                    f"weight, a penalty on the weights) needs data_parallel(shard='params') without blocks=")) from e
            lender.drain("forward")
            if not lender.lent:
                raise RuntimeError(none_ran)
            return result

        return blockwise

    def wrap_grad(self, grad_fn: Callable, ctx: StepContext) -> Callable:
        if self.blocks is None:  # (with blocks= the loss stage checked)
            self._check(ctx)
        if self.shard != "params" or self.blocks is not None:
            return grad_fn  # (blocks: the loss gathers, block by block; the gradient is of the shard)

        def gathered(params, buffers, batch):
            # the whole params exist only while this micro-batch's forward and backward run
            return grad_fn(self._gather(params, ctx), buffers, batch)

        return gathered

    def reduce(self, ctx: StepContext) -> None:
        # last in the stage: one reduce-scatter per dtype of the padded flat gradient, so from here on
        # ctx.grads (and ctx.params, cut alike) is this rank's shard, and transforms that read a global
        # property of the gradient sum it over the shards through ctx.global_sum
        layout, world = self.layout, self.layout.world
        self.replicated.reduce_counts(ctx)  # loss, denominators, aux: all-reduced as without sharding
        if self.blocks is not None:  # the gradient of the shard, already summed over the ranks by the gathers'
            for lender in self._lenders:  # backward; a re-gather prefetched for a block whose backward did not
                lender.drain("backward")  # run (its output had no gradient) is waited for here
            self._lenders.clear()
        elif world == 1:
            ctx.grads = layout.flatten(ctx.grads)  # the one shard is the whole (unpadded) buffer
        else:
            ctx.grads = {k: _reduce_scatter(flat, self._group()) for k, flat in layout.flatten(ctx.grads).items()}
        if world > 1:
            ctx.shard_group = self._group()
        if self.shard == "optimizer":
            ctx.params = layout.shard_of(ctx.params)

    def after(self, ctx: StepContext) -> None:
        # after the EMA (order 0) has blended its shard from the new param shard
        if self.shard == "optimizer":
            ctx.params = self._gather(ctx.params, ctx)

    def __repr__(self) -> str:
        blocks = "" if self.blocks is None else f", blocks={type(self.blocks).__name__}"
        return f"data_parallel(shard={self.shard!r}{blocks})"


def gather_state(state: TrainState, group: Any = None) -> TrainState:
    """The whole, unsharded :class:`~functrain.TrainState` of a sharded one, on every rank.

    Call it on every rank of the group the state is sharded over (it all-gathers each
    shard), for evaluation, export or comparison. In a job::

        step = ft.data_parallel(shard="params")(base_step)
        state = step.init(params, buffers)
        ...
        full = ft.gather_state(state)          # every rank
        ft.to_module(model, full.params)

    Args:
        state: a :class:`~functrain.TrainState`, sharded by ``data_parallel(shard=...)`` or not.
        group: the process group it is sharded over (default ``None``: the default group).

    Returns:
        A state with exactly the structure an unsharded step's state has (``{name: tensor}``
        params, moments and EMA, no ``"data_parallel"`` slot); a state that is not sharded is
        returned as it is.

    Raises:
        TypeError: ``state`` is not a ``TrainState``.
        RuntimeError: the calling group is not the one the state is sharded over (another size,
            a single process, or another rank's shard); the message says what to do instead.

    Example::

        >>> import torch, functrain as ft
        >>> step = ft.train_step(lambda p, b, x: (p["w"] * x).sum(), ft.optim.sgd(0.1))
        >>> state = step.init({"w": torch.ones(2)})
        >>> ft.gather_state(state) is state   # not sharded: nothing to gather
        True
    """
    if not isinstance(state, TrainState):
        raise TypeError(f"gather_state takes a functrain TrainState; got {type(state).__name__}")
    slot = state.slots.get(SLOT)
    if not isinstance(slot, ShardState):
        return state
    world, rank = int(slot.world), int(slot.rank)
    have = _world_of(group)
    if world > 1 and have != world:
        where = f"a group of {have}" if have > 1 else "a single process without a process group"
        raise RuntimeError(f"gather_state: this state is sharded over {world} ranks (this is rank {rank}'s "
                           f"shard) but it was called in {where}; call it on every rank of the state's group "
                           f"(inside the job that trained it), or load a checkpoint of it in one process "
                           f"(ft.load(path) gives the whole state)")
    if world > 1 and dist.get_rank(group) != rank:
        raise RuntimeError(f"gather_state: this shard belongs to rank {rank} but this process is rank "
                           f"{dist.get_rank(group)} of the group")
    layout = FlatLayout.from_slot(slot)
    g = group if group is not None else (dist.group.WORLD if world > 1 else None)

    def whole(node: Any) -> Any:
        if not layout.is_shard_tree(node):
            return node
        return layout.tree({k: _all_gather(node[k], g, world) for k in layout.keys})

    rest = state._replace(slots={k: v for k, v in state.slots.items() if k != SLOT})
    return optree.tree_map(whole, rest, is_leaf=layout.is_shard_tree)
