"""Background compilation on 2 real processes: the ranks switch to the compiled step at the same step.

Eager and compiled steps may order their collectives differently, and replicated ranks must stay
bitwise identical, so the ranks agree (``Step.agree``: one MIN all-reduce of a host int per step
until the switch) on when every rank's compiled code is ready.
"""
import os
import time

import pytest
import torch

import functrain as ft
from functrain import tree as T

STEPS_AFTER = 10  # compiled steps each rank takes after the switch


def _switch_worker(shard, backend):
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Dropout(0.1), torch.nn.Linear(8, 3))
    apply_fn, params, buffers = ft.functionalize(model)

    def loss_fn(p, b, batch):
        return torch.nn.functional.mse_loss(apply_fn(p, b, batch[0]), batch[1])

    step = ft.data_parallel(shard=shard)(ft.ema(0.9, warmup=False)(ft.clip(1.0)(ft.train_step(loss_fn, ft.optim.adamw(1e-2)))))
    state = T.tree_map(torch.clone, step.init(params, buffers))
    cstep = ft.compile(step, **({"backend": backend} if backend else {}))
    run = cstep.runner(donate=True, background=True)  # what ft.run calls
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 4, generator=g), torch.randn(8, 3, generator=g)) for _ in range(4)]
    eager, compiled_after, i = [], 0, 0
    t0 = time.monotonic()
    while True:
        x, y = batches[i % 4]
        before = run.progress.eager_calls
        state, metrics = run(state, (x[rank::world], y[rank::world]))
        eager.append(run.progress.eager_calls != before)
        i += 1
        compiled_after += not eager[-1]
        if i % 25 == 0:  # stop together: on every rank at the same step (one MAX all-reduce)
            done = torch.tensor([int(compiled_after >= STEPS_AFTER or time.monotonic() - t0 > 600)])
            dist.all_reduce(done, op=dist.ReduceOp.MAX)
            if done.item():
                break
    whole = ft.gather_state(state) if shard != "none" else state
    flat = torch.cat([t.reshape(-1).float() for t in T.tree_leaves((whole.params, whole.ema))])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    switch = eager.index(False) + 1 if False in eager else None
    return {"switch": switch, "eager_after_switch": switch is not None and any(eager[switch - 1:]),
            "phase": run.progress.phase, "identical": all(torch.equal(gathered[0], t) for t in gathered),
            "compiles": cstep.compiles, "calls": i, "source": run.progress.source, "workers": run.progress.workers}


def _check(reports):
    (a, b) = reports
    assert a["phase"] == b["phase"] == "compiled", reports
    assert a["switch"] == b["switch"] and a["switch"] > 1, reports  # the same step on both ranks
    assert not a["eager_after_switch"] and not b["eager_after_switch"], reports
    assert a["identical"] and b["identical"], "the ranks' params and EMA differ"
    assert a["compiles"] == b["compiles"] == 1, reports


def test_replicated_ranks_switch_together_inductor(tmp_path):
    # one rank's worker compiles (cold cache) while that rank holds the graph's lock; the other sees the lock held,
    # starts no worker, and loads the code once the lock is free: ready at other times, switched at the same step
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    reports = ft.launch(_switch_worker, nprocs=2, args=("none", None), timeout=900, env=env)
    _check(reports)
    # the data-parallel graph (functional collectives) went to one worker process on this machine, and the other
    # rank loaded what it wrote: never compiled on a training thread (a rank blocked there for a cold compile
    # outlived its peer's collective timeout in the main job), and never compiled twice
    # (local rank 0 takes the lock at once and rank 1 waits a few seconds for it to: which one compiles is a
    # preference, not a law, on a loaded machine)
    assert sorted(r["source"] for r in reports) == ["peer", "worker"], reports
    assert sorted(r["workers"] for r in reports) == [0, 1], reports


@pytest.mark.parametrize("shard", ["optimizer", "params"])
def test_sharded_ranks_switch_together(shard):
    _check(ft.launch(_switch_worker, nprocs=2, args=(shard, "aot_eager"), timeout=600))
