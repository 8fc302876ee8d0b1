"""Random numbers in a compiled CPU step: the eager step's numbers, bit for bit, by default (docs/randomness.md).

A transform that draws gradient noise (docs/transforms.md's example) and a loss with dropout draw from the
generator the step seeds from ``state.rng``. On the CPU ``ft.compile`` compiles with inductor's
``fallback_random`` unless told otherwise, so the compiled step draws what the eager step draws, on both capture
paths, after a checkpoint's resume, and in a compile worker's code as in the training process's.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import functrain as ft


class Noise(ft.Transform):
    """Gradient noise, with the draws returned in the metrics so that a test can compare them exactly."""

    name = "noise"
    order = 50

    def transform(self, ctx):
        noise = ft.tree.tree_map(torch.randn_like, ctx.grads)
        ctx.grads = ft.tree.tree_map(lambda g, n: g + 1e-3 * n, ctx.grads, noise)
        ctx.metrics["noise_w1"], ctx.metrics["noise_w2"] = noise["w1"], noise["w2"]


def dropout_loss(params, buffers, batch):
    x, y = batch
    h = torch.nn.functional.dropout(x @ params["w1"], 0.5)
    kept = (h != 0).to(torch.float32).mean()  # the dropout mask, seen through the metrics
    return torch.nn.functional.mse_loss(torch.relu(h) @ params["w2"], y), {"kept": kept}


def problem(seed=0):
    g = torch.Generator().manual_seed(0)
    params = {"w1": torch.randn(8, 64, generator=g) / 3, "w2": torch.randn(64, 1, generator=g) / 8}
    batches = [(torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)) for _ in range(4)]
    step = Noise()(ft.train_step(dropout_loss, ft.optim.adamw(1e-2)))
    return step, step.init(params, seed=seed), batches


def run(fn, state, batches):
    draws = []
    for b in batches:
        state, m = fn(state, b)
        draws.append({k: m[k] for k in ("noise_w1", "noise_w2", "kept")})
    return state, draws


def assert_same_draws(got, want):
    for i, (g, w) in enumerate(zip(got, want)):
        for k in w:
            assert torch.equal(g[k], w[k]), f"step {i}: {k} differs between the compiled and the eager step"


@pytest.mark.parametrize("capture", ["auto", "dynamo"])
def test_a_cpu_compiled_step_draws_the_eager_numbers(capture):
    step, state, batches = problem()
    eager_state, eager = run(step, state, batches)
    cstep = ft.compile(step, capture=capture)
    compiled_state, compiled = run(cstep, state, batches)
    assert_same_draws(compiled, eager)                          # the noise and the dropout masks, bit for bit
    assert not torch.equal(eager[0]["noise_w1"], eager[1]["noise_w1"])  # (each step draws anew)
    assert ft.tree.tree_allclose(compiled_state.params, eager_state.params, rtol=1e-5, atol=1e-7)
    assert ft.tree.tree_equal(compiled_state.rng, eager_state.rng)
    if capture == "auto":
        # a fallback_random the caller sets is kept: False is inductor's own generator, other numbers
        own = ft.compile(step, options={"fallback_random": False})
        _, drawn = run(own, state, batches[:1])
        assert not torch.equal(drawn[0]["noise_w1"], eager[0]["noise_w1"])
        _, again = run(own, state, batches[:1])
        assert torch.equal(again[0]["noise_w1"], drawn[0]["noise_w1"])  # (still reproducible from the state)


def test_a_compiled_resume_draws_what_an_uninterrupted_eager_run_draws(tmp_path):
    step, state, batches = problem(seed=5)
    _, eager = run(step, state, batches)
    cstep = ft.compile(step)
    half, first = run(cstep, state, batches[:2])
    ft.save(tmp_path / "ckpt", half)
    loaded = ft.load(tmp_path / "ckpt", step.init(problem()[1].params, seed=0))
    assert loaded.rng["key"].tolist() == [5, 2]
    _, second = run(cstep, loaded, batches[2:])
    assert_same_draws(first + second, eager)
    # another seed, other numbers; the same seed, the same
    _, other = run(cstep, step.init(problem()[1].params, seed=6), batches[:1])
    assert not torch.equal(other[0]["noise_w1"], eager[0]["noise_w1"])


WORKER_CHECK = textwrap.dedent("""
    import json, os, subprocess, sys
    import torch
    sys.path.insert(0, os.environ["TEST_DIR"])
    from test_random_cpu import problem
    from functrain.compiler.backend import make_backend
    from functrain.compiler.capture import trace
    from functrain.compiler.options import Options
    from functrain.compiler.worker import job_payload

    torch.set_num_threads(1)
    step, state, batches = problem()
    s = state._replace(rng=None)
    cap = trace(step.apply, s, batches[0], "fresh")
    # the job a background compile sends (functrain.compiler.background: mode, options, donate)
    payload = job_payload(cap.gm, cap.metas, {"mode": None, "options": None, "donate": False})
    proc = subprocess.run([sys.executable, "-m", "functrain.compiler.worker", str(os.getpid()), "600", "0"],
                          input=payload, capture_output=True, timeout=600)
    answer = json.loads(proc.stdout.decode().strip().splitlines()[-1])
    assert answer["ok"], (answer, proc.stderr.decode()[-3000:])
    # this process loads the worker's code from the caches: a miss (another configuration) raises
    fn = make_backend(Options()).load(cap.gm, cap.metas)
    torch.manual_seed(1234)
    out = fn(*cap.inputs)
    torch.manual_seed(1234)
    _, metrics = step.apply(s, batches[0])
    same = {k: any(torch.equal(o, metrics[k]) for o in out) for k in ("noise_w1", "noise_w2")}
    print(json.dumps(same))
""")


def test_a_compile_worker_compiles_with_the_same_choice(tmp_path):
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"), OMP_NUM_THREADS="1",
               TEST_DIR=os.path.dirname(os.path.abspath(__file__)))
    env.pop("FUNCTRAIN_COMPILE_WORKER", None)
    proc = subprocess.run([sys.executable, "-c", WORKER_CHECK], env=env, capture_output=True, text=True,
                          timeout=900, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"noise_w1": True, "noise_w2": True}
