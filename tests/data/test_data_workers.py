"""ft.shard keeps a DataLoader's loading options, and with persistent_workers=True its workers live across epochs."""
import functools
import os

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from functrain.data import shard


def record_init(path, worker_id):
    with open(path, "a") as f:
        f.write(f"{os.getpid()} {worker_id}\n")


def inits(path):
    return len(path.read_text().splitlines()) if path.exists() else 0


class Items(Dataset):
    def __len__(self):
        return 22

    def __getitem__(self, i):
        return i


class EpochStream(IterableDataset):
    """Items depend on the epoch set with set_epoch: a worker that missed it shows old items."""

    def __init__(self, n):
        self.n, self.epoch = n, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        return iter(range(100 * self.epoch, 100 * self.epoch + self.n))

    def __len__(self):
        return self.n


def ids(loader):
    return [[int(i) for i in b] for b in loader]


def test_persistent_workers_start_once_over_two_epochs(tmp_path):
    for persistent, expected in ((True, 1), (False, 2)):  # without persistence each epoch starts its worker
        path = tmp_path / f"inits_{persistent}"
        dl = DataLoader(Items(), batch_size=3, shuffle=True, num_workers=1, persistent_workers=persistent,
                        worker_init_fn=functools.partial(record_init, path))
        loader = shard(dl, rank=1, world_size=2, seed=5)
        reference = shard(Items(), 3, rank=1, world_size=2, seed=5)
        for _ in range(2):
            assert ids(loader) == ids(reference)
        assert inits(path) == expected, f"persistent_workers={persistent}: {inits(path)} worker starts"


def test_persistent_workers_of_a_stream_see_each_epoch(tmp_path):
    path = tmp_path / "inits"
    dl = DataLoader(EpochStream(10), batch_size=2, num_workers=1, persistent_workers=True,
                    worker_init_fn=functools.partial(record_init, path))
    loader = shard(dl, rank=0, world_size=2)
    first, second = ids(loader), ids(loader)
    assert [i for b in first for i in b] == [0, 2, 4, 6, 8, 0]
    assert [i for b in second for i in b] == [100, 102, 104, 106, 108, 100], "the worker missed set_epoch"
    assert inits(path) == 1


def test_loading_options_are_kept():
    gen = torch.Generator()
    init = functools.partial(record_init, "/dev/null")
    dl = DataLoader(Items(), batch_size=4, num_workers=2, persistent_workers=True, pin_memory=True,
                    prefetch_factor=3, timeout=30, worker_init_fn=init, generator=gen)
    opts = shard(dl, rank=0, world_size=2).loader_options
    assert opts == {"num_workers": 2, "persistent_workers": True, "pin_memory": True, "prefetch_factor": 3,
                    "timeout": 30, "worker_init_fn": init, "generator": gen, "in_order": True,
                    "multiprocessing_context": None, "pin_memory_device": ""}
    assert shard(DataLoader(Items(), batch_size=4), world_size=1).loader_options == {
        "num_workers": 0, "pin_memory": False, "timeout": 0, "worker_init_fn": None, "multiprocessing_context": None,
        "generator": None, "pin_memory_device": "", "in_order": True}


def test_out_of_order_workers_are_refused():
    dl = DataLoader(Items(), batch_size=4, num_workers=2, in_order=False)
    with pytest.raises(ValueError, match="in_order=False"):
        shard(dl, rank=0, world_size=2)
