"""ft.shard with Hugging Face ``datasets`` (installed, in-memory data only): map-style and iterable datasets
on N ranks are disjoint, covering and resumable; simulated ranks in one process, and one real 2-process run.
"""
import os

import pytest
import torch
from torch.utils.data import DataLoader

datasets = pytest.importorskip("datasets")
from datasets import Dataset  # noqa: E402
from datasets.distributed import split_dataset_by_node  # noqa: E402

import functrain as ft  # noqa: E402
from functrain.data import gather_for_eval, shard  # noqa: E402

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def stream(n, num_shards, fmt=True):
    ds = Dataset.from_dict({"x": list(range(n)), "y": [10 * i for i in range(n)]}).to_iterable_dataset(
        num_shards=num_shards)
    return ds.with_format("torch") if fmt else ds


def run_epoch(loader):
    """This rank's items of one epoch: all rows, and the real ones (padding removed) by last_batch_info."""
    rows, real = [], []
    for batch in loader:
        x = batch["x"].tolist()
        assert torch.equal(batch["y"], batch["x"] * 10), "columns out of step"
        assert len(x) == loader.batch_size
        rows += x
        real += x[:loader.last_batch_info.real]
    return rows, real


def test_map_style_with_torch_format_on_two_ranks():
    ds = Dataset.from_dict({"x": list(range(23))}).with_format("torch")
    seen = []
    for r in range(2):
        loader = shard(ds, 3, seed=4, rank=r, world_size=2)
        assert loader.kind == "map" and len(loader) == 4
        batches = [b["x"] for b in loader]
        assert all(b.dtype == torch.int64 and b.shape == (3,) for b in batches)
        ids = shard(list(range(23)), 3, seed=4, rank=r, world_size=2)  # item i is i: the indices
        assert [b.tolist() for b in batches] == [b.tolist() for b in ids], "not the shared global order"
        seen += [i for b in batches for i in b.tolist()]
    assert set(seen) == set(range(23)) and len(seen) == 24  # one wrap-around pad


@pytest.mark.parametrize("num_shards", [1, 3, 4])  # 4: whole shards per rank; 1, 3: one example in two
@pytest.mark.parametrize("drop_last", [False, True])
def test_iterable_on_simulated_ranks_disjoint_covering(num_shards, drop_last):
    n = 23
    reals = []
    for r in range(2):
        loader = shard(stream(n, num_shards), 3, rank=r, world_size=2, drop_last=drop_last)
        assert loader.kind == "iterable"
        rows, real = run_epoch(loader)  # rank 0 used to raise ZeroDivisionError, rank 1 IndexError
        assert loader.state_dict()["epoch"] == 1
        reals.append(real)
    flat = reals[0] + reals[1]
    assert len(flat) == len(set(flat)), "the ranks' parts overlap"
    if drop_last:
        assert n - len(flat) < 2 * 3 * 2, "more than each rank's remainder was dropped"
    else:
        assert sorted(flat) == list(range(n)), "the ranks' parts do not cover the dataset"


def test_iterable_resume_mid_epoch_and_next_epoch():
    for r in range(2):
        full = run_epoch(shard(stream(31, 4), 2, rank=r, world_size=2))[0]
        first = shard(stream(31, 4), 2, rank=r, world_size=2)
        it = iter(first)
        head = [next(it)["x"].tolist() for _ in range(3)]
        state = first.state_dict()
        assert (state["epoch"], state["batch"], state["samples"]) == (0, 3, 12)
        resumed = shard(stream(31, 4), 2, rank=r, world_size=2)
        resumed.load_state_dict(state)
        rest = run_epoch(resumed)[0]
        assert [i for b in head for i in b] + rest == full
        assert resumed.state_dict()["epoch"] == 1


def test_shuffled_stream_changes_order_per_epoch_the_same_on_every_rank():
    def loaders():
        ds = stream(40, 4).shuffle(seed=3, buffer_size=8)
        return [shard(ds, 4, rank=r, world_size=2) for r in range(2)]

    a, b = loaders(), loaders()
    epoch0 = [run_epoch(x)[1] for x in a]
    epoch1 = [run_epoch(x)[1] for x in a]
    assert epoch0 != epoch1, "set_epoch did not reach the dataset"
    for e in (epoch0, epoch1):
        assert sorted(e[0] + e[1]) == list(range(40))
    assert [run_epoch(x)[1] for x in b] == epoch0, "the order is not reproducible"


def test_already_split_dataset_is_not_split_again():
    seen = []
    for r in range(2):
        part = split_dataset_by_node(stream(20, 2), rank=r, world_size=2)
        loader = shard(part, 2)  # no process group: rank and world size come from the split
        assert (loader.rank, loader.world_size) == (r, 2)
        seen += run_epoch(loader)[1]
    assert sorted(seen) == list(range(20))
    part = split_dataset_by_node(stream(20, 2), rank=1, world_size=2)
    with pytest.raises(ValueError, match=r"world_size=4 does not match .*split_dataset_by_node\(rank=1, world_size=2"):
        shard(part, 2, world_size=4)
    with pytest.raises(ValueError, match=r"rank=0 does not match"):
        shard(part, 2, rank=0)


def test_dataloader_workers_split_the_rank_part_once():
    ref = [set(run_epoch(shard(stream(24, 4), 3, rank=r, world_size=2))[1]) for r in range(2)]
    for r in range(2):
        dl = DataLoader(stream(24, 4), batch_size=3, num_workers=2)
        got = run_epoch(shard(dl, rank=r, world_size=2))[1]
        assert len(got) == len(set(got)) and set(got) == ref[r], "workers lost or repeated the rank's items"


def test_persistent_workers_see_the_epoch():
    def epochs(persistent):
        ds = stream(24, 4).shuffle(seed=1, buffer_size=6)
        dl = DataLoader(ds, batch_size=3, num_workers=2, persistent_workers=persistent)
        loader = shard(dl, rank=1, world_size=2)
        return [run_epoch(loader)[0] for _ in range(2)]

    persistent = epochs(True)
    assert persistent == epochs(False), "persistent workers read another order"
    assert persistent[0] != persistent[1], "the epoch did not reach the persistent workers"


def test_a_foreign_shard_method_is_not_called():
    class Foreign(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(10))

        def shard(self, num_shards, index):  # someone else's signature
            raise AssertionError("called")

    with pytest.warns(UserWarning, match=r"has a shard\(\) method, which ft.shard does not call"):
        loader = shard(Foreign(), 2, rank=1, world_size=2)
    assert [b.tolist() for b in loader] == [[1, 3], [5, 7], [9, 1]]


# ---- a real 2-process group -------------------------------------------------------------------------------------
def _hf_worker(n):
    import torch.distributed as dist

    from functrain.data import gather_for_eval, shard

    rank = dist.get_rank()
    report = {}
    cases = {
        "examples": lambda: stream(n, 3),                      # 3 shards on 2 ranks: one example in two
        "shards": lambda: stream(n, 4),                        # whole shards per rank
        "presplit": lambda: split_dataset_by_node(stream(n, 4), rank=rank, world_size=2),
    }
    for name, make in cases.items():
        loader = shard(make(), 3)
        assert (loader.rank, loader.world_size) == (rank, 2)
        rows, real = run_epoch(loader)
        # mid-epoch resume: 2 batches, then a fresh loader from the state
        first = shard(make(), 3)
        it = iter(first)
        head = [next(it)["x"].tolist() for _ in range(2)]
        resumed = shard(make(), 3)
        resumed.load_state_dict(first.state_dict())
        rest = run_epoch(resumed)[0]
        # evaluation: each sample once across ranks
        evaluated = []
        ev = shard(make(), 3)
        for batch in ev:
            evaluated += gather_for_eval(batch["x"], ev).tolist()
        report[name] = {"rows": rows, "real": real, "resumed": [i for b in head for i in b] + rest,
                        "state": first.state_dict(), "evaluated": evaluated}
    m = Dataset.from_dict({"x": list(range(n))}).with_format("torch")
    loader = shard(m, 3, seed=2)
    report["map"] = {"real": [i for b in loader for i in b["x"].tolist()]}
    return report


def test_two_processes_disjoint_covering_resumed():
    n = 29
    reports = ft.launch(_hf_worker, nprocs=2, args=(n,), timeout=240)
    for name in ("examples", "shards", "presplit"):
        r0, r1 = reports[0][name], reports[1][name]
        assert len(r0["rows"]) == len(r1["rows"]), f"{name}: the ranks yielded different batch counts"
        assert not set(r0["real"]) & set(r1["real"]), f"{name}: the ranks' parts overlap"
        assert sorted(r0["real"] + r1["real"]) == list(range(n)), f"{name}: the parts do not cover the dataset"
        for r in (r0, r1):
            assert r["resumed"] == r["rows"], f"{name}: the mid-epoch resume differs from the full epoch"
            assert r["state"]["batch"] == 2 and r["state"]["epoch"] == 0
        assert r0["evaluated"] == r1["evaluated"] and sorted(r0["evaluated"]) == list(range(n)), \
            f"{name}: gather_for_eval did not see each sample once"
    seen = reports[0]["map"]["real"] + reports[1]["map"]["real"]
    assert set(seen) == set(range(n)) and len(seen) == 30
