"""ft.shard over in-memory columns: one gather per batch, bit for bit the batches of the per-sample collate path.

The reference in every test is the same data behind a plain ``Dataset`` (``Rows``), which ft.shard loads
sample by sample and collates with ``default_collate``: same order, same padding, same resume position.
"""
import collections

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, Dataset, TensorDataset
from torch.utils._python_dispatch import TorchDispatchMode

import functrain as ft
from functrain.data import gather_for_eval, shard


class Rows(Dataset):
    """The same columns as an ordinary map-style dataset: item i is a tuple (or dict) of row i."""

    def __init__(self, columns):
        self.columns = columns

    def __len__(self):
        cols = self.columns.values() if isinstance(self.columns, dict) else self.columns
        return len(next(iter(cols)))

    def __getitem__(self, i):
        if isinstance(self.columns, dict):
            return {k: v[i] for k, v in self.columns.items()}
        return tuple(c[i] for c in self.columns)


def leaves(batch):
    if isinstance(batch, dict):
        return [batch[k] for k in sorted(batch)]
    return list(batch)


def same_bits(a, b):
    """Equal dtype, shape and bytes (stricter than ==: -0.0 and 0.0 differ, NaNs compare)."""
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))


def assert_same_batches(fast, slow):
    assert len(fast) == len(slow), (len(fast), len(slow))
    for k, (f, s) in enumerate(zip(fast, slow)):
        lf, ls = leaves(f), leaves(s)
        assert len(lf) == len(ls)
        for x, y in zip(lf, ls):
            assert same_bits(x, y), f"batch {k} differs from the collate path"


def make_columns(n, kind, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, generator=g)
    x[0, 0] = -0.0
    y = torch.randint(0, 10, (n,), generator=g)
    m = torch.rand(n, 2, 2, generator=g) > 0.5
    if kind == "tensor_dataset":
        return TensorDataset(x, y, m), (x, y, m)
    if kind == "tuple":
        return (x, y, m), (x, y, m)
    if kind == "numpy_tuple":
        cols = (x.numpy().astype(np.float64), y.numpy().astype(np.int32), m.numpy())
        return cols, cols
    if kind == "dict":
        cols = {"x": x, "y": y.numpy(), "m": m}
        return cols, cols
    raise AssertionError(kind)


KINDS = ["tensor_dataset", "tuple", "numpy_tuple", "dict"]


@pytest.mark.filterwarnings("ignore:ShardedLoader. an epoch yields no batch")  # tiny n with drop_last: expected
@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 40), batch=st.integers(1, 6), world=st.sampled_from([1, 2]), shuffle=st.booleans(),
       drop_last=st.booleans(), seed=st.integers(0, 1000), kind=st.sampled_from(KINDS), stop=st.integers(0, 8))
def test_gather_equals_collate_bitwise_with_resume(n, batch, world, shuffle, drop_last, seed, kind, stop):
    data, cols = make_columns(n, kind, seed)
    for r in range(world):
        kw = dict(shuffle=shuffle, seed=seed, drop_last=drop_last, rank=r, world_size=world)
        fast, slow = shard(data, batch, **kw), shard(Rows(cols), batch, **kw)
        assert len(fast) == len(slow)
        for epoch in range(2):  # the epoch advances by itself; the shuffle changes with it
            got = list(fast)
            assert_same_batches(got, list(slow))
            assert fast.state_dict() == slow.state_dict()
            assert fast.state_dict()["epoch"] == (epoch + 1 if len(fast) else 0)  # an empty epoch stays put
        # mid-epoch resume: the same position as the collate path, then the same rest
        first = shard(data, batch, **kw)
        reference = shard(Rows(cols), batch, **kw)
        k = min(stop, len(first))
        it, it_ref = iter(first), iter(reference)
        for _ in range(k):
            next(it), next(it_ref)
        assert first.state_dict() == reference.state_dict()
        resumed = shard(data, batch, **{**kw, "seed": seed + 1})  # the seed comes from the state
        resumed.load_state_dict(first.state_dict())
        rest = list(resumed)
        assert_same_batches(rest, list(reference))  # the reference goes on from the same position
        if k < len(first):
            assert_same_batches(rest, list(shard(Rows(cols), batch, **kw))[k:])


def test_structure_and_dtypes_are_kept():
    data, _ = make_columns(10, "tensor_dataset")
    b = next(iter(shard(data, 4, world_size=1)))
    assert isinstance(b, list) and len(b) == 3  # what default_collate makes of TensorDataset's tuple items
    b = next(iter(shard(make_columns(10, "tuple")[0], 4, world_size=1)))
    assert type(b) is tuple and [t.shape for t in b] == [(4, 3), (4,), (4, 2, 2)]
    Pair = collections.namedtuple("Pair", "x y")
    b = next(iter(shard(Pair(torch.zeros(10, 2), np.arange(10)), 4, world_size=1)))
    assert type(b) is Pair and b.y.dtype == torch.int64 and b.x.shape == (4, 2)
    b = next(iter(shard({"x": np.ones((10, 2), np.float32), "y": np.arange(10.0)}, 4, world_size=1)))
    assert set(b) == {"x", "y"} and b["x"].dtype == torch.float32 and b["y"].dtype == torch.float64
    ro = np.arange(10.0)
    ro.setflags(write=False)
    assert next(iter(shard((ro,), 3, shuffle=False, world_size=1)))[0].tolist() == [0.0, 1.0, 2.0]


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def test_one_gather_per_column_per_batch():
    x, y = torch.randn(64, 8), torch.randn(64, 1)
    loader = shard((x, y), 16, world_size=1)
    it = iter(loader)
    next(it)  # the epoch's order is made once, before the first batch
    with CountOps() as mode:
        next(it)
        next(it)
    assert mode.ops == {"aten.index_select": 4}, mode.ops  # 2 batches x 2 columns, nothing per sample
    with CountOps() as mode:  # the collate path, for contrast: per-sample work
        next(iter(shard(Rows((x, y)), 16, world_size=1)))
    assert sum(mode.ops.values()) > 16


def test_dataloader_of_tensor_dataset_uses_the_same_order():
    x = torch.arange(30.0)[:, None]
    dl = DataLoader(TensorDataset(x), batch_size=4, shuffle=True, drop_last=True)
    for r in range(2):
        got = list(shard(dl, rank=r, world_size=2, seed=3))
        ref = list(shard(Rows((x,)), 4, seed=3, drop_last=True, rank=r, world_size=2))
        assert_same_batches(got, ref)


def test_own_collate_fn_sees_samples():
    x, y = torch.arange(6.0), torch.arange(6) * 10
    seen = []

    def collate(items):
        seen.append(items)
        return torch.stack([a for a, _ in items]), torch.stack([b for _, b in items])

    got = list(shard((x, y), 3, shuffle=False, world_size=1, collate_fn=collate))
    assert len(seen) == 2 and seen[0][0] == (x[0], y[0])
    assert got[1][1].tolist() == [30, 40, 50]
    got = list(shard({"x": x}, 3, shuffle=False, world_size=1, collate_fn=lambda items: items))
    assert got[0] == [{"x": x[0]}, {"x": x[1]}, {"x": x[2]}]


def test_gather_for_eval_removes_padding_of_array_batches():
    x = torch.arange(7)
    loader = shard((x,), 3, world_size=1, seed=2)
    out = [gather_for_eval(b[0], loader) for b in loader]
    assert torch.cat(out).tolist() == torch.randperm(7, generator=torch.Generator().manual_seed(2)).tolist()
    assert loader.last_batch_info.real == 1 and loader.last_batch_info.rows == 3


def test_bad_columns_are_named():
    with pytest.raises(ValueError, match=r"different lengths .*\[0\]: 5, \[1\]: 4"):
        shard((torch.zeros(5, 2), np.zeros(4)), 2, world_size=1)
    with pytest.raises(ValueError, match=r"'x': 5, 'y': 6"):
        shard({"x": torch.zeros(5), "y": torch.zeros(6)}, 2, world_size=1)
    with pytest.raises(TypeError, match="'y' is a list"):
        shard({"x": torch.zeros(5), "y": [1, 2, 3, 4, 5]}, 2, world_size=1)
    with pytest.raises(TypeError, match="item 1 is a int"):
        shard((torch.zeros(5), 3), 2, world_size=1)
    with pytest.raises(ValueError, match=r"column \[0\] is 0-dimensional"):
        shard((torch.tensor(1.0),), 2, world_size=1)
    with pytest.raises(TypeError, match="dtype object"):
        shard((np.array([object()] * 4),), 2, world_size=1)
    with pytest.raises(ValueError, match="dict of columns is empty"):
        shard({}, 2, world_size=1)
    # a tuple of samples (not arrays) is still an ordinary dataset
    assert [b.tolist() for b in shard((1, 2, 3), 3, shuffle=False, world_size=1)] == [[1, 2, 3]]


def test_too_small_for_one_batch_per_rank_is_named():
    loader = shard((torch.zeros(5),), 3, rank=0, world_size=2, drop_last=True)
    assert len(loader) == 0
    with pytest.raises(ValueError, match=r"eval dataset yields no batch per rank: it has 5 samples, fewer than one "
                                         r"batch of 3 on each of 2 rank\(s\) \(6 samples\) with drop_last=True"):
        loader.check_nonempty("eval dataset")
    with pytest.warns(UserWarning, match="an epoch yields no batch: the dataset has 5 samples"):
        assert list(loader) == []
    with pytest.raises(ValueError, match="train dataset yields no batch per rank: it has 0 samples"):
        shard((torch.zeros(0),), 3, world_size=1).check_nonempty("train dataset")
    shard((torch.zeros(5),), 3, rank=0, world_size=2).check_nonempty()  # padded: one batch each


def test_array_loader_on_a_device():
    x = torch.arange(12.0)[:, None]
    b = next(iter(shard({"x": x}, 4, world_size=1, device="meta")))
    assert b["x"].device.type == "meta" and b["x"].shape == (4, 1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_columns_on_cuda_are_gathered_there():
    x = torch.randn(40, 4, device="cuda")
    got = list(shard((x,), 8, seed=1, world_size=1))
    ref = list(shard(Rows((x,)), 8, seed=1, world_size=1))
    assert_same_batches(got, ref)
    assert got[0][0].device.type == "cuda"
