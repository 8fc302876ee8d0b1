"""Sharded data loading for data-parallel training: ``ft.shard`` and :class:`ShardedLoader`.

``ft.shard(data, batch_size)`` wraps a map-style dataset, in-memory columns (a
``TensorDataset``, a tuple or dict of tensors / numpy arrays), an iterable dataset
(also a Hugging Face ``datasets`` one) or a ``torch.utils.data.DataLoader`` into a
:class:`ShardedLoader`: an iterable of batches for *this* rank that

* gives each rank a disjoint part of the data, all parts together covering it,
  in one order per epoch that every rank computes alone (no communication);
* has an exact ``len`` (batches per rank per epoch), the same on every rank,
  and full batches of ``batch_size`` rows on every rank (so a compiled step
  never sees a second shape);
* moves each (nested) batch to ``device`` with :func:`functrain.to_device`;
* has a position (``state_dict()`` / ``load_state_dict()``) that a checkpoint
  records, and resumes from it without loading the skipped samples.

``ft.gather_for_eval`` (:mod:`.gather`) collects per-batch evaluation results
from all ranks and removes the padding, reading :attr:`ShardedLoader.last_batch_info`.

The loader owns the position; where the batches come from is one of three
strategies (:mod:`.sources`, :mod:`.arrays`, :mod:`.streams`).

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

In-memory columns (a ``TensorDataset``, a tuple/namedtuple or dict of tensors or
numpy arrays with equal first dimensions) follow exactly this order, but each
batch is one ``index_select`` per column instead of a per-sample collate (the same
tensors bit for bit; see :mod:`.arrays`). A ``collate_fn`` of your own, or a
DataLoader with workers, loads them sample by sample instead.

Iterable datasets (``torch.utils.data.IterableDataset``, or any re-iterable without ``__getitem__``)
---------------------------------------------------------------------------------------------------
Before each epoch ``dataset.set_epoch(epoch)`` is called if it exists (so a
dataset can shuffle its stream the same way on every rank). Each rank reads its
part (:mod:`.streams`): a Hugging Face ``datasets.IterableDataset`` through
``split_dataset_by_node``; a dataset with functrain's hook ``functrain_shard(index,
count)`` through it (the hook returns an iterable of the items of part ``index`` of
``count``, reading only that part, e.g. its own files; with DataLoader workers
worker ``w`` of ``n`` on rank ``r`` iterates ``functrain_shard(r + W*w, W*n)``);
otherwise rank ``r`` takes items ``r, r+W, r+2W, ...`` with ``itertools.islice``:
correct, but every rank *reads* (and discards) the whole stream.

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
``drop_last`` and its loading options: ``num_workers``, ``persistent_workers``,
``pin_memory``, ``pin_memory_device``, ``prefetch_factor``, ``timeout``,
``worker_init_fn``, ``multiprocessing_context``, ``generator`` and ``in_order``
(arguments given to ``ft.shard`` win). One DataLoader is built and reused every
epoch, so ``persistent_workers=True`` keeps its workers between epochs. It shuffles
iff the loader's sampler is a ``RandomSampler`` (replaced by the seeded permutation
above). A loader whose sampler (or batch sampler) is already rank-aware -- a
``DistributedSampler``, or anything with ``num_replicas`` and ``rank`` attributes
-- is *not* split again: the sampler decides the order and the split, ``ft.shard``
forwards ``set_epoch`` to it, places batches on the device and tracks the position
(it reads the sampler's indices, which loads no data, so resuming is still free).
Other samplers are refused: they cannot be split consistently.

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

import warnings
from typing import Any, Callable, Iterable, Iterator

import torch
from torch.utils.data import (BatchSampler, DataLoader, IterableDataset, RandomSampler, SequentialSampler,
                              TensorDataset, default_collate, default_convert)

from ..distributed import group as distributed
from ..core.validate import check_int
from ..driver import to_device
from .arrays import ArraySource, as_columns
from .sources import BatchInfo, MapSource, RankAwareSource, Source, loader_options
from .streams import IterableSource, presplit

__all__ = ["ShardedLoader", "shard", "BatchInfo"]

_WHERE = "shard"


def _rank_aware(obj: Any) -> bool:
    return obj is not None and hasattr(obj, "num_replicas") and hasattr(obj, "rank")


def _check_given(what: str, given: int | None, actual: int, owner: str) -> None:
    if given is not None and given != actual:
        raise ValueError(f"{_WHERE}: {what}={given} does not match {owner}")


def _build_source(data: Any, batch_size: int | None, shuffle: bool | None, seed: int, drop_last: bool | None,
                  rank: int | None, world_size: int | None, collate_fn: Callable | None) -> Source:
    """Resolve the arguments against the DataLoader (if any) and pick the strategy for ``data``."""
    loader = data if isinstance(data, DataLoader) else None
    dataset = loader.dataset if loader is not None else data
    if dataset is None:
        raise TypeError(f"{_WHERE}: expected a dataset or a DataLoader; got None")
    check_int(f"{_WHERE}: seed", seed)
    if world_size is not None:
        check_int(f"{_WHERE}: world_size", world_size, minimum=1)
    if rank is not None:
        check_int(f"{_WHERE}: rank", rank, minimum=0)

    sampler, sampler_batches = None, False  # a rank-aware sampler, or batch sampler
    if loader is not None and _rank_aware(loader.sampler):
        sampler = loader.sampler
    elif loader is not None and _rank_aware(loader.batch_sampler):
        sampler, sampler_batches = loader.batch_sampler, True
    split = presplit(dataset)

    if sampler is not None:
        kind = "rank_aware"
        name, s_world, s_rank = type(sampler).__name__, int(sampler.num_replicas), int(sampler.rank)
        _check_given("world_size", world_size, s_world,
                     f"the DataLoader's rank-aware {name} (num_replicas={s_world}); it is already split")
        _check_given("rank", rank, s_rank, f"the DataLoader's rank-aware {name} (rank={s_rank})")
        if shuffle is not None:
            raise ValueError(f"{_WHERE}: shuffle={shuffle!r} given, but the DataLoader's rank-aware "
                             f"{name} decides the order; leave shuffle unset")
        world_size, rank = s_world, s_rank
    elif split is not None:  # a Hugging Face stream already split by split_dataset_by_node
        kind = "iterable"
        owner = "the dataset's split_dataset_by_node(rank={}, world_size={}); it is already split".format(*split)
        _check_given("world_size", world_size, split[1], owner)
        _check_given("rank", rank, split[0], owner)
        rank, world_size = split
    else:
        world_size = distributed.world_size() if world_size is None else world_size
        rank = distributed.rank() if rank is None else rank
        is_map = (not isinstance(dataset, IterableDataset) and hasattr(dataset, "__getitem__")
                  and hasattr(dataset, "__len__"))
        kind = "map" if is_map else "iterable"
        if not is_map and not isinstance(dataset, Iterable):
            raise TypeError(f"{_WHERE}: {type(dataset).__name__} is neither a map-style dataset (__len__ and "
                            f"__getitem__) nor iterable")
    if not 0 <= rank < world_size:
        raise ValueError(f"{_WHERE}: rank={rank} is out of range for world_size={world_size} "
                         f"(0 <= rank < world_size)")

    if sampler_batches:  # the rank-aware batch sampler makes the batches
        if batch_size is not None:
            raise ValueError(f"{_WHERE}: batch_size={batch_size!r} given, but the DataLoader's rank-aware batch "
                             f"sampler {type(sampler).__name__} makes the batches; leave it unset")
        batch_size = getattr(sampler, "batch_size", None)
    else:
        if batch_size is None:
            batch_size = loader.batch_size if loader is not None else None
            if batch_size is None:
                raise ValueError(f"{_WHERE}: batch_size is required (the DataLoader has batch_size=None)"
                                 if loader is not None else f"{_WHERE}: batch_size is required")
        batch_size = check_int(f"{_WHERE}: batch_size", batch_size, minimum=1)

    if loader is not None and kind == "map":
        if loader.batch_sampler is not None and type(loader.batch_sampler) is not BatchSampler:
            raise TypeError(f"{_WHERE}: cannot split the DataLoader's custom batch_sampler "
                            f"{type(loader.batch_sampler).__name__}: give it num_replicas/rank attributes "
                            f"(rank-aware) or pass the dataset")
        s = loader.sampler
        if isinstance(s, RandomSampler):
            if s.replacement or s._num_samples is not None:
                raise TypeError(f"{_WHERE}: cannot split a RandomSampler with replacement or num_samples; "
                                f"use a rank-aware sampler")
        elif not isinstance(s, SequentialSampler):
            raise TypeError(f"{_WHERE}: cannot split the DataLoader's sampler {type(s).__name__}: give it "
                            f"num_replicas/rank attributes (rank-aware) or pass the dataset")
        if shuffle is None:
            shuffle = isinstance(s, RandomSampler)
    if kind == "iterable":
        if shuffle:
            raise ValueError(f"{_WHERE}: shuffle=True for an iterable dataset: a stream cannot be shuffled here; "
                             f"shuffle it in the dataset (set_epoch(epoch) is called before each epoch)")
        shuffle = False
    if kind == "rank_aware":
        shuffle = getattr(sampler, "shuffle", None)
    shuffle = bool(shuffle) if shuffle is not None else True
    drop_last = bool(loader.drop_last if drop_last is None and loader is not None else drop_last)
    own_collate = collate_fn is not None or (loader is not None and loader.collate_fn not in
                                             (default_collate, default_convert))
    if collate_fn is None:
        collate_fn = loader.collate_fn if loader is not None else default_collate
        if collate_fn is default_convert and batch_size is not None:  # a loader built with batch_size=None
            collate_fn = default_collate
    options = loader_options(loader)
    if options.get("num_workers") and options.get("in_order") is False:
        raise ValueError(f"{_WHERE}: the DataLoader has in_order=False, so its workers' batches arrive in any "
                         f"order; ft.shard tracks the position and the padding of each batch and needs "
                         f"in_order=True (the default)")

    args = (dataset, batch_size, rank, world_size, shuffle, drop_last, seed, collate_fn, options)
    if kind == "rank_aware":
        return RankAwareSource(*args, sampler=sampler, sampler_batches=sampler_batches)
    if kind == "iterable":
        return IterableSource(*args, already_split=split is not None)
    columns = as_columns(dataset)
    if columns is None:
        return MapSource(*args)
    if collate_fn is default_collate and not own_collate and not options.get("num_workers"):
        return ArraySource(*args, reader=columns, pin_memory=bool(options.get("pin_memory")))
    # your own collate_fn, or workers: sample by sample (a TensorDataset reads its own items)
    return MapSource(*args, reader=None if isinstance(dataset, TensorDataset) else columns)


class ShardedLoader:
    """This rank's batches of a dataset or DataLoader; :func:`shard` makes one (see the module docs).

    Args:
        data, batch_size, shuffle, seed, drop_last, rank, world_size, device, collate_fn: as :func:`shard`
            takes them (its Args say each, with its default).

    Attributes:
        dataset, batch_size, rank, world_size, shuffle, drop_last, seed, collate_fn: the
            configuration (read-only properties).
        kind: ``"map"``, ``"iterable"`` or ``"rank_aware"``.
        loader_options: the DataLoader options used to load (``num_workers``, ...).
        device: where batches are moved, or ``None``.
        epoch, batch: the position: the batch of ``epoch`` to yield next.
        last_batch_info: the :class:`~functrain.data.BatchInfo` of the batch yielded last.

    Raises:
        TypeError, ValueError: a ``data`` of no supported kind, or an option it does not allow
            (e.g. ``shuffle=True`` for an iterable dataset), naming it.

    Example::

        >>> import torch
        >>> from functrain.data import ShardedLoader
        >>> loader = ShardedLoader(torch.arange(5.0), 2, shuffle=False, rank=0, world_size=1)
        >>> [b.tolist() for b in loader], loader.last_batch_info.real   # the last batch wraps around
        ([[0.0, 1.0], [2.0, 3.0], [4.0, 0.0]], 1)
    """

    def __init__(self, data: Any, batch_size: int | None = None, *, shuffle: bool | None = None, seed: int = 0,
                 drop_last: bool | None = None, rank: int | None = None, world_size: int | None = None,
                 device: torch.device | str | None = None, collate_fn: Callable | None = None):
        self._source = _build_source(data, batch_size, shuffle, seed, drop_last, rank, world_size, collate_fn)
        self.device = torch.device(device) if device is not None else None
        self.epoch = 0
        self.batch = 0
        self._last: BatchInfo | None = None
        self._warned_empty = False

    # ---- configuration (the strategy's) --------------------------------------------------------------------
    dataset = property(lambda self: self._source.dataset, doc="The dataset (a DataLoader's dataset).")
    batch_size = property(lambda self: self._source.batch_size, doc="Rows per batch on each rank.")
    rank = property(lambda self: self._source.rank, doc="This rank.")
    world_size = property(lambda self: self._source.world_size, doc="The number of ranks the data is split over.")
    shuffle = property(lambda self: self._source.shuffle, doc="Whether each epoch has its own order.")
    drop_last = property(lambda self: self._source.drop_last, doc="Whether the remainder is dropped (else padded).")
    seed = property(lambda self: self._source.state_seed(), doc="The shuffle seed (epoch e uses seed + e).")
    collate_fn = property(lambda self: self._source.collate_fn, doc="How samples become a batch.")
    kind = property(lambda self: self._source.kind, doc='"map", "iterable" or "rank_aware".')

    @property
    def loader_options(self) -> dict:
        """The DataLoader options used to load (``num_workers``, ``persistent_workers``, ``pin_memory``, ...)."""
        return dict(self._source.options)

    @property
    def last_batch_info(self) -> BatchInfo | None:
        """Which samples the batch yielded last holds (rows, real rows, layout), ``None`` before the first.

        Example::

            batch = next(iter(loader))
            loader.last_batch_info.real   # rows of this batch that are samples, not wrap-around padding
        """
        return self._last

    # ---- sizes ---------------------------------------------------------------------------------------------
    def __len__(self) -> int:
        """Batches per rank in one epoch (the same on every rank); ``TypeError`` for an iterable without ``len``."""
        n = self._source.num_batches()
        if n is None:
            raise TypeError(f"ShardedLoader: the iterable dataset {type(self.dataset).__name__} has no __len__, "
                            f"so the number of batches is unknown")
        return n

    def _too_small(self) -> str | None:
        """Why an epoch has no batch although the dataset is not empty, or None."""
        n, size = self._source.num_batches(), self._source.size
        if n != 0 or not size or self.kind == "rank_aware":
            return None
        per = self.world_size * self.batch_size
        return (f"{size} samples, fewer than one batch of {self.batch_size} on each of {self.world_size} "
                f"rank(s) ({per} samples) with drop_last=True")

    def check_nonempty(self, what: str = "dataset", remedy: str | None = None) -> None:
        """Raise ``ValueError`` (naming the sizes) if an epoch has no batch: call it before training.

        Args:
            what: what the data is, for the message (default ``"dataset"``).
            remedy: the advice that ends the message (default ``None``: a smaller ``batch_size``,
                fewer ranks, more data or ``drop_last=False``), for a caller whose users set other
                knobs (the Trainer's users cannot set ``drop_last``, say).

        Returns:
            ``None`` when an epoch has a batch.

        Raises:
            ValueError: an epoch yields no batch on each rank.

        Example::

            >>> import torch, functrain as ft
            >>> ft.shard(torch.arange(3.0), batch_size=4, drop_last=True, rank=0, world_size=1).check_nonempty("eval set")
            Traceback (most recent call last):
            ...
            ValueError: the eval set yields no batch per rank: it has 3 samples, fewer than one batch of 4 on each of 1 rank(s) (4 samples) with drop_last=True; use a smaller batch_size (now 4), fewer ranks (now 1), more data or drop_last=False
        """
        if self._source.num_batches() != 0:
            return
        reason = self._too_small()
        if reason is None:
            reason = f"{self._source.size if self._source.size is not None else 'no'} samples"
        if remedy is None:
            remedy = (f"use a smaller batch_size (now {self.batch_size}), fewer ranks (now {self.world_size}), more "
                      f"data or drop_last=False")
        raise ValueError(f"the {what} yields no batch per rank: it has {reason}; {remedy}")

    # ---- order ---------------------------------------------------------------------------------------------
    def global_order(self, epoch: int | None = None) -> torch.Tensor:
        """Map-style only: the padded global order of an epoch, on every rank the same.

        Rank ``r``'s batch ``k`` is ``order[k*W*B + r*B : k*W*B + (r+1)*B]``. Positions
        ``>= len(dataset)`` are wrap-around padding.

        Args:
            epoch: the epoch (default ``None``: the current one).

        Returns:
            An int64 tensor of ``len(self) * world_size * batch_size`` dataset indices.
        """
        return self._source.global_order(self.epoch if epoch is None else epoch)

    def batch_indices(self, epoch: int | None = None) -> list[list[int]]:
        """This rank's dataset indices of each batch of an epoch; loads no data.

        For a rank-aware sampler this calls its ``set_epoch(epoch)``.

        Args:
            epoch: the epoch (default ``None``: the current one).

        Returns:
            A list (one per batch) of lists of dataset indices.

        Raises:
            TypeError: an iterable dataset (it has no indices).

        Example::

            >>> import torch, functrain as ft
            >>> ft.shard(torch.arange(6.0), batch_size=2, shuffle=False, rank=1, world_size=2).batch_indices()
            [[2, 3], [0, 1]]
        """
        return self._source.batch_indices(self.epoch if epoch is None else epoch)

    # ---- iteration -----------------------------------------------------------------------------------------
    def __iter__(self) -> Iterator:
        epoch, start = self.epoch, self.batch
        n = self._source.num_batches()
        if n == 0 and not self._warned_empty and self._too_small():
            self._warned_empty = True
            warnings.warn(f"ShardedLoader: an epoch yields no batch: the dataset has {self._too_small()}",
                          stacklevel=2)
        device = self.device
        last = None if n is None else n - 1
        k = start
        for batch, rows, real, layout in self._source.batches(epoch, start):
            self._last = BatchInfo(epoch, k, rows, real, layout)
            if k == last:
                self.epoch, self.batch = epoch + 1, 0
            else:
                self.batch = k + 1
            k += 1
            yield to_device(batch, device) if device is not None else batch
        if n is None and self.epoch == epoch:  # an iterable of unknown length ended: the next epoch begins
            self.epoch, self.batch = epoch + 1, 0

    # ---- position ------------------------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` from its first batch (the shuffle order is that of ``seed + epoch``).

        Args:
            epoch: the epoch, an int >= 0.

        Returns:
            ``None``.

        Raises:
            BadValue: ``epoch`` is not an int >= 0.
        """
        self.epoch, self.batch = check_int("ShardedLoader.set_epoch: epoch", epoch, minimum=0), 0

    def state_dict(self) -> dict:
        """The position, as plain ints (for a checkpoint's ``extra``).

        Returns:
            ``{"epoch", "batch" (yielded this epoch, per rank), "seed", "samples" (global samples
            consumed this epoch), "world_size", "batch_size"}``.
        """
        bs = self.batch_size or 0
        return {"epoch": self.epoch, "batch": self.batch, "seed": self.seed,
                "samples": self.batch * self.world_size * bs, "world_size": self.world_size, "batch_size": bs}

    def load_state_dict(self, state: dict) -> None:
        """Resume at a position from :meth:`state_dict`; nothing is loaded until iteration, and then only
        the batches from that position on (map-style and rank-aware; iterables read and discard).

        The same ``world_size`` and ``batch_size`` resume at ``batch``; another one resumes at the
        global sample ``samples`` (a warning says so when that is not a whole global batch: those
        samples are seen again). The ``seed`` is restored too.

        Args:
            state: a dict from :meth:`state_dict` (``epoch``, ``batch``, ``seed`` and ``samples`` are needed).

        Returns:
            ``None``.

        Raises:
            ValueError: a key is missing, or ``batch`` is past the end of the epoch.
            BadValue: a value is not a non-negative int.

        Example::

            >>> import torch, functrain as ft
            >>> loader = ft.shard(torch.arange(6.0), batch_size=2, shuffle=False, rank=0, world_size=1)
            >>> first = next(iter(loader))
            >>> resumed = ft.shard(torch.arange(6.0), batch_size=2, shuffle=False, rank=0, world_size=1)
            >>> resumed.load_state_dict(loader.state_dict())
            >>> [b.tolist() for b in resumed]
            [[2.0, 3.0], [4.0, 5.0]]
        """
        where = "ShardedLoader.load_state_dict"
        for key in ("epoch", "batch", "seed", "samples"):
            if key not in state:
                raise ValueError(f"{where}: the state has no {key!r} (keys: {sorted(state)})")
        epoch = check_int(f"{where}: epoch", state["epoch"], minimum=0)
        batch = check_int(f"{where}: batch", state["batch"], minimum=0)
        samples = check_int(f"{where}: samples", state["samples"], minimum=0)
        seed = check_int(f"{where}: seed", state["seed"])
        same = state.get("world_size") == self.world_size and state.get("batch_size") == self.batch_size
        if not same:
            per = self.world_size * self.batch_size
            batch = samples // per
            if samples % per:
                warnings.warn(f"{where}: {samples} global samples consumed is not a multiple of world_size * "
                              f"batch_size = {per}; resuming at sample {batch * per}, so {samples % per} samples "
                              f"are seen again", stacklevel=2)
        n = self._source.num_batches()
        if n is not None and batch >= n:
            if same and batch > n:
                raise ValueError(f"{where}: batch {batch} is past the end of the epoch ({n} batches per rank)")
            epoch, batch = epoch + 1, 0
        self._source.restore_seed(seed, where)
        self.epoch, self.batch = epoch, batch

    def __repr__(self) -> str:
        return (f"ShardedLoader({self.kind}, batch_size={self.batch_size}, rank={self.rank}/{self.world_size}, "
                f"shuffle={self.shuffle}, drop_last={self.drop_last}, seed={self.seed}, epoch={self.epoch}, "
                f"batch={self.batch})")


def shard(data: Any, batch_size: int | None = None, *, shuffle: bool | None = None, seed: int = 0,
          drop_last: bool | None = None, rank: int | None = None, world_size: int | None = None,
          device: torch.device | str | None = None, collate_fn: Callable | None = None) -> ShardedLoader:
    """This rank's batches of ``data``, resumable, with an exact length: a :class:`ShardedLoader`.

    The result has an exact ``len`` (batches per rank per epoch, equal on all ranks), a
    position (``state_dict``/``load_state_dict``, ``set_epoch``) and advances the epoch
    by itself after its last batch. See the module docs for in-memory columns, iterable
    datasets (the ``functrain_shard(index, count)`` hook), rank-aware samplers and resuming.
    In a job::

        loader = ft.shard(train_set, batch_size=32, device="cuda")   # after ft.distributed.init()
        loader = ft.shard((X, y), batch_size=32)                     # tensors or numpy arrays: one gather a batch
        loader.load_state_dict(checkpoint["data"])                   # resume: skips without loading
        for batch in loader:
            state, metrics = step(state, batch)
        checkpoint["data"] = loader.state_dict()

    Args:
        data: a map-style dataset, in-memory columns (a ``TensorDataset``, or a tuple/dict of
            tensors or numpy arrays with equal first dimensions), an iterable dataset (also a
            Hugging Face ``datasets`` one) or a ``DataLoader``.
        batch_size: rows per batch *per rank* (default ``None``: the DataLoader's).
        shuffle: default ``None``: ``True`` for a dataset, the DataLoader's choice for a DataLoader,
            ``False`` (and only ``False``) for an iterable dataset. The order of epoch ``e`` is
            ``torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed + e))``.
        seed: the shuffle seed, an int (default 0).
        drop_last: ``False`` (default for a dataset) pads the last global step by wrapping around
            to the start of the epoch's order, so every batch on every rank has ``batch_size``
            rows; ``True`` drops the remainder. Default for a DataLoader: its own.
        rank: this rank (default ``None``: from the process group, ``ft.distributed``); pass
            ``rank``/``world_size`` to shard over a sub-group or to simulate ranks in one process.
        world_size: the number of ranks (default ``None``: from the process group).
        device: move every tensor of each (nested) batch there (default ``None``: leave it).
        collate_fn: how samples become a batch (default ``None``: the DataLoader's, else
            ``torch.utils.data.default_collate``).

    Returns:
        The :class:`ShardedLoader`.

    Raises:
        TypeError, ValueError: as :class:`ShardedLoader`.

    Example::

        >>> import torch, functrain as ft
        >>> x = torch.arange(8.0)
        >>> [b.tolist() for b in ft.shard(x, batch_size=2, shuffle=False, rank=1, world_size=2)]  # rank 1 of 2
        [[2.0, 3.0], [6.0, 7.0]]
        >>> loader = ft.shard((x, 2 * x), batch_size=4, seed=1, rank=0, world_size=1)
        >>> len(loader), loader.state_dict()["epoch"]
        (2, 0)
    """
    return ShardedLoader(data, batch_size, shuffle=shuffle, seed=seed, drop_last=drop_last, rank=rank,
                         world_size=world_size, device=device, collate_fn=collate_fn)
