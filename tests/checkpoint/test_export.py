"""Final weights as plain state_dict files: strict load into a fresh module, equal tensors, atomic writes."""
from __future__ import annotations

import os

import pytest
import torch

import functrain as ft
from functrain.checkpoint import export_state_dict, export_weights
from functrain.checkpoint.export import flat_state_dict

safetensors_torch = pytest.importorskip("safetensors.torch")


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 8)
        self.bn = torch.nn.BatchNorm1d(8)
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)])
        self.register_buffer("scratch", torch.zeros(3), persistent=False)  # not in state_dict()

    def forward(self, x, y):
        h = self.blocks[1](torch.relu(self.blocks[0](self.bn(self.fc(x)))))
        return torch.nn.functional.cross_entropy(h, y)


class Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight  # tied: state_dict() lists both names

    def forward(self, x):
        return self.head(self.embed(x)).sum()


def _trained_state(model):
    apply_fn, params, buffers = ft.functionalize(model)
    step = ft.ema(0.5, warmup=False)(ft.train_step(lambda p, b, batch: apply_fn(p, b, *batch), ft.optim.sgd(0.1)))
    state = step.init(params, buffers, seed=0)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        batch = (torch.randn(16, 4, generator=g), torch.randint(0, 2, (16,), generator=g))
        state, _ = step(state, batch)
    return state


def _assert_equal(loaded, expected):
    assert set(loaded) == set(expected)
    for k in expected:
        assert loaded[k].dtype == expected[k].dtype and torch.equal(loaded[k], expected[k]), k


def test_model_and_ema_files_load_strictly_into_a_fresh_module(tmp_path):
    torch.manual_seed(0)
    model = Net()
    state = _trained_state(model)
    assert int(state.buffers["bn.num_batches_tracked"]) == 3  # the buffers did move
    paths = export_weights(tmp_path, state, module=model)
    assert paths == {"model": str(tmp_path / "model.safetensors"), "ema": str(tmp_path / "ema.safetensors")}

    for which, params in (("model", state.params), ("ema", state.ema)):
        fresh = Net()
        loaded = safetensors_torch.load_file(paths[which])
        fresh.load_state_dict(loaded, strict=True)
        expected = {**params, **{k: v for k, v in state.buffers.items() if k != "scratch"}}
        _assert_equal(fresh.state_dict(), expected)
    assert not torch.equal(state.ema["fc.weight"], state.params["fc.weight"])  # two different files
    with open(paths["model"], "rb") as f:
        import json
        import struct

        (n,) = struct.unpack("<Q", f.read(8))
        meta = json.loads(f.read(n))["__metadata__"]
    assert meta == {"format": "pt", "step": "3", "weights": "params"}
    assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p]


def test_without_module_nested_trees_are_flattened_with_dots(tmp_path):
    model = Net()
    tree = {"fc": {"weight": model.fc.weight.detach(), "bias": model.fc.bias.detach()},
            "bn": {"weight": model.bn.weight.detach(), "bias": model.bn.bias.detach()},
            "blocks": [{"weight": b.weight.detach(), "bias": b.bias.detach()} for b in model.blocks]}
    buffers = {"bn": {k: getattr(model.bn, k) for k in ("running_mean", "running_var", "num_batches_tracked")}}
    export_state_dict(tmp_path / "w.safetensors", tree, buffers)
    fresh = Net()
    fresh.load_state_dict(safetensors_torch.load_file(tmp_path / "w.safetensors"), strict=True)
    _assert_equal(fresh.state_dict(), model.state_dict())


def test_shared_storage_views_and_tied_weights(tmp_path):
    base = torch.arange(12.0)
    tree = {"a": base[:6].view(2, 3), "b": base[6:].view(3, 2).t(), "c": base}  # views of one storage, non-contiguous
    export_state_dict(tmp_path / "s.safetensors", tree)
    loaded = safetensors_torch.load_file(tmp_path / "s.safetensors")
    _assert_equal(loaded, {k: v.contiguous() for k, v in tree.items()})
    base.zero_()  # the file is a copy, not a view
    assert loaded["c"].sum() == 66 and safetensors_torch.load_file(tmp_path / "s.safetensors")["c"].sum() == 66

    model = Tied()
    _, params, buffers = ft.functionalize(model)
    assert set(params) == {"embed.weight"}  # tied parameters appear once in the state
    with pytest.raises(RuntimeError, match="head.weight"):
        Tied().load_state_dict(safetensors_torch.load_file(export_state_dict(tmp_path / "t0.safetensors", params)),
                               strict=True)
    path = export_state_dict(tmp_path / "t.safetensors", params, buffers, module=model)
    fresh = Tied()
    fresh.load_state_dict(safetensors_torch.load_file(path), strict=True)
    assert torch.equal(fresh.head.weight, model.embed.weight) and fresh.head.weight is fresh.embed.weight


def test_bad_trees_are_refused_with_the_name(tmp_path):
    with pytest.raises(TypeError, match="fc.step is a int, not a tensor"):
        export_state_dict(tmp_path / "x.safetensors", {"fc": {"step": 3}})
    with pytest.raises(ValueError, match="'w' occurs twice"):
        flat_state_dict({"w": torch.ones(1)}, {"w": torch.ones(1)})
    with pytest.raises(ValueError, match=r"has \['fc.bias'.*but the tree does not"):
        export_state_dict(tmp_path / "x.safetensors", {"fc.weight": torch.ones(8, 4)}, module=Net())
    with pytest.raises(ValueError, match=r"\['extra'\] are not in the module's state_dict"):
        flat_state_dict({**dict(Net().state_dict()), "extra": torch.ones(1)}, module=Net())
    with pytest.raises(ValueError, match="no tensors"):
        export_state_dict(tmp_path / "x.safetensors", {})
    assert not os.path.exists(tmp_path / "x.safetensors")


def test_bf16_and_int_dtypes_survive(tmp_path):
    tree = {"w": torch.randn(3, 3).to(torch.bfloat16), "n": torch.tensor(7, dtype=torch.int64), "e": torch.empty(0)}
    loaded = safetensors_torch.load_file(export_state_dict(tmp_path / "d.safetensors", tree))
    _assert_equal(loaded, tree)
