"""Iterable datasets (streams) for ``ft.shard``: each rank reads its part, batches are padded to equal counts.

How rank ``r`` of ``W`` gets its part of a stream, in this order of preference:

* a Hugging Face ``datasets.IterableDataset``: ``datasets.distributed.
  split_dataset_by_node(dataset, rank=r, world_size=W)`` (whole shards per rank when
  ``num_shards`` is a multiple of ``W``, else every W-th example). A dataset already
  split that way is used as it is (its rank and world size must match). With
  DataLoader workers the dataset splits its part among them itself;
* functrain's own hook ``functrain_shard(index, count)``: an iterable of part
  ``index`` of ``count`` (disjoint parts that together are the dataset), reading only
  that part. With DataLoader workers the readers are ``(rank, worker)`` pairs: worker
  ``w`` of ``n`` on rank ``r`` iterates ``functrain_shard(r + W*w, W*n)``;
* otherwise items ``r, r+W, r+2W, ...`` of the whole stream (``itertools.islice``):
  correct, but every rank reads and discards the others' items. A ``shard`` method of
  another library is *not* called (its signature is unknown; Hugging Face's is
  ``shard(num_shards, index)``), and a warning says so.

``set_epoch(epoch)`` of the dataset is called before each epoch, also in persistent
DataLoader workers (the epoch reaches them through shared memory).
"""
from __future__ import annotations

import itertools
import warnings
from typing import Any, Iterable, Iterator

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from ..distributed import group as distributed
from ..distributed.comm import all_reduce_int
from .sources import Source

__all__ = ["IterableSource", "is_hf_iterable", "presplit"]

_END = object()
HOOK = "functrain_shard"


def is_hf_iterable(dataset: Any) -> bool:
    """Whether ``dataset`` is a Hugging Face ``datasets.IterableDataset`` (without importing ``datasets``
    for anything else)."""
    if type(dataset).__module__.split(".")[0] != "datasets":
        return False
    import datasets  # already imported: the dataset's class comes from it

    return isinstance(dataset, datasets.IterableDataset)


def presplit(dataset: Any) -> tuple[int, int] | None:
    """``(rank, world_size)`` of a Hugging Face iterable dataset already split by ``split_dataset_by_node``."""
    if not is_hf_iterable(dataset):
        return None
    config = getattr(dataset, "_distributed", None)  # set by split_dataset_by_node; datasets has no public getter
    if config is None:
        return None
    return int(config.rank), int(config.world_size)


def _identity(x: Any) -> Any:
    return x


def _part(dataset: Any, index: int, count: int) -> Iterable:
    """Part ``index`` of ``count`` of a non-Hugging-Face stream: its hook, else a strided slice."""
    if count == 1:
        return dataset
    hook = getattr(dataset, HOOK, None)
    if callable(hook):
        return hook(index, count)
    return itertools.islice(dataset, index, None, count)


class _RankReader(IterableDataset):
    """This rank's part of a stream, split further among DataLoader workers; the epoch lives in shared
    memory so that persistent workers see each new one."""

    def __init__(self, dataset: Any, rank: int, world_size: int):
        self.dataset, self.rank, self.world_size = dataset, rank, world_size
        self.epoch = torch.zeros((), dtype=torch.int64).share_memory_()

    def __iter__(self) -> Iterator:
        info = get_worker_info()
        if info is None:
            return iter(_part(self.dataset, self.rank, self.world_size))
        if hasattr(self.dataset, "set_epoch"):  # this worker's copy of the dataset
            self.dataset.set_epoch(int(self.epoch))
        # worker w reads rank-local items w, w+n, ...; the DataLoader's round robin restores their order
        return iter(_part(self.dataset, self.rank + self.world_size * info.id, self.world_size * info.num_workers))


class IterableSource(Source):
    """A stream: this rank's part (see the module docs), cut into batches, padded by wrapping around to the
    rank's own first items so that every rank yields the same number of full batches."""

    kind = "iterable"

    def __init__(self, *args: Any, already_split: bool = False, **kwargs: Any):
        super().__init__(*args, **kwargs)
        ds, w = self.dataset, self.world_size
        self.hf = is_hf_iterable(ds)
        self._loader: DataLoader | None = None
        if self.hf:
            if already_split or w == 1:
                self.part = ds
            else:
                from datasets.distributed import split_dataset_by_node

                self.part = split_dataset_by_node(ds, rank=self.rank, world_size=w)
            # whole shards per rank keep a rank-major order, one example in W interleaves the ranks ("auto"
            # picks shards when num_shards divides; for a dataset split before, only its part is known)
            config = getattr(self.part, "_distributed", None)
            if config is None or config.strategy == "examples":
                self.layout = "strided"
            elif config.strategy == "shards" or already_split:
                self.layout = "blocked"
            else:
                self.layout = "blocked" if ds.num_shards % w == 0 else "strided"
        else:
            self.part = None
            hook = callable(getattr(ds, HOOK, None))
            self.layout = "blocked" if w > 1 and hook else "strided"
            if w > 1 and not hook and callable(getattr(ds, "shard", None)):
                warnings.warn(f"shard: {type(ds).__name__} has a shard() method, which ft.shard does not call (its "
                              f"signature is not known); every rank reads the whole stream and keeps every "
                              f"{w}-th item. Define {HOOK}(index, count) to read only this rank's part",
                              stacklevel=5)

    def _stream(self, epoch: int) -> Iterator:
        ds = self.dataset
        if hasattr(ds, "set_epoch"):
            ds.set_epoch(epoch)
        if self.part is not None and self.part is not ds and hasattr(self.part, "set_epoch"):
            self.part.set_epoch(epoch)  # a split copy has its own epoch (shared with persistent workers)
        if not self.options.get("num_workers"):
            return iter(self.part if self.part is not None else _part(ds, self.rank, self.world_size))
        if self._loader is None:  # built once: persistent workers stay up between epochs
            reader = self.part if self.part is not None else _RankReader(ds, self.rank, self.world_size)
            self._loader = DataLoader(reader, batch_size=None, collate_fn=_identity, **self.options)
        if isinstance(self._loader.dataset, _RankReader):
            self._loader.dataset.epoch.fill_(epoch)
        return iter(self._loader)

    def _agree(self) -> bool:
        return (self.world_size > 1 and distributed.is_initialized()
                and dist.get_world_size() == self.world_size and dist.get_rank() == self.rank)

    def batches(self, epoch: int, start: int) -> Iterator[tuple[Any, int, int, str]]:
        b, n = self.batch_size, self.num_batches()
        it = self._stream(epoch)
        cache: list = []  # this rank's first items: the wrap-around padding
        done = False

        def pull() -> Any:
            nonlocal done
            if done:
                return _END
            try:
                x = next(it)
            except StopIteration:
                done = True
                return _END
            if len(cache) < b:
                cache.append(x)
            return x

        for _ in range(start * b):  # resuming: a stream cannot seek, so read and discard
            if pull() is _END:
                break
        agree = n is None and self._agree()
        pad = 0
        k = start
        while n is None or k < n:
            items = []
            while len(items) < b:
                x = pull()
                if x is _END:
                    break
                items.append(x)
            real = len(items)
            if n is None:
                if agree:
                    flag = all_reduce_int(int(real == b) if self.drop_last else real,
                                          dist.ReduceOp.MIN if self.drop_last else dist.ReduceOp.MAX)
                    if flag == 0:
                        return
                elif real == 0 or (self.drop_last and real < b):
                    return
            if real < b:
                if not cache:
                    size = f"{self.size} items" if self.size is not None else "an unknown number of items"
                    raise ValueError(f"ShardedLoader: rank {self.rank} of {self.world_size} got no samples of the "
                                     f"iterable dataset {type(self.dataset).__name__} ({size}) this epoch, so it "
                                     f"cannot pad its batch {k}: the dataset needs at least one item per rank")
                items += [cache[(pad + j) % len(cache)] for j in range(b - real)]
                pad += b - real
            yield self.collate_fn(items), b, real, self.layout
            k += 1
