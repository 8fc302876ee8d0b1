"""ft.memory: the state's bytes by part, the compiled step's peak from its capture (within 20% of the peak measured
in a fresh process, on MLP stacks, attention blocks, a conv net and the LM), computed without running a step (the
first call compiles that very capture), and a clear warning when the estimate exceeds the device's memory."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest
import torch

import functrain as ft
import functrain.compiler.runtime as runtime
from functrain import tree as T
from functrain.compiler.estimate import state_bytes

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def _job(*args) -> Any:
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}
    out = subprocess.run([sys.executable, os.path.join(HERE, "peak_job.py"), *map(str, args)], env=env,
                         capture_output=True, text=True, timeout=1500)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


# The cases ft.memory's accuracy is stated for (docs/compiling.md, functrain/compiler/estimate.py), each measured
# here in a fresh process (tests/compiler/peak_job.py), donated inductor steps, without remat and with every block
# marked ft.remat (nothing_saveable, its default: full recomputation). Before the walk followed inductor's
# kernels (decomposition, fusion), the estimate / allocator's peak was, without / with remat: MLP stack 1.10 / 0.78
# (an under-estimate), MLP 1.09, attention 1.04 / 0.95, SDPA 1.03 / 0.90, conv net 0.83 / 1.05, LM 1.02 / 0.97;
# now 1.10 / 0.99, 1.00, 1.04 / 1.03, 1.03 / 1.08, 1.00 / 1.00, 1.01 / 1.11 (functrain/compiler/estimate.py).
CASES = {
    # 4 blocks Linear(64, 512) + GELU + Linear(512, 64), batch 4096, AdamW + EMA
    "mlp_stack": ("--model", "mlp", "--layers", 4, "--d", 64, "--hidden", 512, "--batch", 4096),
    # 4 x (Linear(512, 512) + ReLU), batch 1024, AdamW + EMA: no remat only
    "mlp": ("--model", "mlp", "--layers", 4, "--d", 512, "--batch", 1024, "--policy", "none"),
    # 2 pre-norm blocks (attention written out: scores, causal mask, softmax; then an MLP), d 64, 4 heads,
    # sequence 128, batch 16
    "attention": ("--model", "attn", "--layers", 2, "--d", 64, "--seq", 128, "--batch", 16),
    # the same blocks with F.scaled_dot_product_attention
    "sdpa": ("--model", "sdpa", "--layers", 2, "--d", 64, "--seq", 128, "--batch", 16),
    # 2 blocks conv 3x3 + BatchNorm + ReLU (the second max-pooled), width 16, 32x32 RGB images, batch 32
    "conv": ("--model", "conv", "--layers", 2, "--d", 16, "--seq", 32, "--batch", 32),
    # the transformer LM: 4 layers, d 128, sequence 256, batch 8, SGD
    "lm": ("--model", "lm"),
}


@pytest.fixture(scope="module")
def measured() -> dict:
    """Every case of CASES measured in one fresh process (one import of torch and inductor for all)."""
    cases = {name: [*args, *(() if "--policy" in args else ("--policy", "none,nothing_saveable"))]
             for name, args in CASES.items()}
    return _job("--cases", json.dumps(cases))


@pytest.mark.parametrize("case", CASES)
def test_estimate_is_within_20_percent_of_the_measured_peak(measured, case):
    """ft.memory's step peak, computed before the first step, against one donated inductor step measured in a
    fresh process: within 20% of the step's peak counted at torch's allocator and never under it (the promise:
    an under-estimate is the worse error, a run it says fits would run out of memory), and not under 0.8 of the
    RSS high-water mark above rest. Above the RSS by more than 20% is allowed where the RSS is below the
    allocator's peak (pages the allocator handed out and the step never touched: with remat, the LM's RSS is
    0.94 of its allocator peak, so an estimate at 1.18 of the allocator is 1.25 of the RSS). The first call
    compiled that capture (one compile, no second trace)."""
    for r in measured[case]:
        assert 1.0 <= r["estimate"] / r["alloc_peak"] <= 1.2, r
        assert r["estimate"] / r["peak"] >= 0.8, r
        assert r["estimate"] / r["peak"] <= 1.2 or r["peak"] < r["alloc_peak"], r
        assert r["compiles"] == 1, r


def _step(**kw):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 8))
    apply_fn, params, buffers = ft.functionalize(model)

    def loss_fn(p, b, batch):
        return torch.nn.functional.mse_loss(apply_fn(p, b, batch[0]), batch[1])

    step = ft.ema(0.9, warmup=False)(ft.mixed_precision("fp16")(ft.train_step(loss_fn, ft.optim.adamw(1e-3))))
    return step, step.init(params, buffers, **kw), (torch.randn(32, 64), torch.randn(32, 8))


def test_state_bytes_by_part():
    """Params, optimizer moments, each slot and the rest, each storage counted once (a flat state's per-leaf
    views count their one buffer); the one line names each part and the total."""
    step, state, batch = _step()
    n = sum(p.numel() for p in state.params.values()) * 4
    parts = state_bytes(state)
    hyper = sum(t.numel() * t.element_size() for t in T.tree_leaves(state.slots["ema"].hyper))
    assert hyper == 8 * len(ft.get_hyper(state)["ema"])  # its decay and warm-up constants, float64 (issue 40)
    assert parts["params"] == n and parts["slots/ema"] == n + 8 + hyper  # the EMA's params, int64 counter, values
    assert 2 * n <= parts["optimizer"] <= 2 * n + 64  # two moments and a count
    assert parts["slots/mixed_precision"] > 0 and parts["buffers"] == 0
    _, flat, _ = _step(flat=True)
    assert state_bytes(flat)["params"] == n  # one buffer, not the views again
    line = str(ft.memory(step, state, batch))
    assert line.startswith("memory per rank on cpu: state ") and "params" in line and "ema" in line
    assert "step peak +" in line and "\n" not in line


def test_memory_runs_no_step_and_its_capture_is_the_one_compiled(monkeypatch):
    """ft.memory traces, never steps: the state, its RNG key and the global generator are untouched, nothing
    compiles; the compiled step's first call compiles that capture (one trace in all, one compile)."""
    traces = []
    real = runtime.trace
    monkeypatch.setattr(runtime, "trace", lambda *a, **k: traces.append(1) or real(*a, **k))
    step, state, batch = _step(seed=3)
    before = T.tree_map(torch.clone, state)
    cstep = ft.compile(step, backend="aot_eager")
    g = torch.get_rng_state()
    est = ft.memory(cstep, state, batch)
    assert T.tree_equal(state, before) and torch.equal(torch.get_rng_state(), g)
    assert cstep.compiles == 0 and len(traces) == 1 and est.step_peak > 0
    new, _ = cstep(state, batch)
    assert cstep.compiles == 1 and len(traces) == 1, "the first call traced again"
    eager, _ = step(state, batch)
    assert max(float((a - b).abs().max()) for a, b in zip(T.tree_leaves(new.params), T.tree_leaves(eager.params))) < 1e-5
    # donate=True (as ft.run calls it) keeps its capture on the donating call; no recycled set is counted
    donated = ft.memory(cstep, state, batch, donate=True)
    assert donated.new_state == 0 and est.new_state > 0


def test_an_estimate_over_the_devices_memory_warns_with_the_numbers():
    """A loss whose matmul input is 4 * 10^10 bytes (a 1 x 1 batch expanded and scaled): traced on fake tensors,
    nothing is allocated, and the warning names the total, the peak, the op, the device's memory and what to do."""
    n = 100_000
    step = ft.train_step(lambda p, b, x: ((x.expand(n, n) * p["w"]) @ torch.ones(n, 1)).mean(), ft.optim.sgd(0.1))
    state = step.init({"w": torch.ones(1)})
    with pytest.warns(RuntimeWarning, match=r"needs about \d+\.\d\d GiB per rank on cpu .*step peak .*but the "
                                            r"device has .*ft\.remat"):
        est = ft.memory(step, state, torch.ones(1, 1))
    assert est.step_peak >= 4 * 10**10 and est.over() is not None


def test_bad_arguments_are_named():
    step, state, batch = _step()
    with pytest.raises(TypeError, match="takes a functrain Step, CompiledStep or runner; got function"):
        ft.memory(lambda s, b: (s, {}), state, batch)
    with pytest.raises(TypeError, match="the TrainState the step will run on; got dict"):
        ft.memory(step, {"w": torch.ones(1)}, batch)
    other = ft.train_step(lambda p, b, x: p["0.weight"].sum(), ft.optim.sgd(0.1))
    with pytest.raises(ValueError, match="does not match this step"):
        ft.memory(other, state, batch)
