"""The trainer's evaluation: the mean loss over a whole eval set, each sample once, on any number of processes."""
from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch

from ..core import tree as T
from ..data import gather_for_eval, shard
from ..data.arrays import as_columns
from ..core.state import TrainState

__all__ = ["Evaluator"]


class Evaluator:
    """``evaluator(state) -> {"eval_loss": ..., "eval_loss_ema": ..., "eval_samples": n}`` (host floats).

    The eval set is sharded over the processes with ``ft.shard`` (no shuffling, the last global batch
    padded by wrap-around); each process computes the loss of its batch's real rows only (the padding is
    cut off), and :func:`functrain.gather_for_eval` gathers one value per real sample (its batch's mean
    loss), so every sample counts exactly once: ``eval_loss`` is the mean over samples of their batch's
    loss (the mean per-sample loss when the loss is a mean over the batch's samples). The loss is computed
    with the state's params and, when it has an EMA, with the EMA params, without gradients, in the
    params' dtype, with the module in eval mode (dropout off), from a fixed seed (the same numbers at every
    evaluation; the caller's RNG is untouched). Every process gets the same result.

    Example::

        evaluate = Evaluator(loss_fn, eval_set, batch_size=64)
        evaluate(state)   # {'eval_loss': 0.41, 'eval_loss_ema': 0.39, 'eval_samples': 1000}
    """

    def __init__(self, loss_fn: Callable, dataset: Any, batch_size: int, *, device: Any = None,
                 module: torch.nn.Module | None = None, seed: int = 0):
        self.loss_fn = loss_fn
        self.module = module
        self.seed = seed
        self.loader = shard(dataset, batch_size=batch_size, shuffle=False, drop_last=False, device=device)
        self.device = device
        world, size = self.loader.world_size, _samples(self.loader.dataset)
        if size is not None and size < world * batch_size:
            raise ValueError(f"the eval dataset has {size} samples, fewer than one batch of {batch_size} on each of "
                             f"{world} process(es) ({world * batch_size} samples): lower TrainConfig.eval_batch_size "
                             f"(now {batch_size}) or use a larger eval set")

    def __call__(self, state: TrainState) -> dict:
        named = [("eval_loss", state.params)]
        if state.ema is not None:
            named.append(("eval_loss_ema", state.ema))
        total: torch.Tensor | None = None
        count = 0
        with torch.no_grad(), self._eval_mode(), self._rng():
            self.loader.set_epoch(0)
            for batch in self.loader:
                info = self.loader.last_batch_info
                part = _rows(batch, info.rows, info.real)
                values = [self._loss(params, state.buffers, part) if info.real else torch.zeros(())
                          for _, params in named]
                per_row = torch.stack([v.detach().to(torch.float64).cpu() for v in values]).expand(info.rows, -1)
                rows = gather_for_eval(per_row.contiguous(), self.loader)
                s = rows.sum(0)
                total = s if total is None else total + s
                count += rows.shape[0]
        if not count:
            raise ValueError("the eval dataset yielded no sample")
        means = (total / count).tolist()
        return {**{name: v for (name, _), v in zip(named, means)}, "eval_samples": count}

    def _loss(self, params: Any, buffers: Any, batch: Any) -> torch.Tensor:
        out = self.loss_fn(params, T.tree_map(torch.clone, buffers), batch)  # the forward may write buffers
        return out[0] if isinstance(out, tuple) else out

    @contextlib.contextmanager
    def _eval_mode(self):
        module = self.module
        if module is None:
            yield
            return
        modes = [(m, m.training) for m in module.modules()]
        module.eval()
        try:
            yield
        finally:
            for m, training in modes:
                m.training = training

    @contextlib.contextmanager
    def _rng(self):
        devices = [self.device] if self.device is not None and torch.device(self.device).type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(self.seed)
            yield


def _samples(dataset: Any) -> int | None:
    """The samples of an eval set (a DataLoader's: its dataset's), ``None`` if unknown: the rows of in-memory
    columns (a tuple or dict of tensors / numpy arrays, a ``TensorDataset``: ``ft.shard``'s reading of them,
    not ``len`` of the container), else ``len(dataset)``."""
    columns = as_columns(dataset)
    if columns is not None:
        return len(columns)
    try:
        return len(dataset)
    except TypeError:
        return None


def _rows(batch: Any, rows: int, real: int) -> Any:
    """The batch without its trailing padding rows (every leaf with ``rows`` leading rows is cut to ``real``)."""
    if real == rows:
        return batch
    return T.tree_map(lambda x: x[:real] if torch.is_tensor(x) and x.dim() and x.shape[0] == rows else x, batch)
