"""ft.remat with data_parallel on 2 real processes (gloo): replicated, shard="optimizer" and shard="params", eager
and compiled, the marked step reaches the state of the unmarked one (gathered), bitwise-identical params on
both ranks; ft.memory on each rank counts that rank's shards."""
from __future__ import annotations

import torch

import functrain as ft
from functrain import tree as T
from conftest import batches, build, max_diff


def _worker(backend):
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    data = [(x[rank * 4:(rank + 1) * 4], y[rank * 4:(rank + 1) * 4]) for x, y in batches(6, n=3, rows=8)]
    out = {}
    for mode in ("none", "optimizer", "params"):
        states = []
        for policy in (None, "nothing_saveable", "dots_saveable"):
            _, step, start = build(depth=2, policy=policy, transforms=["clip", "ema"], dropout=True)
            step = ft.data_parallel(shard=mode)(step)
            state = step.init(start.params, start.buffers)
            run = ft.compile(step, backend=backend) if backend else step
            if policy is None:  # what this rank holds: ft.memory counts its own shard
                est = ft.memory(run, state, data[0])
                bytes_ = (est.state["params"], est.state["optimizer"], est.state["slots/ema"], est.step_peak)
            for b in data:
                state, _ = run(state, b)
            states.append(ft.gather_state(state))
        flat = torch.cat([p.reshape(-1) for p in T.tree_leaves(states[1].params)])
        gathered = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(gathered, flat)
        out[mode] = {"diffs": [max_diff(states[0], s) for s in states[1:]], "bytes": bytes_,
                     "same_structure": all(T.tree_structure(s) == T.tree_structure(states[0]) for s in states),
                     "ranks_identical": all(torch.equal(gathered[0], g) for g in gathered)}
    return out


def _check(reports, tol):
    for report in reports:
        for mode, r in report.items():
            assert r["same_structure"] and r["ranks_identical"], (mode, r)
            assert max(r["diffs"]) <= tol, (mode, r["diffs"])
        # ft.memory per rank: the shards are half of the replicated parts (+ padding, + the optimizer's count)
        params, opt, ema, peak = report["none"]["bytes"]
        for mode in ("optimizer", "params"):
            p, o, e, _ = report[mode]["bytes"]
            assert 2 * o <= opt + 64 and 2 * e <= ema + 64, (mode, report[mode]["bytes"], report["none"]["bytes"])
            assert (2 * p <= params + 64) if mode == "params" else p == params, (mode, p, params)
        assert peak > 0


def test_remat_with_data_parallel_eager():
    _check(ft.launch(_worker, nprocs=2, args=(None,), timeout=300), 1e-6)


def test_remat_with_data_parallel_compiled():
    _check(ft.launch(_worker, nprocs=2, args=("aot_eager",), timeout=900), 1e-5)
