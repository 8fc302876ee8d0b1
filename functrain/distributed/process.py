"""Process helpers for scripts that run on every rank: print once, run something on rank 0 first, wait for
everyone, split a list between the ranks.

Every helper works without a process group: one process is the main process, waits for nobody and gets all
of the data. With a group (``ft.distributed.init()``), the barriers are bounded by the group's timeout
(``FUNCTRAIN_DIST_TIMEOUT``), so a rank that died makes the others fail instead of waiting forever.
"""
from __future__ import annotations

import builtins
import contextlib
from typing import Any, Iterator

import torch
import torch.distributed as dist

from .group import is_initialized, process_info, rank, world_size

__all__ = ["print_main", "is_main_process", "is_local_main_process", "main_process_first", "wait_for_everyone",
           "split_between_processes"]


def is_main_process() -> bool:
    """Whether this is rank 0 of the job (``True`` without a process group).

    Example::

        >>> import functrain as ft
        >>> ft.distributed.is_main_process()
        True
    """
    return rank() == 0


def is_local_main_process() -> bool:
    """Whether this is the first process on its machine (local rank 0; ``True`` without a process group).

    Example::

        >>> import functrain as ft
        >>> ft.distributed.is_local_main_process()
        True
    """
    if not is_initialized():
        return True
    return process_info().local_rank == 0


def print_main(*args: Any, **kwargs: Any) -> None:
    """``print(*args, **kwargs)`` on rank 0 only (every process prints without a process group).

    Example::

        >>> import functrain as ft
        >>> ft.distributed.print_main("loss", 0.5)
        loss 0.5
    """
    if is_main_process():
        builtins.print(*args, **kwargs)


def wait_for_everyone() -> None:
    """Block until every rank of the default group has called it (a barrier; no-op without a group).

    Bounded by the group's timeout (``FUNCTRAIN_DIST_TIMEOUT``, default 300 s): if a rank never arrives, the
    others raise instead of waiting forever. Every rank must call it the same number of times.

    Example::

        >>> import functrain as ft
        >>> ft.distributed.wait_for_everyone()   # one process: returns at once
    """
    if not is_initialized() or world_size() == 1:
        return
    if dist.get_backend() == "nccl":  # NCCL's barrier needs to know the device this rank uses
        dist.barrier(device_ids=[torch.cuda.current_device()])
    else:
        dist.barrier()


@contextlib.contextmanager
def main_process_first(local: bool = False) -> Iterator[None]:
    """Run the block on the main process first, then on the others.

    Rank 0 runs the block while the others wait at a barrier; when it is done, the others run it (all of them at
    once). For work whose first run leaves something the others reuse: a dataset's preprocessing that writes a
    cache, a download. ``local=True``: the first process of each machine goes first (a cache on local disk).
    Without a process group the block just runs. If the main process raises inside the block, the exception
    propagates and the others fail at the barrier after the group's timeout (or when the launcher ends them).

    Example::

        >>> import functrain as ft
        >>> with ft.distributed.main_process_first():
        ...     data = list(range(4))   # e.g. build and cache the dataset
        >>> data
        [0, 1, 2, 3]
    """
    if not isinstance(local, bool):
        raise TypeError(f"main_process_first: local must be a bool; got {local!r}")
    first = is_local_main_process() if local else is_main_process()
    if not first:
        wait_for_everyone()  # the main process is running the block
    yield
    if first:
        wait_for_everyone()  # done: release the others


def _split(n: int, parts: int, index: int, pad: bool) -> tuple[int, int, int]:
    """``(start, stop, padding)``: this part's rows of ``n``; the first ``n % parts`` parts get one more row;
    with ``pad``, a part that is one short gets its last row repeated (``padding`` rows)."""
    base, extra = divmod(n, parts)
    start = index * base + min(index, extra)
    stop = start + base + (1 if index < extra else 0)
    longest = base + (1 if extra else 0)
    return start, stop, (longest - (stop - start)) if pad else 0


def _take(data: Any, start: int, stop: int, padding: int) -> Any:
    if isinstance(data, torch.Tensor):
        part = data[start:stop]
        if padding:
            if stop == start:
                raise ValueError("split_between_processes(pad=True): cannot pad an empty part (fewer rows than "
                                 "processes and no row to repeat)")
            part = torch.cat([part, part[-1:].expand(padding, *part.shape[1:])])
        return part
    part = data[start:stop]
    if padding:
        if stop == start:
            raise ValueError("split_between_processes(pad=True): cannot pad an empty part (fewer items than "
                             "processes and no item to repeat)")
        part = part + type(part)([part[-1]] * padding)
    return part


def split_between_processes(data: Any, *, pad: bool = False) -> Any:
    """This rank's contiguous part of ``data`` (all of it without a process group).

    ``data`` is a list, a tuple, a tensor (split along dim 0) or a dict of such columns, all of the same length
    (each column split at the same rows). With ``n`` rows on ``w`` ranks, rank ``r`` gets rows
    ``[r * (n // w) + min(r, n % w), ...)``: ``n // w`` rows, one more on the first ``n % w`` ranks, so
    concatenating the parts by rank gives ``data`` back. ``pad=True`` gives every rank the same length
    (``ceil(n / w)``) by repeating the last row of each part that is one short: then concatenating the parts
    has those repeats in it (drop them from gathered results, e.g. by the ``n`` you know). A rank can get an
    empty part when ``n < w`` (and ``pad=True`` then raises: there is no row to repeat).

    Raises:
        TypeError: ``data`` is not a list, tuple, tensor or dict of them.
        ValueError: a dict's columns have different lengths, or a tensor has no dimension.

    Example::

        >>> import functrain as ft
        >>> ft.distributed.split_between_processes(["a", "b", "c"])   # one process: all of it
        ['a', 'b', 'c']
    """
    if not isinstance(pad, bool):
        raise TypeError(f"split_between_processes: pad must be a bool; got {pad!r}")
    columns = data if isinstance(data, dict) else {None: data}
    lengths = {}
    for key, col in columns.items():
        if isinstance(col, torch.Tensor):
            if col.dim() == 0:
                raise ValueError(f"split_between_processes: {'the tensor' if key is None else repr(key)} has no "
                                 f"dimension to split (a 0-d tensor)")
            lengths[key] = col.shape[0]
        elif isinstance(col, (list, tuple)):
            lengths[key] = len(col)
        else:
            what = "data" if key is None else f"column {key!r}"
            raise TypeError(f"split_between_processes: {what} is a {type(col).__name__}; expected a list, tuple, "
                            f"tensor or a dict of them")
    if len(set(lengths.values())) > 1:
        raise ValueError(f"split_between_processes: the dict's columns have different lengths {lengths}; they "
                         f"must all have the same number of rows")
    n = next(iter(lengths.values()), 0)
    start, stop, padding = _split(n, world_size(), rank(), pad)
    parts = {key: _take(col, start, stop, padding) for key, col in columns.items()}
    return parts if isinstance(data, dict) else parts[None]
