"""Checkpoints: bit-exact round trips, refusal of damaged or hostile files, atomic saves, rotation, SIGKILL."""
import collections
import json
import math
import os
import pickle
import random
import shutil
import signal
import sys
import textwrap

import pytest
import torch
from conftest import kill_when_running
from hypothesis import given, settings, strategies as st

import functrain as ft
from functrain import checkpoint as ck
from functrain.core import registry
from functrain.optim import AdamState, SGDState
from functrain.core.tree import tree_equal

pytest.importorskip("safetensors")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ------------------------------------------------------------------------------------------ helpers
def same(a, b):
    """Bitwise equal trees, and the non-tensor leaves of the same type (True vs 1, -0.0 vs 0.0)."""
    if not tree_equal(a, b):
        return False
    la, lb = ft.tree.tree_leaves(a), ft.tree.tree_leaves(b)
    for x, y in zip(la, lb):
        if type(x) is not type(y) and not (torch.is_tensor(x) and torch.is_tensor(y)):
            return False
        if type(x) is float and math.copysign(1.0, x) != math.copysign(1.0, y):
            return False
    return True


def full_state(steps=3, width=512):
    """A TrainState with every transform: adamw, ema, fp16 loss scale, streaming accumulation, seeded RNG."""
    def loss_fn(params, buffers, batch):
        x, y = batch
        h = torch.nn.functional.dropout(x @ params["w"], 0.1) + params["b"]
        return ((h.sum(-1, keepdim=True) - y) ** 2).mean()

    step = ft.train_step(loss_fn, ft.optim.adamw(1e-3))
    step = ft.ema(0.9, warmup=False)(ft.mixed_precision("fp16")(ft.accumulate(2, streaming=True)(step)))
    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(width, 512, generator=g) * 0.01, "b": torch.zeros(512)}  # w: 1 MiB (mapped on load)
    buffers = {"seen": torch.zeros((), dtype=torch.int64), "stat": torch.ones(3, dtype=torch.bfloat16)}
    state = step.init(params, buffers, seed=0)
    batch = (torch.randn(4, width, generator=g), torch.randn(4, 1, generator=g))
    for _ in range(steps):
        state, _ = step(state, batch)
    return step, state, batch


def rewrite_marker(path, **changes):
    """Recompute COMPLETE.json for the files as they are now: what a consistent forger would do."""
    mpath = os.path.join(path, ck.MARKER)
    marker = json.load(open(mpath))
    for name in (ck.TREE, ck.EXTRA):
        data = open(os.path.join(path, name), "rb").read()
        marker["files"][name] = {"size": len(data), "sha256": ck.folder.sha256(data)}
    f = os.path.join(path, ck.TENSORS)
    entry = marker["files"][ck.TENSORS]
    entry.update(size=os.path.getsize(f), chunks=ck.tensorfile.digest_file(f, entry["checksum"], entry["chunk_bytes"]))
    marker.update(changes)
    open(mpath, "w").write(json.dumps(marker))


def flip_byte(file, offset):
    with open(file, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x01]))


def data_start(file):
    with open(file, "rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")


# ------------------------------------------------------------------------------------------ round trips
def test_full_state_roundtrip_is_bitwise(tmp_path):
    step, state, batch = full_state()
    assert state.rng is not None and ft.tree.tree_leaves(state.rng)   # seeded: the RNG state is in the state
    assert state.step.dtype == torch.int64 and set(state.slots) == {"ema", "mixed_precision", "accumulate"}
    path = ck.save(tmp_path / "ckpt", state, extra={"epoch": 3, "position": [1, 2]})
    assert sorted(os.listdir(path)) == sorted([ck.TENSORS, ck.TREE, ck.EXTRA, ck.MARKER])

    for kwargs in ({}, {"template": state}, {"mmap": False}, {"template": state, "mmap": False}, {"device": "cpu"}):
        loaded = ck.load(path, **kwargs)
        assert isinstance(loaded, ft.TrainState) and same(loaded, state), kwargs
        assert type(loaded.opt_state) is AdamState and type(loaded.ema) is dict
        assert type(loaded.slots["ema"]) is ft.EmaState and type(loaded.loss_scale) is ft.LossScaleState
    assert ck.load_extra(path) == {"epoch": 3, "position": [1, 2]}

    # training goes on identically from the loaded state (and the mapped tensors take in-place writes)
    loaded = ck.load(path)
    a, _ = step(state, batch)
    b, _ = step(loaded, batch)
    assert same(a, b)
    loaded.params["w"].add_(1.0)                       # copy-on-write: never reaches the file
    assert same(ck.load(path), state)


def test_the_file_is_plain_safetensors(tmp_path):
    from safetensors.torch import load_file

    _, state, _ = full_state(steps=1, width=8)
    path = ck.save(tmp_path / "c", state)
    tensors = load_file(os.path.join(path, ck.TENSORS))
    rng = {f"rng/{k}": v for k, v in state.rng.items()}
    assert set(tensors) >= {"params/w", "opt_state/exp_avg/w", "step", "slots/ema/params/w",
                            "slots/mixed_precision/scale", "slots/accumulate/grads/b", *rng}
    assert torch.equal(tensors["step"], state.step)
    assert all(torch.equal(tensors[k], v) for k, v in rng.items())


DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool, torch.complex64, torch.float8_e4m3fn, torch.float8_e5m2]


@st.composite
def tensors(draw):
    dtype = draw(st.sampled_from(DTYPES))
    shape = tuple(draw(st.lists(st.integers(0, 5), max_size=3)))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    raw = torch.randint(0, 256, (max(1, math.prod(shape)) * dtype.itemsize + 16,), generator=g, dtype=torch.uint8)
    if dtype == torch.bool:
        raw = raw % 2
    base = raw[: math.prod(shape) * dtype.itemsize].view(dtype).reshape(shape)  # any bit pattern: NaNs, -0.0, ...
    form = draw(st.sampled_from(["plain", "transposed", "strided", "offset"]))
    if form == "transposed" and base.dim() >= 2:
        return base.transpose(0, 1)                    # non-contiguous
    if form == "strided" and base.dim() >= 1:
        return base[::2]
    if form == "offset" and base.numel() > 1:
        return base.reshape(-1)[1:]                    # storage offset
    return base


scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.text(max_size=5),
                    st.floats(allow_nan=False), st.sampled_from([0.0, -0.0, math.inf, -math.inf]))


def trees(leaves):
    keys = st.one_of(st.text(max_size=4), st.integers(-3, 3))
    return st.recursive(
        leaves,
        lambda sub: st.one_of(
            st.dictionaries(keys, sub, max_size=3),   # empty dicts too
            st.dictionaries(st.text(max_size=3), sub, max_size=3).map(collections.OrderedDict),
            st.lists(sub, max_size=3),
            st.lists(sub, max_size=3).map(tuple),
            st.tuples(sub, sub, sub).map(lambda t: AdamState(*t)),
            st.tuples(sub, sub).map(lambda t: SGDState(*t)),
            st.tuples(sub, sub).map(lambda t: ft.EmaState(*t)),
        ),
        max_leaves=8,
    )


@settings(max_examples=150)
@given(tree=trees(st.one_of(tensors(), scalars)), shared=st.booleans(), mmap=st.booleans())
def test_hypothesis_trees_roundtrip(tree, shared, mmap, tmp_path_factory):
    if shared:  # leaves that share storage: a base, a view of it, and the same tensor twice
        base = torch.arange(12, dtype=torch.float32)
        tree = {"tree": tree, "base": base, "view": base[2:8].view(2, 3), "again": base, "t": base.view(3, 4).t()}
    path = str(tmp_path_factory.mktemp("h") / "c")
    ck.save(path, tree, fsync=False)
    assert same(ck.load(path, mmap=mmap), tree)
    assert same(ck.load(path, template=tree, mmap=mmap), tree)


def test_large_and_odd_tensors_roundtrip(tmp_path):
    g = torch.Generator().manual_seed(1)
    big = torch.randn(600, 1024, generator=g)                      # mapped
    tree = {
        "big_t": big.t(),                                          # non-contiguous, mapped after the copy
        "big_bf16": big.to(torch.bfloat16),
        "big_view": big[100:400],                                  # shares big's storage, with an offset
        "zero_dim": torch.tensor(-0.0),
        "empty": torch.empty(0, 3, dtype=torch.float16),
        "nan_payload": torch.tensor([0x7FC00001, -1], dtype=torch.int32).view(torch.float32),
        "uint8": torch.randint(0, 256, (5000,), generator=g, dtype=torch.uint8),
        "nested": {"": {}, "l": [], "t": (), "n": None, 7: "seven", -1: 1.5, True: False},
    }
    path = ck.save(tmp_path / "c", tree)
    for mmap in (True, False):
        assert same(ck.load(path, mmap=mmap), tree)
    assert list(ck.load(path)["nested"]) == ["", "l", "t", "n", 7, -1, True]  # insertion order kept


def test_checksum_sha256_and_multi_chunk_file(tmp_path, monkeypatch):
    monkeypatch.setattr(ck.tensorfile, "CHUNK_BYTES", 1 << 16)      # many checksum chunks, tensors across them
    tree = {"a": torch.randn(100_000), "b": torch.randn(3), "c": torch.randn(70_000).to(torch.float64)}
    for algo in ("crc32", "sha256"):
        path = ck.save(tmp_path / algo, tree, checksum=algo)
        entry = json.load(open(os.path.join(path, ck.MARKER)))["files"][ck.TENSORS]
        assert entry["checksum"] == algo and len(entry["chunks"]) > 10
        assert entry["chunks"] == ck.tensorfile.digest_file(os.path.join(path, ck.TENSORS), algo, 1 << 16)
        assert same(ck.load(path), tree) and same(ck.load(path, mmap=False), tree)
        flip_byte(os.path.join(path, ck.TENSORS), os.path.getsize(os.path.join(path, ck.TENSORS)) - 5)
        with pytest.raises(ck.CheckpointError, match="checksum mismatch"):
            ck.load(path)


# ------------------------------------------------------------------------------------------ templates
def test_template_mismatches_name_the_first_path(tmp_path):
    _, state, _ = full_state(steps=1, width=8)
    path = ck.save(tmp_path / "c", state)

    def bad(template, pattern):
        with pytest.raises(ck.CheckpointError, match=pattern):
            ck.load(path, template=template)

    p = state.params
    bad(state.replace(params={**p, "w": torch.zeros(9, 512)}), r"at 'params/w'.*\(8, 512\).*\(9, 512\)")
    bad(state.replace(params={**p, "b": p["b"].double()}), r"at 'params/b'.*float32.*float64")
    bad(state.replace(params={"w": p["w"]}), r"at 'params'.*only in the checkpoint \['b'\]")
    bad(state.replace(params={**p, "extra": torch.zeros(1)}), r"at 'params'.*only in the template \['extra'\]")
    bad(state.replace(params=[p["w"], p["b"]]), r"at 'params'.*dict in the checkpoint, list in the template")
    bad(state.replace(rng=None), r"at 'rng'")
    bad(state.replace(opt_state=SGDState(state.opt_state.count, None)), r"at 'opt_state'.*AdamState.*SGDState")
    bad(state.replace(step=5), r"at 'step'.*tensor in the checkpoint, int in the template")
    bad(tuple(state), r"at '<root>'.*TrainState in the checkpoint, tuple in the template")
    # with a matching template the tensors follow the template's devices; ``device`` overrides them
    assert same(ck.load(path, template=state), state)
    moved = ck.load(path, template=state.replace(params={**p, "w": p["w"].to("meta")}))
    assert moved.params["w"].device.type == "meta" and moved.params["b"].device.type == "cpu"
    assert {t.device.type for t in ft.tree.tree_leaves(ck.load(path, device="meta"))} == {"meta"}
    assert {t.device.type for t in ft.tree.tree_leaves(ck.load(path, template=state, device="meta"))} == {"meta"}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_state_roundtrip(tmp_path):
    _, state, _ = full_state(steps=1)
    gpu = ft.tree.tree_map(lambda t: t.cuda() if t.is_floating_point() else t, state)
    path = ck.save(tmp_path / "c", gpu)
    assert {t.device.type for t in ft.tree.tree_leaves(ck.load(path))} == {"cpu"}
    assert same(ck.load(path, template=gpu), gpu)
    assert same(ck.load(path, template=gpu, mmap=False), gpu)
    assert same(ck.load(path, device="cuda"), ft.tree.tree_map(lambda t: t.cuda(), state))


# ------------------------------------------------------------------------------------------ damaged and hostile files
@pytest.fixture
def saved(tmp_path):
    _, state, _ = full_state(steps=1, width=8)
    return ck.save(tmp_path / "c", state, extra={"k": 1}), state


def test_truncated_tensor_file_is_refused_naming_it(saved):
    path, _ = saved
    f = os.path.join(path, ck.TENSORS)
    os.truncate(f, os.path.getsize(f) - 100)
    with pytest.raises(ck.CheckpointError, match=f"{f}: size .* truncated"):
        ck.load(path)
    rewrite_marker(path)  # the mark agrees with the truncated file: safetensors itself refuses it
    with pytest.raises(ck.CheckpointError, match=f"{f}: refused by safetensors"):
        ck.load(path)


@pytest.mark.parametrize("mmap", [True, False])
@pytest.mark.parametrize("where", ["data", "header"])
def test_edited_tensor_file_is_refused_naming_it(saved, where, mmap):
    path, _ = saved
    f = os.path.join(path, ck.TENSORS)
    if where == "data":
        flip_byte(f, data_start(f) + 3)
    else:  # a shape digit in the header: still valid safetensors, caught by the checksum
        raw = open(f, "rb").read()
        i = raw.index(b'"shape":[8,512]')
        open(f, "r+b").write(raw[:i] + b'"shape":[8,256]' + raw[i + 15:])
    with pytest.raises(ck.CheckpointError, match=f"{f}"):
        ck.load(path, mmap=mmap)


@pytest.mark.parametrize("name", [ck.TREE, ck.EXTRA, ck.MARKER])
def test_edited_json_files_are_refused_naming_them(saved, name):
    path, _ = saved
    f = os.path.join(path, name)
    text = open(f).read()
    edited = text.replace('"v":"w"', '"v":"W"') if name == ck.TREE else text.replace("1", "2", 1)
    assert edited != text
    open(f, "w").write(edited)
    with pytest.raises(ck.CheckpointError, match=f):
        ck.load(path) if name != ck.EXTRA else ck.load_extra(path)


def test_edited_tree_with_a_forged_mark_is_still_checked(saved):
    path, state = saved
    f = os.path.join(path, ck.TREE)
    doc = json.load(open(f))
    doc["tree"]["type"] = "os.system"              # a type name is looked up in the allow-list, never imported
    open(f, "w").write(json.dumps(doc))
    rewrite_marker(path)
    with pytest.raises(ck.CheckpointError, match=f"{f}: node type 'os.system' is not an allowed"):
        ck.load(path)
    doc["tree"]["type"] = "functrain.TrainState"
    doc["tree"]["children"][0]["children"][0]["shape"] = [4, 512]   # disagrees with the safetensors header
    open(f, "w").write(json.dumps(doc))
    rewrite_marker(path)
    with pytest.raises(ck.CheckpointError, match="params/w"):
        ck.load(path)


class Payload:
    """Unpickling this creates ``marker``: proof that a pickle ran."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("victim", [ck.TENSORS, ck.TREE, ck.MARKER])
@pytest.mark.parametrize("forge", [False, True])
@pytest.mark.parametrize("fmt", ["pickle", "torch.save"])
def test_pickle_payload_is_refused_and_never_runs(saved, tmp_path, victim, forge, fmt):
    path, state = saved
    marker = tmp_path / "PWNED"
    # the payload is live: unpickling a twin of it does create its marker file
    twin = tmp_path / "twin"
    pickle.loads(pickle.dumps(Payload(str(twin))))
    assert twin.exists()

    f = os.path.join(path, victim)
    os.remove(f)
    if fmt == "pickle":
        open(f, "wb").write(pickle.dumps(Payload(str(marker))))
    else:
        torch.save({"w": Payload(str(marker))}, f)
    if forge and victim != ck.MARKER:
        rewrite_marker(path)
    for attempt in (lambda: ck.load(path), lambda: ck.load(path, template=state, mmap=False)):
        with pytest.raises(ck.CheckpointError, match=f):
            attempt()
    if victim == ck.MARKER:
        with pytest.raises(ck.CheckpointError, match=f):
            ck.load_extra(path)
    assert not marker.exists()


def test_loading_never_unpickles(saved, monkeypatch):
    path, state = saved

    def forbidden(*args, **kwargs):
        raise AssertionError("pickle used while loading a checkpoint")

    for obj, name in [(pickle, "load"), (pickle, "loads"), (pickle, "Unpickler"), (torch, "load")]:
        monkeypatch.setattr(obj, name, forbidden)
    assert same(ck.load(path, template=state), state)
    assert ck.load_extra(path) == {"k": 1}


def test_folder_without_the_mark_is_never_loaded(tmp_path):
    mgr = ck.CheckpointManager(tmp_path, keep=5)
    _, state, _ = full_state(steps=1, width=8)
    mgr.save(1, state)
    mgr.save(2, state)
    os.remove(os.path.join(mgr.path(2), ck.MARKER))
    with pytest.raises(ck.CheckpointError, match="no completion mark"):
        ck.load(mgr.path(2))
    assert mgr.latest() == mgr.path(1) and mgr.steps() == [1]
    # a temporary folder with everything in it (the kill came just before its rename) is ignored too
    tmp = tmp_path / ".step_00000003.tmp-0123456789ab"
    shutil.copytree(mgr.path(1), tmp)
    assert mgr.latest() == mgr.path(1)
    mgr.save(4, state)                                   # ... and cleaned up by the next save
    assert not tmp.exists() and mgr.steps() == [1, 4]
    assert ck.load(mgr.path(1)) is not None
    with pytest.raises(ck.CheckpointError, match="no such checkpoint"):
        ck.load(tmp_path / "nowhere")


# ------------------------------------------------------------------------------------------ saving
def test_rotation_keeps_the_newest_k(tmp_path):
    mgr = ck.CheckpointManager(tmp_path / "run", keep=3)
    assert mgr.latest() is None and mgr.load_latest() is None
    states = {}
    for s in range(1, 7):
        states[s] = {"w": torch.full((4,), float(s)), "step": torch.tensor(s)}
        mgr.save(s, states[s], extra={"s": s})
        assert mgr.steps() == list(range(max(1, s - 2), s + 1))
    assert sorted(os.listdir(tmp_path / "run")) == ["step_00000004", "step_00000005", "step_00000006"]
    r = mgr.load_latest(template=states[6])
    assert (r.step, r.extra, r.path) == (6, {"s": 6}, mgr.path(6)) and same(r.state, states[6])
    mgr.save(2, states[2])                               # an older step is kept when just saved
    assert mgr.steps() == [2, 5, 6]


def test_a_failed_save_prunes_nothing_and_leaves_no_trace(tmp_path, monkeypatch):
    mgr = ck.CheckpointManager(tmp_path, keep=2)
    state = {"w": torch.randn(1000)}
    mgr.save(1, state)
    mgr.save(2, state)
    real = ck.folder.write_tensors

    def failing(path, *args, **kwargs):
        real(path, *args, **kwargs)
        raise OSError("disk full")

    monkeypatch.setattr(ck.folder, "write_tensors", failing)  # as save() looks it up
    with pytest.raises(OSError, match="disk full"):
        mgr.save(3, state)
    assert mgr.steps() == [1, 2] and sorted(os.listdir(tmp_path)) == ["step_00000001", "step_00000002"]


def test_unsavable_states_raise_before_writing(tmp_path):
    import numpy as np

    from typing import NamedTuple

    class Point(NamedTuple):
        x: torch.Tensor
        y: int

    class Other(NamedTuple):
        a: int

    for bad, pattern in [({"a": np.zeros(2)}, r"numpy.ndarray at 'a'"), ({"p": Point(torch.ones(1), 2)}, "register"),
                         ({"d": collections.defaultdict(list)}, "defaultdict"),
                         ({"q": torch.ones(2, dtype=torch.complex128)}, "complex128"),
                         ({(1, 2): torch.ones(1)}, "key")]:
        with pytest.raises(TypeError, match=pattern):
            ck.save(tmp_path / "c", bad)
    with pytest.raises(TypeError, match="JSON"):
        ck.save(tmp_path / "c", {"w": torch.ones(1)}, extra={"x": object()})
    assert os.listdir(tmp_path) == []

    ck.register_checkpoint_type(Point, name="tests.Point")
    tree = {"p": Point(torch.ones(2), 2)}
    assert same(ck.load(ck.save(tmp_path / "c", tree)), tree)
    with pytest.raises(ValueError, match="already registered"):
        ck.register_checkpoint_type(Other, name="tests.Point")
    registry.unregister("tests.Point")
    with pytest.raises(ck.CheckpointError, match="'tests.Point' is not an allowed"):
        ck.load(tmp_path / "c")


def test_replacing_a_checkpoint_and_recovering_an_aside_one(tmp_path):
    a, b = {"w": torch.zeros(3)}, {"w": torch.ones(3)}
    path = ck.save(tmp_path / "c", a)
    ck.save(path, b)
    assert same(ck.load(path), b) and os.listdir(tmp_path) == ["c"]
    # a kill between the two renames of a replacement leaves the old checkpoint aside: found, and put back
    mgr = ck.CheckpointManager(tmp_path / "m", keep=2)
    mgr.save(5, a)
    aside = tmp_path / "m" / ".step_00000005.old-0123456789ab"
    os.rename(mgr.path(5), aside)
    assert mgr.latest() == str(aside) and same(mgr.load_latest().state, a)
    mgr.save(6, b)
    assert mgr.steps() == [5, 6] and os.path.isdir(mgr.path(5)) and not aside.exists()


def test_load_latest_falls_back_past_a_damaged_checkpoint(tmp_path):
    mgr = ck.CheckpointManager(tmp_path, keep=3)
    mgr.save(1, {"w": torch.zeros(100)})
    mgr.save(2, {"w": torch.ones(100)})
    flip_byte(os.path.join(mgr.path(2), ck.TENSORS), data_start(os.path.join(mgr.path(2), ck.TENSORS)) + 1)
    with pytest.warns(RuntimeWarning, match="step_00000002.*checksum mismatch"):
        r = mgr.load_latest()
    assert r.step == 1 and same(r.state, {"w": torch.zeros(100)})
    with pytest.raises(ck.CheckpointError):
        mgr.load_latest(fallback=False)


# ------------------------------------------------------------------------------------------ SIGKILL
CHILD = textwrap.dedent("""
    import sys
    sys.path.insert(0, {root!r})
    import torch
    from functrain import checkpoint as ck

    def make_state(step):
        g = torch.Generator().manual_seed(step % 3)
        return {{"params": {{"w": torch.randn(1024, 1024, generator=g), "b": torch.randn(1024, generator=g)}},
                 "moments": [torch.randn(512, 1024, generator=g).to(torch.bfloat16), None],
                 "step": torch.tensor(step, dtype=torch.int64),
                 "rng": torch.randint(0, 256, (5056,), generator=g, dtype=torch.uint8)}}

    if __name__ == "__main__":
        folder, start = sys.argv[1], int(sys.argv[2])
        states = [make_state(s) for s in range(3)]
        mgr = ck.CheckpointManager(folder, keep=1)  # the sharpest case: one checkpoint, replaced on every save
        print("ready", flush=True)
        step = start
        while True:
            state = dict(states[step % 3], step=torch.tensor(step, dtype=torch.int64))
            mgr.save(step, state, extra={{"step": step}})
            print("saved", step, flush=True)
            step += 1
""")


def test_sigkill_during_saves_leaves_the_newest_complete_checkpoint_loadable(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(CHILD.format(root=ROOT))
    scope: dict = {}
    exec(CHILD.format(root=ROOT).split('if __name__')[0], scope)
    make_state = scope["make_state"]
    folder = tmp_path / "ckpts"
    mgr = ck.CheckpointManager(folder, keep=1)
    mgr.save(0, make_state(0), extra={"step": 0})
    rng = random.Random(20240607)
    kills_in_save = 0
    for _ in range(10):
        start = mgr.steps()[-1] + 1
        returncode, lines = kill_when_running([sys.executable, str(script), str(folder), str(start)],
                                              rng.uniform(0.0, 0.5))
        assert returncode == -signal.SIGKILL
        saved = [int(x[1]) for x in lines if x[0] == "saved"]
        leftovers = [e for e in os.listdir(folder) if e.startswith(".")]
        kills_in_save += bool(leftovers)
        latest = mgr.latest()
        assert latest is not None
        r = mgr.load_latest()
        assert r.path == latest and r.step >= max(saved, default=start - 1)
        assert same(r.state, dict(make_state(r.step), step=torch.tensor(r.step))), r.step
        assert r.extra == {"step": r.step}
        for s in mgr.steps():                              # every complete checkpoint loads
            assert same(ck.load(mgr.path(s)), dict(make_state(s), step=torch.tensor(s)))
        assert len(mgr.steps()) <= 2                       # keep=1, plus the new one before its pruning
    print(f"{kills_in_save} of 10 kills left a temporary folder")
    assert kills_in_save >= 1  # at least one kill landed mid-save (a temporary folder was left)


def test_save_never_replaces_something_that_is_not_a_checkpoint(tmp_path):
    precious = tmp_path / "project"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not a functrain checkpoint"):
        ck.save(precious, {"w": torch.ones(1)})
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileExistsError):
        ck.save(tmp_path / "file", {"w": torch.ones(1)})
    assert (precious / "notes.txt").read_text() == "keep me"
    assert sorted(os.listdir(tmp_path)) == ["file", "project"]
