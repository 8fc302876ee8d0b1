"""ft.shard / ft.gather_for_eval: disjoint covering shards, one order per epoch, exact len, resumable position.

Ranks are simulated in one process by passing rank=/world_size=; one real 2-process (gloo)
test gathers evaluation results and checks each sample is seen exactly once.
"""
import json
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.utils.data import DataLoader, Dataset, IterableDataset
from torch.utils.data.distributed import DistributedSampler

import functrain as ft
from functrain.data import ShardedLoader, gather_for_eval, shard


# ---- datasets -----------------------------------------------------------------------------------------------------
class Counting(Dataset):
    """Map-style: item i is i; counts __getitem__ calls."""

    def __init__(self, n):
        self.n, self.calls = n, 0

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        self.calls += 1
        return i


class Stream(IterableDataset):
    """Iterable 0..n-1 that counts the items it reads; optional __len__, set_epoch (HookStream: the shard hook)."""

    def __init__(self, n, has_len=True):
        self.n, self.has_len, self.reads, self.epochs = n, has_len, 0, []

    def __iter__(self):
        for i in range(self.n):
            self.reads += 1
            yield i

    def __len__(self):
        if not self.has_len:
            raise TypeError("no len")
        return self.n

    def set_epoch(self, epoch):
        self.epochs.append(epoch)


class HookStream(Stream):
    """A stream that can read only part `index` of `count` (as if from its own files)."""

    def __init__(self, n, has_len=True):
        super().__init__(n, has_len)
        self.shard_calls = []

    def functrain_shard(self, index, count):
        self.shard_calls.append((index, count))

        def part():
            for i in range(index, self.n, count):
                self.reads += 1
                yield i

        return part()


class RankAwareSampler(torch.utils.data.Sampler):
    """Not a DistributedSampler, but rank-aware: it has num_replicas and rank."""

    def __init__(self, n, num_replicas, rank):
        self.n, self.num_replicas, self.rank, self.epochs = n, num_replicas, rank, []

    def __iter__(self):
        return iter(range(self.rank, self.n, self.num_replicas))

    def __len__(self):
        return len(range(self.rank, self.n, self.num_replicas))

    def set_epoch(self, epoch):
        self.epochs.append(epoch)


def ids(batches):
    return [[int(i) for i in b] for b in batches]


def rank_batches(n, batch, world, seed=0, drop_last=False, epoch=0, shuffle=True):
    out = []
    for r in range(world):
        loader = shard(Counting(n), batch, shuffle=shuffle, seed=seed, drop_last=drop_last, rank=r, world_size=world)
        loader.set_epoch(epoch)
        got = ids(loader)
        assert len(got) == len(loader), "len(loader) is not the number of batches yielded"
        out.append(got)
    return out


def check_shards(n, batch, world, seed=0, drop_last=False, epoch=0):
    per_rank = rank_batches(n, batch, world, seed, drop_last, epoch)
    steps = n // (world * batch) if drop_last else math.ceil(n / (world * batch))
    assert all(len(b) == steps for b in per_rank), f"batch counts per rank {[len(b) for b in per_rank]} != {steps}"
    assert all(len(x) == batch for b in per_rank for x in b), "a batch is not full"
    # the global sequence: step k is rank 0's batch k, then rank 1's, ...
    seq = [i for k in range(steps) for r in range(world) for i in per_rank[r][k]]
    assert len(seq) == steps * world * batch
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
    if drop_last:
        assert len(set(seq)) == len(seq), "a sample appears twice with drop_last"
        assert n - len(seq) < world * batch, "more than the remainder was dropped"
        sets = [set(i for b in rb for i in b) for rb in per_rank]
        assert sum(len(s) for s in sets) == len(set().union(*sets)), "rank shards overlap"
        assert seq == perm[:len(seq)], "ranks do not follow the one shared order of the epoch"
    else:
        assert sorted(seq[:n]) == list(range(n)), "the first n global positions are not each sample once"
        assert seq == [perm[i % n] for i in range(len(seq))], "not the shared order padded by wrap-around"
        assert set(seq) == set(range(n)), "shards do not cover the dataset"
        if n % (world * batch) == 0:
            sets = [set(i for b in rb for i in b) for rb in per_rank]
            assert sum(len(s) for s in sets) == n, "rank shards overlap without padding"
    return per_rank


# ---- sharding properties ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("n", [7, 21, 22, 24])
def test_disjoint_and_covering_batch3_world2(n, drop_last):
    per_rank = check_shards(n, 3, 2, seed=0, drop_last=drop_last)
    if not drop_last:  # padding is exactly what is needed to fill the last global step
        flat = [i for rb in per_rank for b in rb for i in b]
        assert len(flat) - n == (-n) % 6
    else:
        assert len(per_rank[0]) == n // 6


@pytest.mark.filterwarnings("ignore:ShardedLoader. an epoch yields no batch")  # tiny n with drop_last: expected
@given(n=st.integers(1, 60), batch=st.integers(1, 8), world=st.integers(1, 4), seed=st.integers(0, 10_000),
       drop_last=st.booleans(), epoch=st.integers(0, 3))
def test_shard_properties(n, batch, world, seed, drop_last, epoch):
    check_shards(n, batch, world, seed, drop_last, epoch)


def test_order_changes_per_epoch_and_advances_by_itself():
    loader = shard(Counting(24), 3, seed=7, rank=1, world_size=2)
    first, second = ids(loader), ids(loader)  # two passes: epochs 0 and 1
    assert first != second, "the shuffle order did not change between epochs"
    loader.set_epoch(0)
    assert ids(loader) == first
    loader.set_epoch(1)
    assert ids(loader) == second
    assert loader.state_dict()["epoch"] == 2
    unshuffled = [shard(Counting(12), 3, shuffle=False, rank=r, world_size=2) for r in range(2)]
    assert [ids(u) for u in unshuffled] == [[[0, 1, 2], [6, 7, 8]], [[3, 4, 5], [9, 10, 11]]]


def test_len_exact_and_equal_and_empty_with_drop_last():
    for n, b, w, drop, expected in [(7, 3, 2, False, 2), (7, 3, 2, True, 1), (5, 3, 2, True, 0), (1, 4, 3, False, 1),
                                    (0, 2, 2, False, 0)]:
        lens = [len(shard(Counting(n), b, rank=r, world_size=w, drop_last=drop)) for r in range(w)]
        assert lens == [expected] * w, (n, b, w, drop, lens)


# ---- position / resume --------------------------------------------------------------------------------------------
def test_resume_skips_without_loading_the_skipped_samples():
    full = ids(shard(Counting(50), 4, seed=3, rank=1, world_size=2))
    assert len(full) == 7
    first = shard(Counting(50), 4, seed=3, rank=1, world_size=2)
    for k, _ in enumerate(first, 1):
        if k == 3:
            break
    state = json.loads(json.dumps(first.state_dict()))  # plain JSON-able ints
    assert state == {"epoch": 0, "batch": 3, "seed": 3, "samples": 3 * 2 * 4, "world_size": 2, "batch_size": 4}
    data = Counting(50)
    resumed = shard(data, 4, seed=99, rank=1, world_size=2)  # the seed comes from the checkpoint
    resumed.load_state_dict(state)
    assert data.calls == 0
    rest = ids(resumed)
    assert rest == full[3:]
    assert data.calls == (7 - 3) * 4, f"{data.calls} __getitem__ calls: the skipped batches were loaded"
    assert resumed.state_dict()["epoch"] == 1 and resumed.state_dict()["batch"] == 0


def test_state_after_last_batch_is_next_epoch():
    loader = shard(Counting(12), 3, rank=0, world_size=2)
    it = iter(loader)
    next(it)
    assert loader.state_dict()["batch"] == 1
    next(it)  # the last batch of epoch 0
    assert (loader.state_dict()["epoch"], loader.state_dict()["batch"]) == (1, 0)


def test_resume_on_another_world_size_continues_at_the_global_sample():
    n, seed = 40, 5
    old = [shard(Counting(n), 3, seed=seed, rank=r, world_size=2) for r in range(2)]
    consumed = []
    for loader in old:
        it = iter(loader)
        consumed += [i for _ in range(3) for i in next(it).tolist()]
    state = old[0].state_dict()
    assert state["samples"] == 18
    new = [shard(Counting(n), 2, seed=seed, rank=r, world_size=3) for r in range(3)]  # 6 samples per step again
    for loader in new:
        loader.load_state_dict(state)
        assert loader.state_dict()["batch"] == 3
    rest = [ids(loader) for loader in new]
    seq = [i for k in range(len(rest[0])) for r in range(3) for i in rest[r][k]]
    assert sorted(consumed + seq[:n - 18]) == list(range(n)), "resume lost or repeated samples"
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    assert consumed and sorted(consumed) == sorted(perm[:18])
    # a step size that does not divide the position: resumes earlier, with a warning
    other = shard(Counting(n), 4, seed=seed, rank=0, world_size=4)
    with pytest.warns(UserWarning, match="seen again"):
        other.load_state_dict(state)
    assert other.state_dict()["batch"] == 1


def test_load_state_dict_errors():
    loader = shard(Counting(12), 3, rank=0, world_size=2)
    with pytest.raises(ValueError, match="'samples'"):
        loader.load_state_dict({"epoch": 0, "batch": 0, "seed": 0})
    with pytest.raises(ValueError, match="batch must be an int >= 0"):
        loader.load_state_dict({"epoch": 0, "batch": -1, "seed": 0, "samples": 0, "world_size": 2, "batch_size": 3})
    with pytest.raises(ValueError, match="past the end"):
        loader.load_state_dict({"epoch": 0, "batch": 5, "seed": 0, "samples": 30, "world_size": 2, "batch_size": 3})


# ---- DataLoaders and rank-aware samplers --------------------------------------------------------------------------
def test_dataloader_settings_are_reused():
    ds = Counting(22)
    dl = DataLoader(ds, batch_size=3, shuffle=True, drop_last=True, collate_fn=lambda xs: [x * 10 for x in xs])
    loader = shard(dl, rank=1, world_size=2, seed=4)
    assert isinstance(loader, ShardedLoader)
    assert (loader.batch_size, loader.shuffle, loader.drop_last) == (3, True, True)
    got = list(loader)
    assert len(got) == len(loader) == 3
    expected = shard(Counting(22), 3, seed=4, drop_last=True, rank=1, world_size=2)
    assert got == [[10 * i for i in b] for b in ids(expected)]
    assert not shard(DataLoader(ds, batch_size=3), world_size=1).shuffle


def test_dataloader_workers_give_the_same_batches():
    dl = DataLoader(Counting(22), batch_size=3, shuffle=True, num_workers=2)
    for r in range(2):
        assert ids(shard(dl, rank=r, world_size=2)) == ids(shard(Counting(22), 3, rank=r, world_size=2))
    for r in range(2):
        streamed = ids(shard(DataLoader(Stream(22), batch_size=3, num_workers=2), rank=r, world_size=2))
        assert streamed == ids(shard(Stream(22), 3, rank=r, world_size=2))


@pytest.mark.parametrize("drop_last", [False, True])
def test_distributed_sampler_is_not_split_again(drop_last):
    ds = Counting(23)
    seen = []
    for r in range(2):
        dl = DataLoader(ds, batch_size=4, sampler=DistributedSampler(ds, num_replicas=2, rank=r, seed=5),
                        drop_last=drop_last)
        loader = shard(dl)  # no process group: rank and world size come from the sampler
        assert (loader.kind, loader.rank, loader.world_size) == ("rank_aware", r, 2)
        for epoch in range(2):
            ref_sampler = DistributedSampler(ds, num_replicas=2, rank=r, seed=5)
            ref_sampler.set_epoch(epoch)
            reference = ids(DataLoader(ds, batch_size=4, sampler=ref_sampler, drop_last=drop_last))
            got = ids(loader)
            assert got == reference, "the sampler's split was changed"
            assert len(loader) == len(got)
            assert loader.state_dict()["epoch"] == epoch + 1
            if epoch == 0:
                seen += [i for b in got for i in b]
        assert loader.state_dict()["seed"] == 5
    if not drop_last:
        assert len(seen) == 24 and set(seen) == set(range(23)), "split twice: samples missing"
    loader = shard(DataLoader(ds, batch_size=4, sampler=DistributedSampler(ds, num_replicas=2, rank=1)))
    loader.load_state_dict({"epoch": 1, "batch": 1, "seed": 0, "samples": 8, "world_size": 2, "batch_size": 4})
    ds.calls = 0
    ref_sampler = DistributedSampler(ds, num_replicas=2, rank=1)
    ref_sampler.set_epoch(1)
    assert ids(loader) == ids(DataLoader(Counting(23), batch_size=4, sampler=ref_sampler))[1:]
    assert ds.calls == 12 - 4, "resuming loaded skipped samples"


def test_rank_aware_sampler_detection_and_mismatch_errors():
    ds = Counting(10)
    sampler = RankAwareSampler(10, num_replicas=3, rank=2)
    loader = shard(DataLoader(ds, batch_size=2, sampler=sampler))
    assert (loader.rank, loader.world_size) == (2, 3)
    assert ids(loader) == [[2, 5], [8]]
    assert sampler.epochs == [0]
    dl = DataLoader(ds, batch_size=2, sampler=RankAwareSampler(10, 2, 0))
    with pytest.raises(ValueError, match=r"world_size=3 does not match .*num_replicas=2"):
        shard(dl, world_size=3)
    with pytest.raises(ValueError, match=r"rank=1 does not match .*rank=0"):
        shard(dl, rank=1)
    with pytest.raises(TypeError, match="cannot split the DataLoader's sampler WeightedRandomSampler"):
        shard(DataLoader(ds, batch_size=2, sampler=torch.utils.data.WeightedRandomSampler([1.0] * 10, 10)),
              world_size=2, rank=0)


# ---- iterable datasets --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("hook", [False, True])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("n", [7, 21, 22, 24])
def test_iterable_split(n, drop_last, hook):
    world, batch = 2, 3
    steps = n // 6 if drop_last else math.ceil(n / 6)
    all_items = []
    for r in range(world):
        data = (HookStream if hook else Stream)(n)
        loader = shard(data, batch, rank=r, world_size=world, drop_last=drop_last, shuffle=False)
        got = ids(loader)
        assert len(got) == len(loader) == steps, "unequal batch counts"
        assert all(len(b) == batch for b in got)
        flat = [i for b in got for i in b]
        part = list(range(r, n, world))
        real = min(len(part), steps * batch)
        assert flat[:real] == part[:real], "not this rank's part, in order"
        assert flat[real:] == [part[j % len(part)] for j in range(len(flat) - real)], "padding is not wrap-around"
        all_items += flat[:real]
        if hook:
            assert data.shard_calls == [(r, world)]
            assert data.reads <= len(part), f"rank {r} read {data.reads} items, more than its part"
        else:
            # the strided split reads the other ranks' items too, up to its last own item
            assert data.reads >= r + (real - 1) * world + 1 > real
        assert data.epochs == [0]
    assert len(all_items) == len(set(all_items)), "iterable shards overlap"
    if not drop_last:
        assert sorted(all_items) == list(range(n)), "iterable shards do not cover the dataset"


def test_iterable_without_len_and_resume():
    loader = shard(Stream(22, has_len=False), 3, rank=1, world_size=2)
    with pytest.raises(TypeError, match="no __len__"):
        len(loader)
    got = ids(loader)
    assert [i for b in got for i in b] == list(range(1, 22, 2)) + [1]  # 11 items, padded to 12 from its start
    assert loader.state_dict()["epoch"] == 1
    full = ids(shard(Stream(22), 3, rank=0, world_size=2))
    first = shard(Stream(22), 3, rank=0, world_size=2)
    it = iter(first)
    next(it), next(it)
    resumed = shard(Stream(22), 3, rank=0, world_size=2)
    resumed.load_state_dict(first.state_dict())
    assert ids(resumed) == full[2:]
    with pytest.raises(ValueError, match="shuffle=True for an iterable"):
        shard(Stream(5), 2, shuffle=True, world_size=1)


# ---- device placement, errors -------------------------------------------------------------------------------------
class Nested(Dataset):
    def __len__(self):
        return 10

    def __getitem__(self, i):
        return {"x": torch.full((2,), float(i)), "y": (torch.tensor(i), [torch.tensor([i, -i])]), "id": i}


@pytest.mark.parametrize("device", ["meta"] + (["cuda"] if torch.cuda.is_available() else []))
def test_nested_batches_are_placed_on_the_device(device):
    loader = shard(Nested(), 3, rank=0, world_size=2, device=device)
    batches = list(loader)
    assert len(batches) == 2
    for b in batches:
        assert set(b) == {"x", "y", "id"} and isinstance(b["y"], (list, tuple)) and isinstance(b["y"][1], list)
        leaves = [b["x"], b["y"][0], b["y"][1][0], b["id"]]
        assert all(t.device.type == device for t in leaves), [t.device for t in leaves]
        assert b["x"].shape == (3, 2) and b["y"][1][0].shape == (3, 2)
    assert all(t.device.type == "cpu" for t in [next(iter(shard(Nested(), 3, world_size=1)))["x"]])


def test_errors_name_the_bad_values():
    ds = Counting(10)
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match=rf"batch_size must be an int >= 1; got {bad!r}"):
            shard(ds, bad, world_size=2, rank=0)
    with pytest.raises(ValueError, match="rank=2 is out of range for world_size=2"):
        shard(ds, 2, rank=2, world_size=2)
    with pytest.raises(ValueError, match="rank=1 is out of range for world_size=1"):
        shard(ds, 2, rank=1)  # no process group: world size 1
    with pytest.raises(ValueError, match="world_size must be an int >= 1; got 0"):
        shard(ds, 2, world_size=0)
    with pytest.raises(ValueError, match="batch_size is required"):
        shard(ds)
    with pytest.raises(ValueError, match=r"batch_size is required \(the DataLoader has batch_size=None\)"):
        shard(DataLoader(ds, batch_size=None))
    with pytest.raises(TypeError, match="neither a map-style dataset"):
        shard(42, 2, world_size=1)


# ---- evaluation gathering (single process) ------------------------------------------------------------------------
def test_gather_for_eval_without_process_group():
    loader = shard(Counting(7), 3, world_size=1, seed=2)
    with pytest.raises(RuntimeError, match="not yielded a batch yet"):
        gather_for_eval(torch.zeros(3), loader)
    out = []
    for batch in loader:
        g = gather_for_eval({"id": batch, "sq": (batch.float() ** 2)[:, None]}, loader)
        out.append(g)
        with pytest.raises(ValueError, match="one row per sample"):
            gather_for_eval(batch[:1], loader)
    got = torch.cat([g["id"] for g in out]).tolist()
    assert got == torch.randperm(7, generator=torch.Generator().manual_seed(2)).tolist(), "padding kept or order lost"
    assert torch.equal(torch.cat([g["sq"] for g in out])[:, 0], torch.tensor(got).float() ** 2)
    t = torch.arange(5)
    assert gather_for_eval(t) is t
    two = shard(Counting(7), 3, rank=0, world_size=2)
    next(iter(two))
    with pytest.raises(ValueError, match="world_size=2 but there is no process group"):
        gather_for_eval(torch.zeros(3), two)


# ---- a real 2-process group: every sample exactly once ------------------------------------------------------------
def _eval_worker(sizes):
    import torch.distributed as dist

    from functrain.data import gather_for_eval, shard

    rank, world = dist.get_rank(), dist.get_world_size()
    report = {}
    for n in sizes:
        sampler = DistributedSampler(Counting(n), num_replicas=world, rank=rank, seed=1)
        configs = {
            "map_shuffled": shard(Counting(n), 3, seed=11),
            "map_ordered": shard(DataLoader(Counting(n), batch_size=4)),
            "distributed_sampler": shard(DataLoader(Counting(n), batch_size=5, sampler=sampler)),
            "iterable_strided": shard(Stream(n), 3),
            "iterable_hook": shard(HookStream(n), 3),
            "iterable_no_len": shard(Stream(n, has_len=False), 3),
            "iterable_no_len_drop": shard(Stream(n, has_len=False), 3, drop_last=True),
        }
        for name, loader in configs.items():
            assert (loader.rank, loader.world_size) == (rank, world)
            out, batches = [], 0
            for batch in loader:
                batches += 1
                g = gather_for_eval({"id": batch, "neg": (-batch, batch.bool())}, loader)
                assert torch.equal(g["neg"][0], -g["id"]) and g["neg"][1].dtype == torch.bool
                out += g["id"].tolist()
            report[(n, name)] = (out, batches)
        # results of different sizes per rank, without a loader: rank order
        mine = torch.arange(2 + 3 * rank) + 100 * rank
        report[(n, "ragged")] = (gather_for_eval(mine).tolist(), None)
    return report


def test_gather_for_eval_two_processes_each_sample_once():
    sizes = [7, 82, 99]
    reports = ft.launch(_eval_worker, nprocs=2, args=(sizes,), timeout=120)
    assert reports[0] == reports[1], "ranks gathered different results"
    report = reports[0]
    for n in sizes:
        for name in ("map_shuffled", "map_ordered", "distributed_sampler", "iterable_strided", "iterable_hook",
                     "iterable_no_len"):
            got, _ = report[(n, name)]
            assert sorted(got) == list(range(n)), f"n={n} {name}: not each sample exactly once: {got}"
        assert report[(n, "map_shuffled")][0] == torch.randperm(
            n, generator=torch.Generator().manual_seed(11)).tolist()
        assert report[(n, "map_ordered")][0] == list(range(n))
        assert report[(n, "iterable_strided")][0] == list(range(n))
        sampler = DistributedSampler(Counting(n), num_replicas=1, rank=0, seed=1)
        assert report[(n, "distributed_sampler")][0] == list(sampler)  # its permutation, unpadded
        dropped, batches = report[(n, "iterable_no_len_drop")]
        assert batches == n // 6 and len(dropped) == len(set(dropped)) == 6 * batches
        assert report[(n, "ragged")][0] == [0, 1] + [100, 101, 102, 103, 104]
