"""Sharded data loading for data-parallel training: ``ft.shard`` and ``ft.gather_for_eval``.

``ft.shard(data, batch_size)`` wraps a map-style dataset, an iterable dataset or a
``torch.utils.data.DataLoader`` into a :class:`ShardedLoader`: an iterable of
batches for *this* rank that

* gives each rank a disjoint part of the data, all parts together covering it,
  in one order per epoch that every rank computes alone (no communication);
* has an exact ``len`` (batches per rank per epoch), the same on every rank,
  and full batches of ``batch_size`` rows on every rank (so a compiled step
  never sees a second shape);
* moves each (nested) batch to ``device`` with :func:`functrain.to_device`;
* has a position (``state_dict()`` / ``load_state_dict()``) that a checkpoint
  records, and resumes from it without loading the skipped samples.

:func:`gather_for_eval` collects per-batch evaluation results from all ranks
and removes the padding, so each sample is counted exactly once.

Map-style datasets (``len`` and ``__getitem__``)
------------------------------------------------
The global order of epoch ``e`` is ``torch.randperm(N, generator=
torch.Generator().manual_seed(seed + e))`` (``torch.arange(N)`` without
shuffling); it does not depend on the world size. With ``drop_last=False`` it is
padded by wrapping around to its start up to a multiple of ``world_size *
batch_size``; with ``drop_last=True`` the remainder (fewer than ``world_size *
batch_size`` samples, different ones each epoch when shuffling) is dropped. The
padded order is consumed in global steps of ``world_size * batch_size``
samples: in step ``k`` rank ``r`` takes positions ``[k*W*B + r*B, k*W*B +
(r+1)*B)``. So after ``k`` batches the ranks together have consumed exactly the
first ``k*W*B`` samples of the global order, which is what lets a checkpoint
resume on another world size. Padding only occurs in the last step.

Iterable datasets (``torch.utils.data.IterableDataset``, or any re-iterable without ``__getitem__``)
---------------------------------------------------------------------------------------------------
Before each epoch ``dataset.set_epoch(epoch)`` is called if it exists (so a
dataset can shuffle its stream the same way on every rank). Then:

* **The ``shard`` hook.** If the dataset has a method ``shard(index, count)``,
  rank ``r`` of ``W`` iterates ``dataset.shard(r, W)`` only: the hook returns an
  iterable of the items of part ``index`` of ``count`` (disjoint parts that
  together are the dataset), reading only that part (e.g. its own files). With
  DataLoader workers the readers are ``(rank, worker)`` pairs: worker ``w`` of
  ``n`` on rank ``r`` iterates ``dataset.shard(r + W*w, W*n)``.
* **Otherwise** rank ``r`` takes items ``r, r+W, r+2W, ...`` with
  ``itertools.islice``: correct, but every rank *reads* (and discards) the
  whole stream; implement ``shard`` for large data.

Equal batch counts: if the dataset has ``__len__`` (``N`` items) every rank yields
exactly ``ceil(N / (W*B))`` batches (``N // (W*B)`` with ``drop_last``), padding
its last batches by wrapping around to its own first items. Without ``__len__``,
``len(loader)`` raises ``TypeError``; in a process group of ``W`` ranks the ranks
agree after every batch (one all-reduce of one integer) to stop together: with
``drop_last`` when any rank has no full batch left, otherwise when no rank has a
sample left (ranks that ran out pad). Without a process group (ranks simulated
with ``rank=``/``world_size=``) each rank stops at the end of its own part, so
counts may then differ by one. Resuming an iterable reads and discards the
consumed items (streams cannot seek); shuffling must be done by the dataset
(``shuffle=True`` is an error).

DataLoaders
-----------
``ft.shard(loader)`` reuses the loader's dataset, ``batch_size``, ``collate_fn``,
``drop_last``, ``num_workers``, ``pin_memory``, ``timeout``, ``worker_init_fn``,
``multiprocessing_context`` and ``prefetch_factor`` (arguments given to
``ft.shard`` win), and shuffles iff its sampler is a ``RandomSampler`` (replaced
by the seeded permutation above). A loader whose sampler (or batch sampler) is
already rank-aware -- a ``DistributedSampler``, or anything with ``num_replicas``
and ``rank`` attributes -- is *not* split again: the sampler decides the order
and the split, ``ft.shard`` forwards ``set_epoch`` to it, places batches on the
device and tracks the position (it reads the sampler's indices, which loads no
data, so resuming is still free). Other samplers are refused: they cannot be
split consistently.

Position
--------
``state_dict()`` is ``{"epoch", "batch", "seed", "samples", "world_size",
"batch_size"}`` (plain ints): ``batch`` batches of epoch ``epoch`` have been
yielded on each rank, which is ``samples = batch * world_size * batch_size``
global samples. A batch counts as consumed when it is yielded, so a state saved
after training on it resumes with the next one; yielding the last batch of an
epoch moves the position to ``(epoch + 1, 0)``, so epochs advance (and the
shuffle changes) without calling ``set_epoch``. ``iter(loader)`` always starts at
the current position (one iterator at a time). ``load_state_dict`` on the same
world size and batch size resumes at ``batch``; on another one it resumes at
global sample ``samples``, i.e. at batch ``samples // (world_size *
batch_size)`` of the new configuration (when that does not divide, the samples
since the rounded-down position are seen again, with a warning).
"""
from __future__ import annotations

import itertools
import math
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.distributed as dist
from torch.utils.data import (BatchSampler, DataLoader, IterableDataset, RandomSampler, SequentialSampler,
                              default_collate, default_convert, get_worker_info)
from torch.utils.data.distributed import DistributedSampler

from . import group as distributed
from ..driver import to_device

__all__ = ["ShardedLoader", "shard"]

_END = object()


def _check_int(where: str, name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{where}: {name} must be an int >= {minimum}; got {value!r}")
    return value


def _rank_aware(obj: Any) -> bool:
    return obj is not None and hasattr(obj, "num_replicas") and hasattr(obj, "rank")


def _identity(x: Any) -> Any:
    return x


def _part(dataset: Any, index: int, count: int) -> Iterable:
    """Part ``index`` of ``count`` of an iterable dataset: its ``shard`` hook, else a strided slice."""
    if count == 1:
        return dataset
    hook = getattr(dataset, "shard", None)
    if callable(hook):
        return hook(index, count)
    return itertools.islice(dataset, index, None, count)


class _RankReader(IterableDataset):
    """This rank's part of an iterable dataset, split further among DataLoader workers."""

    def __init__(self, dataset: Any, rank: int, world_size: int):
        self.dataset, self.rank, self.world_size = dataset, rank, world_size

    def __iter__(self) -> Iterator:
        info = get_worker_info()
        if info is None:
            return iter(_part(self.dataset, self.rank, self.world_size))
        # worker w reads rank-local items w, w+n, ...; the DataLoader's round robin restores their order
        return iter(_part(self.dataset, self.rank + self.world_size * info.id, self.world_size * info.num_workers))


@dataclass(frozen=True)
class _BatchInfo:
    """What :func:`gather_for_eval` needs about the batch a rank yielded last."""

    epoch: int
    batch: int
    rows: int      # rows in the batch on this rank
    real: int      # the first `real` rows are samples; the rest is wrap-around padding
    layout: str    # "blocked": rank r's rows follow rank r-1's; "strided": row l of rank r is at l*W + r


class ShardedLoader:
    """This rank's batches of a dataset or DataLoader; see :func:`shard` (which makes one) and the module docs.

    Attributes: ``dataset``, ``batch_size``, ``rank``, ``world_size``, ``shuffle``,
    ``drop_last``, ``seed``, ``device``, ``collate_fn``, ``epoch`` and ``batch`` (the
    position), ``kind`` (``"map"``, ``"iterable"`` or ``"rank_aware"``).
    """

    def __init__(self, data: Any, batch_size: int | None = None, *, shuffle: bool | None = None, seed: int = 0,
                 drop_last: bool | None = None, rank: int | None = None, world_size: int | None = None,
                 device: torch.device | str | None = None, collate_fn: Callable | None = None):
        where = "shard"
        loader = data if isinstance(data, DataLoader) else None
        dataset = loader.dataset if loader is not None else data
        if dataset is None:
            raise TypeError(f"{where}: expected a dataset or a DataLoader; got None")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"{where}: seed must be an int; got {seed!r}")
        if world_size is not None:
            _check_int(where, "world_size", world_size, 1)
        if rank is not None:
            _check_int(where, "rank", rank, 0)

        self._sampler: Any = None          # a rank-aware sampler, or batch sampler
        self._sampler_batches = False      # whether _sampler yields batches of indices
        if loader is not None and _rank_aware(loader.sampler):
            self._sampler = loader.sampler
        elif loader is not None and _rank_aware(loader.batch_sampler):
            self._sampler, self._sampler_batches = loader.batch_sampler, True

        if self._sampler is not None:
            self.kind = "rank_aware"
            s_world, s_rank = int(self._sampler.num_replicas), int(self._sampler.rank)
            if world_size is not None and world_size != s_world:
                raise ValueError(f"{where}: world_size={world_size} does not match the DataLoader's rank-aware "
                                 f"{type(self._sampler).__name__} (num_replicas={s_world}); it is already split")
            if rank is not None and rank != s_rank:
                raise ValueError(f"{where}: rank={rank} does not match the DataLoader's rank-aware "
                                 f"{type(self._sampler).__name__} (rank={s_rank})")
            if shuffle is not None:
                raise ValueError(f"{where}: shuffle={shuffle!r} given, but the DataLoader's rank-aware "
                                 f"{type(self._sampler).__name__} decides the order; leave shuffle unset")
            world_size, rank = s_world, s_rank
        else:
            if world_size is None:
                world_size = distributed.world_size()
            if rank is None:
                rank = distributed.rank()
            is_map = (not isinstance(dataset, IterableDataset) and hasattr(dataset, "__getitem__")
                      and hasattr(dataset, "__len__"))
            self.kind = "map" if is_map else "iterable"
            if not is_map and not isinstance(dataset, Iterable):
                raise TypeError(f"{where}: {type(dataset).__name__} is neither a map-style dataset (__len__ and "
                                f"__getitem__) nor iterable")
        if not 0 <= rank < world_size:
            raise ValueError(f"{where}: rank={rank} is out of range for world_size={world_size} "
                             f"(0 <= rank < world_size)")

        if self._sampler_batches:  # the rank-aware batch sampler makes the batches
            if batch_size is not None:
                raise ValueError(f"{where}: batch_size={batch_size!r} given, but the DataLoader's rank-aware batch "
                                 f"sampler {type(self._sampler).__name__} makes the batches; leave it unset")
            batch_size = getattr(self._sampler, "batch_size", None)
        else:
            if batch_size is None:
                batch_size = loader.batch_size if loader is not None else None
                if batch_size is None:
                    raise ValueError(f"{where}: batch_size is required (the DataLoader has batch_size=None)"
                                     if loader is not None else f"{where}: batch_size is required")
            _check_int(where, "batch_size", batch_size, 1)

        if loader is not None and self.kind == "map":
            if loader.batch_sampler is not None and type(loader.batch_sampler) is not BatchSampler:
                raise TypeError(f"{where}: cannot split the DataLoader's custom batch_sampler "
                                f"{type(loader.batch_sampler).__name__}: give it num_replicas/rank attributes "
                                f"(rank-aware) or pass the dataset")
            sampler = loader.sampler
            if isinstance(sampler, RandomSampler):
                if sampler.replacement or sampler._num_samples is not None:
                    raise TypeError(f"{where}: cannot split a RandomSampler with replacement or num_samples; "
                                    f"use a rank-aware sampler")
            elif not isinstance(sampler, SequentialSampler):
                raise TypeError(f"{where}: cannot split the DataLoader's sampler {type(sampler).__name__}: give it "
                                f"num_replicas/rank attributes (rank-aware) or pass the dataset")
            if shuffle is None:
                shuffle = isinstance(sampler, RandomSampler)
        if self.kind == "iterable":
            if shuffle:
                raise ValueError(f"{where}: shuffle=True for an iterable dataset: a stream cannot be shuffled here; "
                                 f"shuffle it in the dataset (set_epoch(epoch) is called before each epoch)")
            shuffle = False
        if drop_last is None:
            drop_last = bool(loader.drop_last) if loader is not None else False
        if collate_fn is None:
            collate_fn = loader.collate_fn if loader is not None else default_collate
            if collate_fn is default_convert and batch_size is not None:  # a loader built with batch_size=None
                collate_fn = default_collate

        self.dataset = dataset
        self.batch_size = batch_size
        self.rank, self.world_size = rank, world_size
        if self.kind == "rank_aware":
            shuffle = getattr(self._sampler, "shuffle", None)
        self.shuffle = bool(shuffle) if shuffle is not None else True
        self.drop_last = bool(drop_last)
        self.seed = seed
        self.device = torch.device(device) if device is not None else None
        self.collate_fn = collate_fn
        self.epoch = 0
        self.batch = 0
        self._last: _BatchInfo | None = None
        self._workers: dict = {"num_workers": 0}
        if loader is not None:
            self._workers = {"num_workers": loader.num_workers, "pin_memory": loader.pin_memory,
                             "timeout": loader.timeout, "worker_init_fn": loader.worker_init_fn,
                             "multiprocessing_context": loader.multiprocessing_context}
            if loader.num_workers > 0:
                self._workers["prefetch_factor"] = loader.prefetch_factor
        self._n = self._dataset_len()

    # ---- sizes -------------------------------------------------------------------------------------------------
    def _dataset_len(self) -> int | None:
        try:
            return len(self.dataset)
        except TypeError:
            return None

    def _num_batches(self) -> int | None:
        if self.kind == "rank_aware":
            n = len(self._sampler)
            if self._sampler_batches:
                return n
            return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)
        if self._n is None:
            return None
        per = self.world_size * self.batch_size
        return self._n // per if self.drop_last else math.ceil(self._n / per)

    def __len__(self) -> int:
        """Batches per rank in one epoch (the same on every rank); ``TypeError`` for an iterable without ``len``."""
        n = self._num_batches()
        if n is None:
            raise TypeError(f"ShardedLoader: the iterable dataset {type(self.dataset).__name__} has no __len__, "
                            f"so the number of batches is unknown")
        return n

    # ---- order -------------------------------------------------------------------------------------------------
    def global_order(self, epoch: int | None = None) -> torch.Tensor:
        """Map-style only: the padded global order of ``epoch`` (default: the current one), on every rank the same.

        ``len(self) * world_size * batch_size`` dataset indices; rank ``r``'s batch ``k`` is
        ``order[k*W*B + r*B : k*W*B + (r+1)*B]``. Positions ``>= len(dataset)`` are wrap-around padding.
        """
        if self.kind != "map":
            raise TypeError(f"ShardedLoader.global_order: only for map-style datasets (this one is {self.kind})")
        epoch = self.epoch if epoch is None else epoch
        n, total = self._n, len(self) * self.world_size * self.batch_size
        if self.shuffle:
            perm = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed + epoch))
        else:
            perm = torch.arange(n)
        return perm[torch.arange(total) % n] if n else perm[:0]

    def batch_indices(self, epoch: int | None = None) -> list[list[int]]:
        """This rank's dataset indices of each batch of ``epoch`` (default: the current one); loads no data.

        For a rank-aware sampler this calls its ``set_epoch(epoch)``. ``TypeError`` for an iterable dataset.
        """
        epoch = self.epoch if epoch is None else epoch
        if self.kind == "map":
            order = self.global_order(epoch).view(-1, self.world_size, self.batch_size)[:, self.rank]
            return order.tolist()
        if self.kind == "rank_aware":
            if hasattr(self._sampler, "set_epoch"):
                self._sampler.set_epoch(epoch)
            if self._sampler_batches:
                return [list(map(int, b)) for b in self._sampler]
            idx = [int(i) for i in self._sampler]
            b = self.batch_size
            batches = [idx[i:i + b] for i in range(0, len(idx), b)]
            if self.drop_last and batches and len(batches[-1]) < b:
                batches.pop()
            return batches
        raise TypeError("ShardedLoader.batch_indices: an iterable dataset has no indices")

    def _real(self, k: int, rows: int) -> tuple[int, str]:
        """How many leading rows of this rank's batch ``k`` are samples (not padding), and the layout."""
        if self.kind == "map":
            if self.drop_last:
                return rows, "blocked"
            start = k * self.world_size * self.batch_size + self.rank * self.batch_size
            return max(0, min(rows, self._n - start)), "blocked"
        sampler = self._sampler
        if isinstance(sampler, DistributedSampler):
            if sampler.drop_last:
                return rows, "strided"
            n, w, r = len(sampler.dataset), self.world_size, self.rank
            local_real = (n - r + w - 1) // w if n > r else 0  # local l is global position l*W + r
            start = k * self.batch_size
            return max(0, min(rows, local_real - start)), "strided"
        return rows, "blocked"  # a custom rank-aware sampler: its padding is unknown

    # ---- iteration ---------------------------------------------------------------------------------------------
    def __iter__(self) -> Iterator:
        epoch, start = self.epoch, self.batch
        n = self._num_batches()
        gen = self._iter_stream(epoch, start, n) if self.kind == "iterable" else self._iter_indexed(epoch, start)
        k = start
        for batch, rows, real, layout in gen:
            self._last = _BatchInfo(epoch, k, rows, real, layout)
            if n is not None and k >= n - 1:
                self.epoch, self.batch = epoch + 1, 0
            else:
                self.epoch, self.batch = epoch, k + 1
            k += 1
            yield to_device(batch, self.device) if self.device is not None else batch
        if n is None and self.epoch == epoch:  # an iterable of unknown length ended: the next epoch begins
            self.epoch, self.batch = epoch + 1, 0

    def _iter_indexed(self, epoch: int, start: int) -> Iterator:
        batches = self.batch_indices(epoch)[start:]
        if not batches:
            return
        loader = DataLoader(self.dataset, batch_sampler=batches, collate_fn=self.collate_fn, **self._workers)
        for k, (idx, batch) in enumerate(zip(batches, loader), start):
            real, layout = self._real(k, len(idx))
            yield batch, len(idx), real, layout

    def _stream(self, epoch: int) -> Iterator:
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)
        if self._workers["num_workers"] == 0:
            return iter(_part(self.dataset, self.rank, self.world_size))
        reader = _RankReader(self.dataset, self.rank, self.world_size)
        return iter(DataLoader(reader, batch_size=None, collate_fn=_identity, **self._workers))

    def _agree(self) -> bool:
        return (self.world_size > 1 and distributed.is_initialized()
                and dist.get_world_size() == self.world_size and dist.get_rank() == self.rank)

    def _iter_stream(self, epoch: int, start: int, n: int | None) -> Iterator:
        b = self.batch_size
        layout = "blocked" if self.world_size > 1 and callable(getattr(self.dataset, "shard", None)) else "strided"
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
                    flag = _all_reduce_int(int(real == b) if self.drop_last else real,
                                           dist.ReduceOp.MIN if self.drop_last else dist.ReduceOp.MAX)
                    if flag == 0:
                        return
                elif real == 0 or (self.drop_last and real < b):
                    return
            if real < b:
                if not cache:
                    raise ValueError(f"ShardedLoader: rank {self.rank} of {self.world_size} got no samples of the "
                                     f"iterable dataset this epoch, so it cannot pad its batch {k}")
                items += [cache[(pad + j) % len(cache)] for j in range(b - real)]
                pad += b - real
            yield self.collate_fn(items), b, real, layout
            k += 1

    # ---- position ----------------------------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` from its first batch (the shuffle order is that of ``seed + epoch``)."""
        self.epoch, self.batch = _check_int("ShardedLoader.set_epoch", "epoch", epoch, 0), 0

    def state_dict(self) -> dict:
        """The position, as plain ints: ``epoch``, ``batch`` (yielded this epoch, per rank), ``seed``,
        ``samples`` (global samples consumed this epoch), ``world_size``, ``batch_size``."""
        seed = int(getattr(self._sampler, "seed", self.seed)) if self._sampler is not None else self.seed
        bs = self.batch_size or 0
        return {"epoch": self.epoch, "batch": self.batch, "seed": seed, "samples": self.batch * self.world_size * bs,
                "world_size": self.world_size, "batch_size": bs}

    def load_state_dict(self, state: dict) -> None:
        """Resume at a position from :meth:`state_dict`; nothing is loaded until iteration, and then only
        the batches from that position on (map-style and rank-aware; iterables read and discard).

        The same ``world_size`` and ``batch_size`` resume at ``batch``; another one resumes at the
        global sample ``samples`` (see the module docs). The ``seed`` is restored too.
        """
        where = "ShardedLoader.load_state_dict"
        for key in ("epoch", "batch", "seed", "samples"):
            if key not in state:
                raise ValueError(f"{where}: the state has no {key!r} (keys: {sorted(state)})")
        epoch = _check_int(where, "epoch", state["epoch"], 0)
        batch = _check_int(where, "batch", state["batch"], 0)
        samples = _check_int(where, "samples", state["samples"], 0)
        if isinstance(state["seed"], bool) or not isinstance(state["seed"], int):
            raise ValueError(f"{where}: seed must be an int; got {state['seed']!r}")
        if self._sampler is not None:
            if hasattr(self._sampler, "seed") and self._sampler.seed != state["seed"]:
                raise ValueError(f"{where}: the checkpoint's seed {state['seed']} differs from the sampler's "
                                 f"seed {self._sampler.seed}")
        else:
            self.seed = state["seed"]
        same = state.get("world_size") == self.world_size and state.get("batch_size") == self.batch_size
        if not same:
            per = self.world_size * self.batch_size
            batch = samples // per
            if samples % per:
                warnings.warn(f"{where}: {samples} global samples consumed is not a multiple of world_size * "
                              f"batch_size = {per}; resuming at sample {batch * per}, so {samples % per} samples "
                              f"are seen again", stacklevel=2)
        n = self._num_batches()
        if n is not None and batch >= n:
            if same and batch > n:
                raise ValueError(f"{where}: batch {batch} is past the end of the epoch ({n} batches per rank)")
            epoch, batch = epoch + 1, 0
        self.epoch, self.batch = epoch, batch

    def __repr__(self) -> str:
        return (f"ShardedLoader({self.kind}, batch_size={self.batch_size}, rank={self.rank}/{self.world_size}, "
                f"shuffle={self.shuffle}, drop_last={self.drop_last}, seed={self.seed}, epoch={self.epoch}, "
                f"batch={self.batch})")


def shard(data: Any, batch_size: int | None = None, *, shuffle: bool | None = None, seed: int = 0,
          drop_last: bool | None = None, rank: int | None = None, world_size: int | None = None,
          device: torch.device | str | None = None, collate_fn: Callable | None = None) -> ShardedLoader:
    """This rank's batches of ``data`` (a map-style dataset, an iterable dataset or a DataLoader).

    * ``batch_size``: rows per batch *per rank* (default: the DataLoader's).
    * ``shuffle``: default ``True`` for a dataset, the DataLoader's choice for a DataLoader,
      ``False`` (and only ``False``) for an iterable dataset. The order of epoch ``e`` is
      ``torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed + e))``.
    * ``drop_last``: ``False`` (default for a dataset) pads the last global step by wrapping
      around to the start of the epoch's order, so every batch on every rank has
      ``batch_size`` rows; ``True`` drops the remainder. Default for a DataLoader: its own.
    * ``rank``/``world_size``: default from the process group (``ft.distributed``);
      pass them to shard over a sub-group or to simulate ranks in one process.
    * ``device``: move every tensor of each (nested) batch there (default: leave it).
    * ``collate_fn``: default the DataLoader's, else ``torch.utils.data.default_collate``.

    The result has an exact ``len`` (batches per rank per epoch, equal on all ranks), a
    position (``state_dict``/``load_state_dict``, ``set_epoch``) and advances the epoch
    by itself after its last batch. See the module docs for iterable datasets (the
    ``shard(index, count)`` hook), rank-aware samplers and resuming.

    Example::

        loader = ft.shard(train_set, batch_size=32, device="cuda")   # after ft.distributed.init()
        loader.load_state_dict(checkpoint["data"])                   # resume: skips without loading
        for batch in loader:
            state, metrics = step(state, batch)
        checkpoint["data"] = loader.state_dict()
    """
    return ShardedLoader(data, batch_size, shuffle=shuffle, seed=seed, drop_last=drop_last, rank=rank,
                         world_size=world_size, device=device, collate_fn=collate_fn)


# ---- evaluation -----------------------------------------------------------------------------------------------
def _comm_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _all_reduce_int(value: int, op: Any) -> int:
    t = torch.tensor([value], dtype=torch.int64, device=_comm_device())
    dist.all_reduce(t, op=op)
    return int(t.item())

