"""Local SGD: each rank steps on its own gradient and the ranks average their params every ``k`` steps."""
from __future__ import annotations

from typing import Any

import torch

from ..core import tree as T
from ..core.eager import all_reduce_sum, host_number, select, tracing
from ..core.step import Step
from ..core.transform import StepContext, Transform
from ..core.validate import check_int
from .data_parallel import DataParallel, _world

__all__ = ["local_sgd", "LocalSGD"]


class LocalSGD(DataParallel):
    """A data-parallel mode: no gradient all-reduce; the params are averaged over the ranks every ``every`` steps.

    Each rank computes its gradient on its own data and updates its own copy of the state. In the ``after`` stage
    of every call whose count ``state.step + 1`` is a multiple of ``every`` the committed params become their mean
    over the ranks of ``group`` (an in-graph functional all-reduce of one flat buffer per dtype, divided by the
    world size). The optimizer state, the buffers, the loss scale and the other transforms' slots stay each rank's
    own (as Accelerate's ``LocalSGD``, which averages the parameters only). Metrics are this rank's.

    The decision reads only ``state.step``, which ``post_init`` broadcasts from rank 0 with the rest of the
    initial state and every rank advances by one per call: the ranks agree on the sync step by construction, and
    a resumed state syncs where the uninterrupted run would. Eagerly the count is read on the host and only a
    sync step communicates; compiled, the step is one graph holding the all-reduce on every call and a
    ``torch.where`` keeps its result on sync steps only (no host branch, no recompiles; the communication is
    not saved there).

    Law: ``local_sgd(1)`` equals ``data_parallel()`` (to float rounding) for an optimizer whose update is linear
    in the gradient history (SGD, with or without momentum, Nesterov, weight decay) and a mean loss over
    equal-sized shards: the mean of the ranks' updates is the update of the mean gradient. Not for Adam, AdamW,
    Lion (their updates are not linear in the gradient).

    It takes the ``data_parallel`` name: a step holds one data-parallel mode, so ``data_parallel`` (replicated
    or sharded) and ``local_sgd`` on one step are refused by name, and the trainer sees the step as data-parallel
    already.
    """

    name = "data_parallel"  # a data-parallel mode: one per step (the duplicate is refused by name)
    order = 0
    needs = "elementwise"  # an elementwise mean of the params over the ranks

    def __init__(self, every: int, group: Any = None):
        super().__init__(group)
        self.every = every

    def __call__(self, step: Any) -> Any:
        if isinstance(step, Step):
            for t in step.transforms:
                if t.name == self.name:
                    raise ValueError(f"{self!r} cannot wrap a step that already has {t!r}: local SGD replaces the "
                                     f"per-step gradient all-reduce, so a step holds one data-parallel mode "
                                     f"(data_parallel or local_sgd), not both")
        return Transform.__call__(self, step)

    def reduce(self, ctx: StepContext) -> None:
        # no reduction: each rank steps on its own gradient; a state not made by this step's init still never
        # leaves the ranks without a group (as data_parallel's reduce)
        if self.group is None and not self._env_checked and not tracing():
            self.ensure_group()

    def after(self, ctx: StepContext) -> None:
        world = _world(self.group)
        if world == 1:
            return
        count = host_number(ctx.state.step) + 1  # this call's number: eagerly an int, traced a tensor
        sync = count % self.every == 0
        leaves, spec = T.tree_flatten(ctx.params)

        ctx.params = T.tree_unflatten(spec, select(sync, lambda: mean_over_ranks(leaves, self._group(), world),
                                                   lambda: leaves))

    def __repr__(self) -> str:
        return f"local_sgd({self.every})"


def mean_over_ranks(leaves: list, group: Any, world: int) -> list:
    """The mean of each leaf over the ranks of ``group``: one flat buffer per dtype, each element divided by ``world``
    and the buffer all-reduced (sum) in the graph when traced.

    Dividing before the all-reduce (the same bits as after for a power-of-two ``world``) makes the all-reduce's
    buffer a new tensor: inductor otherwise let the concatenated buffer alias the first leaf, which the in-place
    all-reduce then overwrote, so the params kept on a step without sync came out summed (torch 2.13).
    """
    out = list(leaves)
    by_dtype: dict[Any, list[int]] = {}
    for i, leaf in enumerate(leaves):
        by_dtype.setdefault(leaf.dtype, []).append(i)
    for idx in by_dtype.values():
        flat = torch.cat([leaves[i].reshape(-1) for i in idx]) / world
        flat = all_reduce_sum(flat, group)
        for i, part in zip(idx, flat.split([leaves[i].numel() for i in idx])):
            out[i] = part.view(leaves[i].shape)
    return out


def local_sgd(every: int, group: Any = None) -> LocalSGD:
    """Local SGD (Accelerate's ``LocalSGD(k)``): ranks step alone and average their params every ``every`` steps.

    Run it where ``data_parallel`` would go (``ft.local_sgd(4)(step)`` instead of ``ft.data_parallel()(step)``),
    each rank fed its own shard of the data: see :class:`LocalSGD` for what is averaged, when, and the law.

    Args:
        every: how many steps (calls, ``state.step``) between averages; 1 averages after every step.
        group: the ``torch.distributed`` process group, or ``None`` for all processes.

    Returns:
        The transform.

    Raises:
        ValueError: ``every`` not an int >= 1 (``BadValue``, also a ``TypeError``).

    Example::

        >>> import functrain as ft
        >>> ft.local_sgd(4)
        local_sgd(4)
    """
    return LocalSGD(check_int("local_sgd: every", every, minimum=1), group)
