"""ft.compile on CUDA: mode="reduce-overhead" on the fast path (functrain/compiler/cudagraph.py).

The CUDA tests are skipped without a CUDA device. The CPU test checks the stated fallback:
a step that cannot be a CUDA graph warns why and still equals the eager step.
"""
import pytest
import torch

import functrain as ft
from functrain import tree as T
from functrain.compiler.cudagraph import why_not

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def problem(device, autocast=False, seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)).to(device)
    apply_fn, params, buffers = ft.functionalize(model)

    def loss_fn(params, buffers, batch):
        x, y = batch
        if autocast:
            with torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16):
                out = apply_fn(params, buffers, x)
            return torch.nn.functional.mse_loss(out.float(), y)
        return torch.nn.functional.mse_loss(apply_fn(params, buffers, x), y)

    step = ft.clip(1.0)(ft.train_step(loss_fn, ft.optim.adamw(1e-2)))
    g = torch.Generator().manual_seed(seed + 1)
    batches = [(torch.randn(24, 16, generator=g).to(device), torch.randn(24, 1, generator=g).to(device))
               for _ in range(5)]
    return step, params, buffers, batches


def _compare(step, run, params, buffers, batches, n, rtol, atol):
    e = step.init({k: v.clone() for k, v in params.items()}, buffers)
    c = T.tree_map(torch.clone, e)
    for i in range(n):
        b = batches[i % len(batches)]
        e, em = step(e, b)
        c, cm = run(c, b)
        assert T.tree_allclose(em, cm, rtol=rtol, atol=atol), f"metrics differ at step {i}"
    assert T.tree_allclose(e, c, rtol=rtol, atol=atol)


@cuda
def test_donated_reduce_overhead_step_equals_eager_over_20_steps_in_one_graph():
    step, params, buffers, batches = problem("cuda")
    cstep = ft.compile(step, mode="reduce-overhead", donate=True)
    assert isinstance(cstep._own, ft.compiler.Runner), "mode='reduce-overhead' with donation should take the fast path"
    _compare(step, cstep, params, buffers, batches, 20, rtol=1e-4, atol=1e-5)
    assert cstep.compiles == 1
    graphed = cstep._own.last.graphed
    assert graphed is not None and graphed.records == 1, "not replayed as one CUDA graph"


@cuda
def test_owned_donation_reduce_overhead_as_ft_run_calls_it():
    step, params, buffers, batches = problem("cuda")
    cstep = ft.compile(step, mode="reduce-overhead")
    assert isinstance(cstep._own, ft.compiler.DynamoRunner)  # undonated: inductor's CUDA graphs on the Dynamo path
    run = cstep.runner(donate=True)
    _compare(step, run, params, buffers, batches, 20, rtol=1e-4, atol=1e-5)
    assert cstep.compiles == 1
    assert run.last.graphed is not None and run.last.graphed.records == 1


@cuda
def test_bf16_autocast_step_compiles_as_a_cuda_graph():
    step, params, buffers, batches = problem("cuda", autocast=True)
    cstep = ft.compile(step, mode="reduce-overhead", donate=True)
    _compare(step, cstep, params, buffers, batches, 6, rtol=2e-2, atol=2e-2)
    assert cstep.compiles == 1 and cstep._own.last.graphed is not None


def test_a_step_that_cannot_be_a_cuda_graph_says_why_and_is_right():
    cpu = [torch.zeros(2)]
    assert "not donated" in why_not(cpu, [], donate=False, random=False)
    assert "random" in why_not(cpu, [], donate=True, random=True)
    assert "CUDA tensors" in why_not(cpu, [], donate=True, random=False)
    step, params, buffers, batches = problem("cpu")
    cstep = ft.compile(step, mode="reduce-overhead", donate=True)
    with pytest.warns(UserWarning, match="without CUDA graphs: CUDA graphs need CUDA tensors"):
        _compare(step, cstep, params, buffers, batches, 3, rtol=1e-5, atol=1e-6)
    assert cstep.compiles == 1 and cstep._own.last.graphed is None


@cuda
def test_remat_and_the_memory_estimate_on_cuda():
    """On a CUDA device, the transformer LM of tests/compiler/peak_job.py: "nothing_saveable" at most half the
    peak of no remat (torch.cuda.max_memory_allocated above the allocated bytes before the step), the same
    update, and ft.memory's step peak within 20% of each measured peak."""
    import json
    import os
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(here))}
    out = subprocess.run([sys.executable, os.path.join(here, "peak_job.py"), "--device", "cuda", "--policy",
                          "none,nothing_saveable", "--seq", "512", "--batch", "16"], env=env, capture_output=True,
                         text=True, timeout=1500)
    assert out.returncode == 0, out.stderr[-3000:]
    none, nothing = json.loads(out.stdout.strip().splitlines()[-1])
    assert nothing["peak"] <= 0.5 * none["peak"], (nothing, none)
    assert abs(nothing["sum"] - none["sum"]) <= 1e-5 * abs(none["sum"])
    for r in (none, nothing):
        assert 0.8 <= r["estimate"] / r["peak"] <= 1.2, r


# -- per-block gathering (data_parallel(shard="params", blocks=model)) on CUDA ------------------------------
def _blockwise_problem(device, config="all", micro=2):
    from conftest import blockwise_problem  # the CPU tests' model: 3 blocks, each marked with another policy

    model, step, params, buffers, batch = blockwise_problem(config, micro=micro)
    model.to(device)
    params = {k: v.to(device) for k, v in params.items()}
    return model, step, params, buffers, tuple(t.to(device) for t in batch)


@cuda
def test_blockwise_on_cuda_equals_the_unsharded_step():
    """One process on CUDA: the lent blocks, the meta placeholders and mixed precision's device on the GPU."""
    _, ref_step, params, buffers, batch = _blockwise_problem("cuda")
    model, step, _, _, _ = _blockwise_problem("cuda")
    blockwise = ft.data_parallel(shard="params", blocks=model)(step)
    run = ft.compile(blockwise)
    ref, state = ref_step.init(params, buffers), blockwise.init(params, buffers)
    for _ in range(3):
        ref, _ = ref_step(ref, batch)
        state, _ = run(state, batch)
    assert T.tree_allclose(ft.gather_state(state), ref, rtol=1e-4, atol=1e-5)


def _nccl_worker():
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    device = f"cuda:{rank}"
    _, ref_step, params, buffers, batch = _blockwise_problem(device, micro=2 * world)
    model, step, _, _, _ = _blockwise_problem(device)
    blockwise = ft.data_parallel(shard="params", blocks=model)(step)
    run = ft.compile(blockwise)
    ref, state = ref_step.init(params, buffers), blockwise.init(params, buffers)
    rows = batch[0].shape[0] // world
    mine = tuple(t[rank * rows:(rank + 1) * rows] for t in batch)
    for _ in range(3):
        ref, _ = ref_step(ref, batch)
        state, _ = run(state, mine)
    full = ft.gather_state(state)
    flat = torch.cat([p.reshape(-1) for p in T.tree_leaves(full.params)])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    return {"close": bool(T.tree_allclose(full, ref, rtol=1e-4, atol=1e-5)),
            "identical": all(torch.equal(gathered[0], g) for g in gathered)}


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_blockwise_on_two_gpus_over_nccl():
    for r in ft.launch(_nccl_worker, nprocs=2, backend="nccl", timeout=600):
        assert r["close"] and r["identical"], r
