"""Gradient accumulation (stage ``grad``): several micro-batches, one optimizer update."""
from __future__ import annotations

from typing import Any, Callable

import optree
import torch

from ..core import tree as T
from ..core.eager import Sum, tracing
from ..core.validate import check_int, path_str
from ..core.transform import StepContext, Transform

__all__ = ["accumulate"]

_SUMMED = ("loss", "denom", "weight", "num_items")


def add_outs(a: dict, b: dict) -> dict:
    """Combine two micro-batches' step outputs: sums add, the later buffers win."""
    out = {k: a[k] + b[k] for k in _SUMMED if k in a}
    out["aux"] = {k: a["aux"][k] + b["aux"][k] for k in a["aux"]}
    out["buffers"] = b["buffers"]
    return out


def split_batch(batch: Any, n: int) -> list:
    """Split every tensor leaf of ``batch`` along dim 0 into ``n`` equal micro-batches."""
    leaves, spec = optree.tree_flatten(batch)
    parts = []
    for i, leaf in enumerate(leaves):
        if not torch.is_tensor(leaf) or leaf.dim() == 0:
            parts.append([leaf] * n)
            continue
        if leaf.shape[0] % n:
            name = path_str(optree.tree_paths(batch)[i])  # the paths only for the message
            raise ValueError(f"accumulate({n}): batch leaf {name!r} has leading dimension {leaf.shape[0]}, "
                             f"which is not divisible by {n}; give a batch of n * micro_batch rows")
        parts.append(list(leaf.chunk(n)))
    return [optree.tree_unflatten(spec, [p[i] for p in parts]) for i in range(n)]


def after(done: Any, micro: Any) -> Any:
    """``micro`` (its tensors' values unchanged) made to depend on every tensor of ``done``, in a graph.

    Traced, the micro-batches are independent computations: a compiler may interleave them (inductor fuses the
    kernels of micro-batch k and k+1 that read the same weights, so each micro-batch's activations are alive at
    once, and accumulation saves no memory). ``torch.where(c, x, x)`` is ``x`` for any ``c``, but a kernel that
    computes it reads ``c``, which reads one element of each gradient of the micro-batches before: the next
    micro-batch starts once their backward passes are done. Eagerly the ops run in order anyway (not called).

    One indexed element of each gradient, stacked: a one-element slice of each, concatenated, was miscompiled by
    inductor (torch 2.13 and 2.14.1: a clipped ``accumulate(3)`` step's one-element bias 0.02 off eager after one
    update, while ``aot_eager`` was exact; tests/compiler/test_fast_path.py holds the compiled step to eager)."""
    firsts = [t.reshape(-1)[0].float() for t in optree.tree_leaves(done) if torch.is_tensor(t) and t.numel()]
    if not firsts:
        return micro
    c = torch.stack(firsts).sum() == 0  # (any value will do)
    return optree.tree_map(lambda x: torch.where(c if x.device == c.device else c.to(x.device), x, x)
                           if torch.is_tensor(x) else x, micro)


class Accumulate(Transform):
    """Split the batch into ``n`` micro-batches and make one update from their gradients.

    Law: for a mean loss the update equals the un-accumulated step on the whole
    batch; with ``aux["num_items"]`` it equals the big batch's item-mean update
    (gradients are summed and divided once by the total item count). Each
    micro-batch's activations are freed before the next one runs.
    ``metrics["loss"]`` is the mean over micro-batches (the big batch's loss).
    """

    name = "accumulate"
    order = 0
    needs = "elementwise"  # passes the params on, sums the gradients

    def __init__(self, n: int):
        self.n = check_int("accumulate: n", n, minimum=1)

    @property
    def micro_batches(self) -> int:  # Transform.micro_batches: one call's batch holds n
        return self.n

    def wrap_grad(self, grad_fn: Callable, ctx: StepContext) -> Callable:
        n = self.n

        def accumulated(params, buffers, batch):
            grads, out = Sum(), None  # eagerly summed in place into tensors it made, traced out of place
            for micro in split_batch(batch, n):
                if out is not None and tracing():
                    micro = after(grads.value, micro)
                g, o = grad_fn(params, buffers, micro)
                buffers = o["buffers"]
                grads.add(g)
                out = o if out is None else add_outs(out, o)
            return grads.value, out

        return accumulated if n > 1 else grad_fn

    def __repr__(self) -> str:
        return f"accumulate({self.n})"


class StreamingAccumulate(Transform):
    """Accumulate micro-batches fed one call at a time; update on every ``n``-th call.

    The slot holds the running gradient sum, loss, denominator and a counter.
    Every call computes the update from the running sums, and a select on the
    device keeps it only on the ``n``-th call (no host branch), then resets the
    sums. Same law as :class:`Accumulate`. ``aux`` metrics are the current
    micro-batch's; ``metrics["loss"]`` is the mean so far in the window.
    """

    name = "accumulate"
    order = 0
    micro_batches = 1  # one micro-batch per call
    needs = "elementwise"  # running sums, reset by a select

    def __init__(self, n: int):
        self.n = Accumulate(n).n  # same validation

    def init(self, params, buffers) -> dict:
        device = T.tree_leaves(params)[0].device
        zero = torch.zeros((), dtype=torch.float32, device=device)
        return {"grads": T.tree_zeros_like(params), "loss": zero, "denom": zero.clone(),
                "weight": zero.clone(), "count": torch.zeros((), dtype=torch.int64, device=device)}

    def wrap_grad(self, grad_fn: Callable, ctx: StepContext) -> Callable:
        def streamed(params, buffers, batch):
            g, o = grad_fn(params, buffers, batch)
            s = ctx.slot(self)
            count = s["count"] + 1
            last = count >= self.n
            ctx.keep_if(last)
            ctx.boundary = last
            grads = T.tree_add(s["grads"], g)
            out = dict(o)
            for k in ("loss", "denom", "weight"):
                out[k] = s[k] + o[k]
            if "num_items" in o:
                out["num_items"] = out["denom"]
            out["aux"] = {k: v * out["weight"] for k, v in o["aux"].items()}  # current micro-batch's
            ctx.set_slot(self, {"grads": grads, "loss": out["loss"], "denom": out["denom"],
                                "weight": out["weight"], "count": count})
            return grads, out

        return streamed

    def commit(self, ctx: StepContext) -> None:
        s = ctx.slot(self)
        last = s["count"] >= self.n
        ctx.set_slot(self, {
            "grads": T.tree_map(lambda a: torch.where(last, torch.zeros_like(a), a), s["grads"]),
            **{k: torch.where(last, torch.zeros_like(s[k]), s[k]) for k in ("loss", "denom", "weight")},
            "count": torch.where(last, torch.zeros_like(s["count"]), s["count"]),
        })

    def __repr__(self) -> str:
        return f"accumulate({self.n}, streaming=True)"


def accumulate(n: int, streaming: bool = False) -> Transform:
    """Accumulate gradients over ``n`` micro-batches per optimizer update.

    Law: for a mean loss the update equals the un-accumulated step on the whole batch;
    with ``aux["num_items"]`` it equals the big batch's item-mean update.

    Args:
        n: the number of micro-batches per update, an int >= 1 (1: the step unchanged).
        streaming: ``False`` (default): each call receives a batch whose tensor leaves have a
            leading dimension divisible by ``n``, splits it into ``n`` micro-batches and makes
            one update. ``True``: each call receives one micro-batch, the running sums live in
            the slot ``state.slots["accumulate"]``, and the update is made on every ``n``-th call.

    Returns:
        The :class:`Accumulate` (or :class:`StreamingAccumulate`) transform; its ``n`` is the factor.

    Raises:
        BadValue: ``n`` is not an int >= 1.
        ValueError: (at step time, ``streaming=False``) a batch leaf's leading dimension is not
            divisible by ``n``; the message names the leaf.

    Example::

        >>> import torch, functrain as ft
        >>> step = ft.accumulate(4)(ft.train_step(lambda p, b, x: (p["w"] * x).mean(), ft.optim.sgd(0.1)))
        >>> state, metrics = step(step.init({"w": torch.ones(3)}), torch.ones(8, 3))
        >>> state.params["w"]
        tensor([0.9667, 0.9667, 0.9667])
    """
    return StreamingAccumulate(n) if streaming else Accumulate(n)
