"""The strategies behind :class:`~functrain.data.loader.ShardedLoader`: where one rank's batches come from.

A *source* knows one kind of data and turns ``(epoch, first batch)`` into this
rank's batches; the loader around it owns the position (epoch, batch), device
placement and the checkpoint format. Three kinds:

* :class:`MapSource` -- a map-style dataset split by the epoch's shared global order
  (and :class:`~functrain.data.arrays.ArraySource`, its fast path for
  in-memory tensors: one gather per batch instead of a collate);
* :class:`RankAwareSource` -- a DataLoader whose sampler is already split by rank;
* :class:`~functrain.data.streams.IterableSource` -- a stream.

Every source yields ``(batch, rows, real, layout)``: the collated batch, its rows
on this rank, how many leading rows are samples (the rest is wrap-around
padding) and how the ranks' rows interleave (see :class:`BatchInfo`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

__all__ = ["BatchInfo", "Source", "IndexedSource", "MapSource", "RankAwareSource", "loader_options"]

# DataLoader options that describe *how* to load (not what, in which order, or in which batches)
_OPTIONS = ("num_workers", "pin_memory", "timeout", "worker_init_fn", "multiprocessing_context", "generator",
            "prefetch_factor", "persistent_workers", "pin_memory_device", "in_order")
_WORKER_ONLY = ("prefetch_factor", "persistent_workers")  # DataLoader refuses them without workers


def loader_options(loader: DataLoader | None) -> dict:
    """The loading options of ``loader`` (workers, pinning, timeouts, ...) as ``DataLoader`` keyword arguments.

    Example::

        opts = loader_options(DataLoader(ds, batch_size=8, num_workers=2, persistent_workers=True))
        opts["persistent_workers"]  # True
    """
    if loader is None:
        return {"num_workers": 0}
    opts = {name: getattr(loader, name) for name in _OPTIONS if hasattr(loader, name)}
    if not opts.get("num_workers"):
        for name in _WORKER_ONLY:
            opts.pop(name, None)
    return opts


@dataclass(frozen=True)
class BatchInfo:
    """Which samples the batch a rank yielded last holds (what ``ft.gather_for_eval`` needs).

    Read it as :attr:`ShardedLoader.last_batch_info <functrain.data.ShardedLoader.last_batch_info>`.

    Attributes:
        epoch: the batch's epoch.
        batch: its index in the epoch.
        rows: rows in the batch on this rank.
        real: how many of them (the first) are samples; the rest are wrap-around padding.
        layout: ``"blocked"`` (rank r's rows follow rank r-1's in the global order) or
            ``"strided"`` (row l of rank r is global position l*W + r).

    Example::

        >>> import torch, functrain as ft
        >>> loader = ft.shard(torch.arange(3.0), batch_size=2, shuffle=False, rank=0, world_size=1)
        >>> batches = list(loader)
        >>> loader.last_batch_info
        BatchInfo(epoch=0, batch=1, rows=2, real=1, layout='blocked')
    """

    epoch: int
    batch: int
    rows: int
    real: int
    layout: str


class Source:
    """One rank's batches of one kind of data; the loader's strategy (see the module docs)."""

    kind = "?"

    def __init__(self, dataset: Any, batch_size: int | None, rank: int, world_size: int, shuffle: bool,
                 drop_last: bool, seed: int, collate_fn: Callable, options: dict):
        self.dataset, self.batch_size = dataset, batch_size
        self.rank, self.world_size = rank, world_size
        self.shuffle, self.drop_last, self.seed = shuffle, drop_last, seed
        self.collate_fn, self.options = collate_fn, options
        self.size = _length(dataset)  # samples in the whole dataset, None if unknown

    def num_batches(self) -> int | None:
        """Batches per rank per epoch (None: unknown until the stream ends)."""
        if self.size is None:
            return None
        per = self.world_size * self.batch_size
        return self.size // per if self.drop_last else math.ceil(self.size / per)

    def batches(self, epoch: int, start: int) -> Iterator[tuple[Any, int, int, str]]:
        """This rank's batches ``start, start+1, ...`` of ``epoch`` as ``(batch, rows, real, layout)``."""
        raise NotImplementedError

    def state_seed(self) -> int:
        """The seed a checkpoint records."""
        return self.seed

    def restore_seed(self, seed: int, where: str) -> None:
        self.seed = seed

    def global_order(self, epoch: int) -> torch.Tensor:
        raise TypeError(f"ShardedLoader.global_order: only for map-style datasets (this one is {self.kind})")

    def batch_indices(self, epoch: int) -> list[list[int]]:
        raise TypeError("ShardedLoader.batch_indices: an iterable dataset has no indices")


def _length(dataset: Any) -> int | None:
    try:
        return len(dataset)
    except TypeError:
        return None


class _EpochBatches:
    """A batch sampler whose batches are set before each epoch, so that one DataLoader (and, with
    ``persistent_workers``, one set of workers) serves every epoch."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


class IndexedSource(Source):
    """A source that knows each batch's dataset indices: they are loaded (and collated) by one DataLoader,
    built once and reused every epoch, with the loading options of the user's DataLoader."""

    def __init__(self, *args: Any, reader: Any = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.reader = self.dataset if reader is None else reader  # what __getitem__ is called on
        self._sampler: _EpochBatches | None = None
        self._loader: DataLoader | None = None

    def dataloader(self, batches: list[list[int]]) -> DataLoader:
        """The one DataLoader of this source, set to load ``batches`` when iterated next."""
        if self._loader is None:
            self._sampler = _EpochBatches()
            self._loader = DataLoader(self.reader, batch_sampler=self._sampler, collate_fn=self.collate_fn,
                                      **self.options)
        self._sampler.batches = batches
        return self._loader

    def real(self, k: int, rows: int) -> tuple[int, str]:
        """How many leading rows of this rank's batch ``k`` are samples, and the layout."""
        return rows, "blocked"

    def batches(self, epoch: int, start: int) -> Iterator[tuple[Any, int, int, str]]:
        batches = self.batch_indices(epoch)[start:]
        if not batches:
            return
        for k, (idx, batch) in enumerate(zip(batches, self.dataloader(batches)), start):
            real, layout = self.real(k, len(idx))
            yield batch, len(idx), real, layout


class MapSource(IndexedSource):
    """A map-style dataset: epoch ``e``'s global order is ``randperm(N, seed + e)`` padded by wrap-around
    (or cut, with ``drop_last``) to whole global steps; rank ``r`` takes ``B`` rows of each step."""

    kind = "map"

    def __init__(self, *args: Any, reader: Any = None, **kwargs: Any):
        super().__init__(*args, reader=reader, **kwargs)
        self.size = len(self.reader)

    def global_order(self, epoch: int) -> torch.Tensor:
        n, total = self.size, self.num_batches() * self.world_size * self.batch_size
        if self.shuffle:
            perm = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed + epoch))
        else:
            perm = torch.arange(n)
        return perm[torch.arange(total) % n] if n else perm[:0]

    def rank_order(self, epoch: int) -> torch.Tensor:
        """``[batches, batch_size]``: this rank's dataset indices of each batch of ``epoch``."""
        return self.global_order(epoch).view(-1, self.world_size, self.batch_size)[:, self.rank]

    def batch_indices(self, epoch: int) -> list[list[int]]:
        return self.rank_order(epoch).tolist()

    def real(self, k: int, rows: int) -> tuple[int, str]:
        if self.drop_last:
            return rows, "blocked"
        start = k * self.world_size * self.batch_size + self.rank * self.batch_size
        return max(0, min(rows, self.size - start)), "blocked"


class RankAwareSource(IndexedSource):
    """A DataLoader whose sampler (or batch sampler) is already split by rank (``num_replicas``/``rank``):
    the sampler decides order and split; this source forwards ``set_epoch`` and loads its indices."""

    kind = "rank_aware"

    def __init__(self, *args: Any, sampler: Any, sampler_batches: bool, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.sampler, self.sampler_batches = sampler, sampler_batches

    def num_batches(self) -> int:
        n = len(self.sampler)
        if self.sampler_batches:
            return n
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    def state_seed(self) -> int:
        return int(getattr(self.sampler, "seed", self.seed))

    def restore_seed(self, seed: int, where: str) -> None:
        if hasattr(self.sampler, "seed") and self.sampler.seed != seed:
            raise ValueError(f"{where}: the checkpoint's seed {seed} differs from the sampler's "
                             f"seed {self.sampler.seed}")

    def batch_indices(self, epoch: int) -> list[list[int]]:
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)
        if self.sampler_batches:
            return [list(map(int, b)) for b in self.sampler]
        idx = [int(i) for i in self.sampler]
        b = self.batch_size
        batches = [idx[i:i + b] for i in range(0, len(idx), b)]
        if self.drop_last and batches and len(batches[-1]) < b:
            batches.pop()
        return batches

    def real(self, k: int, rows: int) -> tuple[int, str]:
        sampler = self.sampler
        if isinstance(sampler, DistributedSampler):
            if sampler.drop_last:
                return rows, "strided"
            n, w, r = len(sampler.dataset), self.world_size, self.rank
            local_real = (n - r + w - 1) // w if n > r else 0  # local l is global position l*W + r
            start = k * self.batch_size
            return max(0, min(rows, local_real - start)), "strided"
        return rows, "blocked"  # a custom rank-aware sampler: its padding is unknown
