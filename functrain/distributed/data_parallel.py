"""Data parallelism (stage ``reduce``): the same step on N processes, gradients summed in the graph."""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..core import tree as T
from ..core.validate import BadValue, check_choice
from .blockwise import check_blocks
from . import group as G
from ..core.state import TrainState
from ..core.eager import all_reduce_sum, tracing
from ..core.step import Step
from ..core.transform import StepContext, Transform
from .sharding import MODES, ShardedDataParallel

__all__ = ["data_parallel"]


def _world(group: Any) -> int:
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def _ensure_group() -> None:
    """Under a multi-process launch, form the process group if the script forgot to; never train alone.

    Without it each rank would step on its own shard of the data with its own
    state: N independent trainings, silently. A launch is recognised by its
    variables (torchrun, SLURM, Open MPI, PMI) with a world size above 1.
    """
    if dist.is_available() and dist.is_initialized():
        return
    try:
        info = G.process_info()
    except ValueError as e:
        raise RuntimeError(f"data_parallel: the launcher's variables are unreadable ({e}); call "
                           "ft.distributed.init() with a valid environment") from e
    if info.world_size == 1:
        return
    try:
        G.init()
    except Exception as e:  # noqa: BLE001 - whatever stops the group from forming, say what to do
        raise RuntimeError(
            f"data_parallel: this process is rank {info.rank} of {info.world_size} ({info.launcher} launch) but no "
            f"process group is formed, and forming it from the environment failed: {type(e).__name__}: {e}. "
            "Call ft.distributed.init() at the start of the script (it needs MASTER_ADDR/MASTER_PORT outside "
            "torchrun); without a group each rank would train alone") from e


def sum_over_ranks(tree: Any, group: Any) -> Any:
    """``tree`` with every leaf summed over the ranks of ``group``: one all-reduce per dtype over
    one flat buffer of the leaves (in the graph when traced)."""
    leaves, spec = T.tree_flatten(tree)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, leaf in enumerate(leaves):
        by_dtype.setdefault(leaf.dtype, []).append(i)
    out = list(leaves)
    for dtype, idx in by_dtype.items():
        flat = torch.cat([leaves[i].reshape(-1) for i in idx])
        flat = all_reduce_sum(flat, group)
        for i, part in zip(idx, flat.split([leaves[i].numel() for i in idx])):
            out[i] = part.view(leaves[i].shape)
    return T.tree_unflatten(spec, out)


COMPRESS = {"bf16": torch.bfloat16, "fp16": torch.float16}
"""``data_parallel(compress=...)``: the dtype the gradient travels in."""


def compressed_sum_over_ranks(tree: Any, group: Any, dtype: torch.dtype, world: int) -> Any:
    """``tree`` summed over the ranks of ``group`` with every floating leaf wider than ``dtype`` sent in ``dtype``:
    each rank divides by ``world``, casts, the flat buffer is all-reduced (sum) in ``dtype``, cast back and
    multiplied by ``world`` (dividing first keeps an fp16 sum within range wherever each rank's values are, as
    DDP's fp16 hook does). Other leaves are summed as they are (:func:`sum_over_ranks`). In the graph when traced.

    Bound, per element, against the exact mean ``m = sum_r g_r / world`` (``eps``: the dtype's machine epsilon,
    2**-7 for bf16, 2**-10 for fp16): ``|result / world - m| <= world * eps * max_r |g_r| + world * tiny``, ``tiny``
    the dtype's smallest subnormal (2**-24 for fp16, 2**-133 for bf16), its spacing under its normal range.
    """
    leaves, spec = T.tree_flatten(tree)
    out = list(leaves)
    wide: dict[torch.dtype, list[int]] = {}
    narrow: list[int] = []
    for i, leaf in enumerate(leaves):
        if leaf.is_floating_point() and leaf.element_size() > dtype.itemsize:
            wide.setdefault(leaf.dtype, []).append(i)
        else:
            narrow.append(i)
    if narrow:
        for i, v in zip(narrow, sum_over_ranks([leaves[i] for i in narrow], group)):
            out[i] = v
    for wide_dtype, idx in wide.items():
        flat = (torch.cat([leaves[i].reshape(-1) for i in idx]) / world).to(dtype)
        flat = all_reduce_sum(flat, group).to(wide_dtype) * world
        for i, part in zip(idx, flat.split([leaves[i].numel() for i in idx])):
            out[i] = part.view(leaves[i].shape)
    return T.tree_unflatten(spec, out)


class DataParallel(Transform):
    """Sum gradients, losses, item counts and aux metrics over the processes of ``group``.

    Law: N ranks, each stepping on its 1/N of a batch, reach the same new state as
    one process stepping on the whole batch. The reduction is a functional
    all-reduce inside the step (one per dtype, over one flat buffer), so a
    compiled step keeps it in its single graph; it runs before normalisation,
    unscaling, the finiteness check and clipping, whatever the wrapping order, so
    every rank takes the same decision (a non-finite gradient on one rank skips
    the update on all). ``post_init`` broadcasts the initial state from rank 0;
    each rank draws its own random numbers (``seed + rank``, see
    :func:`functrain.core.rng.with_rng`) while the state stays replicated.
    With a single process it does nothing.

    ``compress`` (``"bf16"``, ``"fp16"`` or ``None``): the gradient travels in that dtype
    (:func:`compressed_sum_over_ranks`: divided by the world size, cast, summed, cast back); the law
    then holds to that dtype's rounding of the exact mean, bounded there.
    """

    name = "data_parallel"
    order = 0
    needs = "global"  # it sums over the ranks itself

    def __init__(self, group: Any = None, compress: str | None = None):
        self.group = group
        self.compress = compress  # None, or a key of COMPRESS: the dtype the gradient is all-reduced in
        self._env_checked = False  # the launcher's variables were looked at (see _ensure_group)
        self._gloo: Any = None  # a gloo group of the ranks, for agree() when the group is not gloo

    def _group(self) -> Any:
        return self.group if self.group is not None else dist.group.WORLD

    def post_init(self, state: TrainState, init: Any = None) -> TrainState:
        self.ensure_group()
        return self.broadcast(state)  # the RNG key too: ranks differ by with_rng's rank offset

    def ensure_group(self) -> None:
        """Form the process group from a launcher's variables if the script did not (never train alone)."""
        if self.group is None:
            _ensure_group()
            self._env_checked = True

    def broadcast(self, tree: Any) -> Any:
        """Rank 0's ``tree`` on every rank of the group, in new tensors (the input is never written)."""
        if _world(self.group) == 1:
            return tree
        group = self._group()
        src = dist.get_global_rank(group, 0) if self.group is not None else 0

        def broadcast(t: torch.Tensor) -> torch.Tensor:
            t = t.detach().clone()
            dist.broadcast(t, src=src, group=group)
            return t

        return T.tree_map(broadcast, tree)

    def rng_offset(self) -> int:
        """This process's rank in the group: each step seeds its random draws with ``seed + rank``."""
        return dist.get_rank(self._group()) if _world(self.group) > 1 else 0

    def agree(self, value: "int | tuple[float, ...]") -> "int | tuple[float, ...]":
        """The least ``value`` over the ranks of the group (a tuple of floats: elementwise): one all-reduce (MIN)
        of a CPU tensor on a gloo group (the group itself if it is gloo, else a gloo group of its ranks made on
        first use), bounded by ``FUNCTRAIN_DIST_TIMEOUT``: no device sync, whatever the training backend.
        ``value`` on one process."""
        many = isinstance(value, tuple)
        if _world(self.group) == 1:
            return tuple(float(x) for x in value) if many else int(value)
        t = torch.tensor(value, dtype=torch.float64) if many else torch.tensor([int(value)], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self._host_group())
        return tuple(t.tolist()) if many else int(t[0])

    def _host_group(self) -> Any:
        group = self._group()
        if dist.get_backend(group) == "gloo":
            return group
        if self._gloo is None:  # every rank of the group reaches its first agree() at the same step
            self._gloo = dist.new_group(dist.get_process_group_ranks(group), backend="gloo",
                                        timeout=G.default_timeout(), use_local_synchronization=True)
        return self._gloo

    def reduce(self, ctx: StepContext) -> None:
        self.reduce_counts(ctx, with_grads=True)

    def reduce_counts(self, ctx: StepContext, with_grads: bool = False) -> None:
        """Sum the loss, the denominator, the micro-batch weight and the aux metrics over the ranks (and,
        ``with_grads``, the whole gradient: the replicated reduction); the sharded transform reduce-scatters
        the gradient itself and calls this for the rest."""
        if self.group is None and not self._env_checked and not dist.is_initialized() and not tracing():
            _ensure_group()  # a state not made by this step's init (post_init): still never alone
            self._env_checked = True
        world = _world(self.group)
        if world == 1:
            return
        compress = with_grads and self.compress is not None
        summed = {"grads": ctx.grads} if with_grads and not compress else {}
        summed["loss"] = ctx.loss
        for k, v in (("denom", ctx.denom), ("weight", ctx.weight)):  # a Python number is the same on every
            if torch.is_tensor(v):                                     # rank: no need to send it
                summed[k] = v
        if ctx.aux:  # (Dynamo's optree polyfill cannot flatten an empty dict inside a tree)
            summed["aux"] = ctx.aux
        reduced = sum_over_ranks(summed, self._group())
        if compress:
            ctx.grads = compressed_sum_over_ranks(ctx.grads, self._group(), COMPRESS[self.compress], world)
        elif with_grads:
            ctx.grads = reduced["grads"]
        ctx.loss, ctx.aux = reduced["loss"], reduced.get("aux", {})
        ctx.denom = reduced.get("denom", ctx.denom * world if not torch.is_tensor(ctx.denom) else None)
        ctx.weight = reduced.get("weight", ctx.weight * world if not torch.is_tensor(ctx.weight) else None)

    def __call__(self, step: Any) -> Any:
        if isinstance(step, Step):
            for t in step.transforms:
                if t.name == self.name:
                    raise ValueError(f"{self!r} cannot wrap a step that already has {t!r}: a step holds one "
                                     f"data-parallel mode (data_parallel or local_sgd), not both")
        return Transform.__call__(self, step)

    def __repr__(self) -> str:
        return "data_parallel()" if self.compress is None else f"data_parallel(compress={self.compress!r})"


def data_parallel(group: Any = None, shard: str = "none", blocks: Any = None,
                  compress: str | None = None) -> DataParallel | ShardedDataParallel:
    """Average the step over processes (``pmap`` + ``pmean``, on ``torch.distributed``).

    Run the script with ``python -m functrain.launch --nproc N script.py`` (or
    torchrun) and call ``ft.distributed.init()`` first; each rank feeds its own
    shard of the data. ``group`` is a process group (default: all processes).
    If the script launched on several processes forgot ``init()``, ``step.init``
    forms the group from the launcher's variables (or raises, saying to call
    ``ft.distributed.init()``): the ranks never train alone in silence. On one
    process without launcher variables it does nothing.

    ``shard`` (see :mod:`functrain.distributed.sharding`): ``"none"`` replicates
    the whole state on every rank; ``"optimizer"`` (ZeRO-2) reduce-scatters the
    gradient, so each rank updates its 1/N of the params, optimizer state and
    EMA, and all-gathers the new params; ``"params"`` (ZeRO-3 / FSDP) shards the
    params at rest too and all-gathers them for the forward and backward.
    :func:`functrain.gather_state` gives the whole state back. With ``shard="params"`` and
    ``blocks=model`` (the module given to ``ft.functionalize``, its blocks marked with
    :func:`functrain.remat`) no rank ever holds the whole model: each marked block's parameters are gathered
    when it runs and again when the backward reaches it (see :mod:`functrain.distributed.blockwise`).

    Args:
        group: the ``torch.distributed`` process group to average over, or ``None`` for all processes.
        shard: ``"none"`` (replicated), ``"optimizer"`` (ZeRO-2) or ``"params"`` (ZeRO-3 / FSDP).
        blocks: with ``shard="params"`` only: the model whose ``ft.remat``-marked blocks are gathered one at a
            time (FSDP2's per-module ``fully_shard``); ``None``: all parameters gathered together.
        compress: ``"bf16"`` or ``"fp16"``: all-reduce the gradient in that dtype (each rank divides its gradient by
            the world size, casts, the sum is cast back and multiplied by the world size; losses, item counts and
            metrics stay in their own dtypes); ``None`` (the default): in the gradient's own dtype. With
            ``shard="none"`` only. The result is the exact mean to within ``world * eps * max|g|`` per element.

    Returns:
        The transform: ``ft.data_parallel()(step)`` is the data-parallel step.

    Raises:
        ValueError: a ``shard`` other than the three; ``blocks`` with another ``shard`` than ``"params"``, not a
            module, or a module with no block marked by ``ft.remat`` (``BadValue``, also a ``TypeError``); a
            ``compress`` other than ``None``, ``"bf16"``, ``"fp16"``, or with a sharded ``shard``.

    Example::

        >>> import functrain as ft
        >>> ft.data_parallel()
        data_parallel()
    """
    check_choice("data_parallel: shard", shard, ("none",) + MODES)
    check_choice("data_parallel: compress", compress, (None,) + tuple(COMPRESS))
    if compress is not None and shard != "none":
        raise BadValue(f"data_parallel: compress={compress!r} compresses the replicated all-reduce; "
                       f"shard={shard!r} reduce-scatters the gradient instead: use shard='none' or compress=None")
    if blocks is not None:
        if shard != "params":
            raise BadValue(f"data_parallel: blocks= gathers sharded parameters block by block, so it needs "
                           f"shard='params'; got shard={shard!r}")
        blocks = check_blocks(blocks)
    if shard == "none":
        return DataParallel(group, compress)
    return ShardedDataParallel(DataParallel(group), shard, blocks)
