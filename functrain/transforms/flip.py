"""Random flips of the batch inside the step (stage ``loss``): data augmentation that compiles and replays."""
from __future__ import annotations

from typing import Any, Callable

import torch

from ..core.validate import BadValue, check_int, check_real, describe
from ..core.transform import StepContext, Transform

__all__ = ["random_flip"]


class RandomFlip(Transform):
    """Flip each sample of the batch along ``dim`` with probability ``p``, inside the step.

    Law: for each row ``i`` of the (micro-)batch tensor ``x`` (rows on dim 0), the loss sees
    row ``i`` of ``x.flip(dim)`` where ``u_i < p`` and ``x[i]`` otherwise, with
    ``u = torch.rand(rows, device=x.device)`` drawn from the step's generator: seeded from
    ``state.rng`` (so a step re-run from the same state flips the same rows, a resumed run
    the same rows as an uninterrupted one; data-parallel ranks draw their own), one draw
    per micro-batch under ``accumulate``. The select is a ``torch.where`` on the device, so
    the compiled step is one graph. Evaluation (the trainer's ``eval_dataset``) is not flipped.
    No slot: the state's structure does not depend on it.
    """

    name = "random_flip"
    order = -10  # outermost in the loss stage: the loss (and mixed_precision's cast) sees the flipped batch
    needs = "elementwise"  # (it reads neither the gradients nor the params)

    def __init__(self, p: float = 0.5, dim: int = -1, key: Any = None):
        self.p = check_real("random_flip: p", p, lo=0.0, hi=1.0)
        self.dim = check_int("random_flip: dim", dim)
        if self.dim == 0:
            raise BadValue("random_flip: dim must not be 0 (dim 0 holds the samples); got 0")
        if key is not None and not isinstance(key, (int, str)):
            raise BadValue(f"random_flip: key must be None (the batch is the tensor), an int (a tuple's item) or a "
                           f"str (a dict's key); got {describe(key)}")
        self.key = key

    def flip(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` with each row flipped with probability ``p`` (one ``torch.rand`` per call)."""
        if not isinstance(x, torch.Tensor) or x.dim() < 2 or not -x.dim() <= self.dim < x.dim():
            what = f"a tensor of shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else describe(x)[:80]
            raise BadValue(f"random_flip(dim={self.dim}) flips rows of a tensor with samples on dim 0 and dim "
                           f"{self.dim} to flip; got {what}")
        rows = torch.rand(x.shape[0], device=x.device) < self.p
        return torch.where(rows.view(-1, *([1] * (x.dim() - 1))), x.flip(self.dim), x)

    def _in(self, batch: Any) -> Any:
        if self.key is None:
            return self.flip(batch)
        if isinstance(batch, dict):
            if self.key not in batch:
                raise BadValue(f"random_flip(key={self.key!r}): the batch has keys {sorted(map(str, batch))}")
            return {**batch, self.key: self.flip(batch[self.key])}
        if isinstance(batch, (tuple, list)) and isinstance(self.key, int) and -len(batch) <= self.key < len(batch):
            items = list(batch)
            items[self.key] = self.flip(items[self.key])
            return type(batch)(items) if isinstance(batch, list) or type(batch) is tuple else type(batch)(*items)
        raise BadValue(f"random_flip(key={self.key!r}) needs a dict or tuple batch holding that item; got "
                       f"{describe(batch)[:80]}")

    def wrap_loss(self, loss_fn: Callable, ctx: StepContext) -> Callable:
        def flipped(params: Any, buffers: Any, batch: Any) -> Any:
            return loss_fn(params, buffers, self._in(batch))

        return flipped

    def __repr__(self) -> str:
        key = "" if self.key is None else f", key={self.key!r}"
        return f"random_flip(p={self.p:g}, dim={self.dim}{key})"


def random_flip(p: float = 0.5, dim: int = -1, key: Any = None) -> RandomFlip:
    """Flip batch rows at random inside the step: horizontal flips of ``(N, C, H, W)`` images by default.

    Args:
        p: the probability that a row is flipped.
        dim: the dim to flip (``-1``: the width of an image; not 0, the rows).
        key: where the tensor is in the batch: ``None`` (the batch is the tensor), an int (a tuple's
            item) or a str (a dict's key).

    Returns:
        The :class:`RandomFlip` transform (stage ``loss``, no slot).

    Example::

        >>> import torch, functrain as ft
        >>> loss = lambda p, b, x: (p["w"] * x[:, 0, 0]).sum()
        >>> step = ft.random_flip(p=1.0)(ft.train_step(loss, ft.optim.sgd(1.0)))
        >>> x = torch.tensor([[[[1.0, 2.0]]]])            # one 1x1x2 image
        >>> state, _ = step(step.init({"w": torch.zeros(2)}), x)
        >>> state.params["w"]                             # the gradient saw [2, 1]
        tensor([-2., -1.])
    """
    return RandomFlip(p, dim, key)
