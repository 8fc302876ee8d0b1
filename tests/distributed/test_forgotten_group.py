"""The process group, never forgotten: data_parallel under a multi-process launch never trains alone in silence."""
import json
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

import functrain as ft
from functrain import tree as T

FORGETS_INIT = textwrap.dedent("""
    import os, sys, torch, functrain as ft

    rank = int(os.environ["RANK"])  # the script never calls ft.distributed.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    apply_fn, params, buffers = ft.functionalize(model)
    if rank:  # another start on rank 1: one world broadcasts rank 0's
        params = {k: v + 1.0 for k, v in params.items()}

    def loss_fn(params, buffers, batch):
        x, y = batch
        return torch.nn.functional.mse_loss(apply_fn(params, buffers, x), y)

    step = ft.data_parallel()(ft.train_step(loss_fn, ft.optim.adamw(1e-2)))
    state = step.init(params, buffers)
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    for _ in range(3):
        x = torch.randn(16, 8, generator=g)
        state, metrics = step(state, (x, x.sum(1, keepdim=True)))
    sys.stdout.write("RESULT " + __import__("json").dumps({
        "rank": rank, "world": ft.distributed.world_size(),
        "params": [float(v) for p in state.params.values() for v in p.reshape(-1)]}) + "\\n")
    sys.stdout.flush()
""")


def _env():
    env = dict(os.environ)
    for var in ("FUNCTRAIN_DIST_TIMEOUT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    return env


def test_a_script_that_forgets_init_still_trains_as_one_world(tmp_path):
    script = tmp_path / "forgets.py"
    script.write_text(FORGETS_INIT)
    p = subprocess.run([sys.executable, "-m", "functrain.launch", "--nproc", "2", "--dist-timeout", "60",
                        str(script)], cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stdout + p.stderr
    results = sorted((json.loads(m) for m in re.findall(r"RESULT (\{.*\})", p.stdout)), key=lambda r: r["rank"])
    assert [r["rank"] for r in results] == [0, 1], p.stdout + p.stderr
    assert all(r["world"] == 2 for r in results), results
    # one world: the same start (broadcast) and the same summed gradients -> bitwise the same params
    assert results[0]["params"] == results[1]["params"], "the ranks trained alone"


def _problem():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    apply_fn, params, buffers = ft.functionalize(model)

    def loss_fn(params, buffers, batch):
        return apply_fn(params, buffers, batch).pow(2).mean()

    return ft.train_step(loss_fn, ft.optim.sgd(0.1)), params, buffers, torch.randn(4, 3)


def test_a_launch_without_a_reachable_rank_0_says_to_call_init(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("SLURM_PROCID", "1")
    monkeypatch.setenv("SLURM_NTASKS", "2")
    step, params, buffers, _ = _problem()
    with pytest.raises(RuntimeError, match=r"rank 1 of 2 \(slurm launch\).*Call ft\.distributed\.init\(\)"):
        ft.data_parallel()(step).init(params, buffers)
    assert not dist.is_initialized()


@pytest.mark.parametrize("env", [{}, {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}])
def test_one_process_stays_a_no_op(monkeypatch, env):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "OMPI_COMM_WORLD_RANK",
                "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE"):
        monkeypatch.delenv(var, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    step, params, buffers, batch = _problem()
    dp = ft.data_parallel()(step)
    a, _ = dp(dp.init(params, buffers), batch)
    b, _ = step(step.init(params, buffers), batch)
    assert T.tree_equal(a.params, b.params)
    assert not dist.is_initialized()  # no group formed for a world of one
