"""Write the checkpoints tests/checkpoint/test_old_checkpoints.py loads: run once with the functrain of commit
ed14ba9 (before FlatSpec and FlatLayout became one type), PYTHONPATH=<that tree> python make_old_checkpoints.py OUT.

OUT/sharded_{optimizer,params}: a 2-rank sharded checkpoint (ShardState slot, per-rank shard trees of two dtypes);
OUT/logical_{optimizer,params}: the same state gathered (ft.gather_state), a plain checkpoint; OUT/flat: a flat
state (ft.flat) after two steps."""
import os
import sys

import torch

import functrain as ft


def problem(rank=0):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    apply_fn, params, buffers = ft.functionalize(model)
    params = {**params, "scale": torch.full((3,), 1.5, dtype=torch.float64)}  # a second dtype: a second buffer

    def loss_fn(params, buffers, batch):
        out = apply_fn({k: v for k, v in params.items() if k != "scale"}, buffers, batch[0])
        return torch.nn.functional.mse_loss(out * params["scale"].float(), batch[1])

    g = torch.Generator().manual_seed(1)
    batch = (torch.randn(8, 4, generator=g), torch.randn(8, 3, generator=g))
    step = ft.ema(0.5, warmup=False)(ft.clip(1.0)(ft.train_step(loss_fn, ft.optim.adamw(1e-2))))
    if rank:
        params = {k: v + 1.0 for k, v in params.items()}
    return step, params, buffers, batch


def worker(root):
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    for mode in ("optimizer", "params"):
        step, params, buffers, batch = problem(rank)
        sharded = ft.data_parallel(shard=mode)(step)
        state = sharded.init(params, buffers)
        n = batch[0].shape[0] // world
        for _ in range(2):
            state, _ = sharded(state, tuple(t[rank * n:(rank + 1) * n] for t in batch))
        ft.save(os.path.join(root, f"sharded_{mode}"), state, extra={"mode": mode})
        full = ft.gather_state(state)
        if rank == 0:
            ft.save(os.path.join(root, f"logical_{mode}"), full)


if __name__ == "__main__":
    root = os.path.abspath(sys.argv[1])
    os.makedirs(root, exist_ok=True)
    ft.launch(worker, nprocs=2, args=(root,), timeout=300)
    step, params, buffers, batch = problem()
    state = ft.flat(step.init(params, buffers))
    for _ in range(2):
        state, _ = step(state, batch)
    ft.save(os.path.join(root, "flat"), state)
