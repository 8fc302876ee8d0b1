"""In-memory data for ``ft.shard``: equal-length tensors or numpy arrays, batched by one gather per column.

``ft.shard`` accepts, besides datasets, data that is already a set of columns in
memory: a ``TensorDataset``, a tuple (or namedtuple) of tensors/arrays, or a dict
of them, all with the same first dimension (one row per sample). Collating such
data sample by sample (``__getitem__`` per row, then ``torch.stack``) costs more
than a small training step; :class:`ArraySource` instead indexes each column once
per batch with the batch's row indices (``index_select``), which gives the same
tensors bit for bit, in the same order, at the same resume positions.

Batches keep the data's structure: a tuple gives a tuple, a namedtuple the same
namedtuple, a dict (or any dict subclass) a plain dict with the same keys; a ``TensorDataset`` gives a list (what
``default_collate`` makes of its tuple items, so existing code sees no change).
numpy arrays are viewed as tensors once, without a copy.
"""
from __future__ import annotations

import warnings
from typing import Any, Callable, Iterator

import numpy as np
import torch
from torch.utils.data import TensorDataset

from .sources import MapSource

__all__ = ["Columns", "as_columns", "ArraySource"]


def _is_array(x: Any) -> bool:
    return torch.is_tensor(x) or isinstance(x, np.ndarray)


def _as_tensor(name: str, x: Any) -> torch.Tensor:
    if torch.is_tensor(x):
        t = x
    else:
        try:
            with warnings.catch_warnings():  # a read-only array: we only ever read it
                warnings.filterwarnings("ignore", message=".*not writable.*")
                t = torch.from_numpy(np.ascontiguousarray(x))
        except TypeError as e:
            raise TypeError(f"shard: column {name} is a numpy array of dtype {x.dtype}, which torch cannot hold "
                            f"({e}); use a numeric or bool dtype") from None
    if t.dim() == 0:
        raise ValueError(f"shard: column {name} is 0-dimensional; every column needs a first dimension with one "
                         f"row per sample")
    return t


class Columns:
    """Equal-length columns (tensors), read as a map-style dataset or gathered a batch at a time.

    ``columns[i]`` is sample ``i`` in the data's structure (as a dataset item);
    ``columns.take(idx)`` is the batch of rows ``idx`` (a 1-D int64 tensor).

    Example::

        cols = as_columns({"x": torch.randn(100, 3), "y": np.arange(100)})
        batch = cols.take(torch.tensor([4, 0, 7]))   # {"x": [3, 3] tensor, "y": [3] tensor}
    """

    def __init__(self, names: list[str], tensors: list[torch.Tensor], rebuild: Callable[[list], Any],
                 item: Callable[[list], Any]):
        lengths = [t.shape[0] for t in tensors]
        if len(set(lengths)) > 1:
            listed = ", ".join(f"{n}: {k}" for n, k in zip(names, lengths))
            raise ValueError(f"shard: the columns have different lengths (first dimensions) {listed}; every column "
                             f"needs one row per sample")
        self.names, self.tensors, self._rebuild, self._item = names, tensors, rebuild, item
        self._n = lengths[0]
        self._index: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i: int) -> Any:
        return self._item([t[i] for t in self.tensors])

    def on_devices(self, index: torch.Tensor) -> dict[torch.device, torch.Tensor]:
        """``index`` on every device a column lives on (moved once, e.g. once per epoch)."""
        return {d: index.to(d) for d in {t.device for t in self.tensors}}

    def take(self, idx: torch.Tensor | dict[torch.device, torch.Tensor]) -> Any:
        """The batch of rows ``idx`` (one tensor, or one per column device from :meth:`on_devices`)."""
        if torch.is_tensor(idx):
            return self._rebuild([t.index_select(0, idx.to(t.device)) for t in self.tensors])
        return self._rebuild([t.index_select(0, idx[t.device]) for t in self.tensors])


def as_columns(data: Any) -> Columns | None:
    """``data`` as :class:`Columns` if it is in-memory columns (see the module docs), else ``None``.

    A dict must map names to tensors/arrays; a tuple whose items are all tensors/arrays is
    columns, one whose items are none is a sequence of samples; anything between is refused.
    """
    if isinstance(data, TensorDataset) and type(data).__getitem__ is TensorDataset.__getitem__:
        names = [f"tensors[{i}]" for i in range(len(data.tensors))]
        return Columns(names, [_as_tensor(n, t) for n, t in zip(names, data.tensors)], list, tuple)
    if isinstance(data, dict):
        if not data:
            raise ValueError("shard: the dict of columns is empty; give it name -> tensor (or numpy array) items")
        for key, value in data.items():
            if not _is_array(value):
                raise TypeError(f"shard: a dict is read as columns (name -> tensor or numpy array with one row per "
                                f"sample); {key!r} is a {type(value).__name__}")
        keys = list(data)
        names = [repr(k) for k in keys]
        tensors = [_as_tensor(n, data[k]) for n, k in zip(names, keys)]

        def rebuild(values: list) -> Any:
            return dict(zip(keys, values))

        return Columns(names, tensors, rebuild, rebuild)
    if isinstance(data, tuple) and data:
        arrays = [_is_array(x) for x in data]
        if not any(arrays):
            return None  # a tuple of samples: an ordinary map-style dataset
        if not all(arrays):
            bad = arrays.index(False)
            raise TypeError(f"shard: a tuple of tensors/numpy arrays is read as columns; item {bad} is a "
                            f"{type(data[bad]).__name__} (pass a list or a Dataset for a sequence of samples)")
        names = [f"[{i}]" for i in range(len(data))]
        tensors = [_as_tensor(n, x) for n, x in zip(names, data)]
        kind = type(data)
        rebuild = kind._make if hasattr(kind, "_fields") else kind  # a namedtuple keeps its type
        return Columns(names, tensors, rebuild, rebuild)
    return None


class ArraySource(MapSource):
    """The map-style split of :class:`~functrain.data.sources.MapSource` over :class:`Columns`: the same
    indices, gathered with one ``index_select`` per column per batch (no per-sample collate)."""

    kind = "map"

    def __init__(self, *args: Any, reader: Columns, pin_memory: bool = False, **kwargs: Any):
        super().__init__(*args, reader=reader, **kwargs)
        self.pin = pin_memory and torch.cuda.is_available()

    def batches(self, epoch: int, start: int) -> Iterator[tuple[Any, int, int, str]]:
        steps = self.num_batches()
        if start >= steps:
            return
        order = self.rank_order(epoch)[start:]
        # each batch's row indices, split up front (one op per epoch and device, none per batch)
        index = {d: i.unbind(0) for d, i in self.reader.on_devices(order).items()}
        single = next(iter(index.values())) if len(index) == 1 else None
        rows = self.batch_size
        take = self.reader.take
        for j, k in enumerate(range(start, steps)):
            batch = take(single[j]) if single is not None else take({d: i[j] for d, i in index.items()})
            if self.pin:
                batch = _pin(batch)
            real, layout = self.real(k, rows)
            yield batch, rows, real, layout


def _pin(batch: Any) -> Any:
    if isinstance(batch, dict):
        return type(batch)((k, v.pin_memory() if v.device.type == "cpu" else v) for k, v in batch.items())
    values = [v.pin_memory() if v.device.type == "cpu" else v for v in batch]
    return type(batch)._make(values) if hasattr(type(batch), "_fields") else type(batch)(values)
