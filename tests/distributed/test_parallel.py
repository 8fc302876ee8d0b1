"""data_parallel(): 2 real processes over gloo equal one process on the whole batch."""
import pytest
import torch

import functrain as ft
from functrain import tree as T

CONFIGS = ["plain", "accumulate", "clip", "ema", "fp16_overflow", "num_items", "all"]


def _problem(config: str, rank: int, micro: int = 2):
    """A tiny model and a batch of 8 rows; `num_items` uses a masked per-token loss.

    ``micro`` is the accumulation factor: the one-process reference accumulates over
    world x as many micro-batches, so that both see the same micro-batches (fp16
    rounding depends on how rows are grouped; fp32 sums do not, to 1e-7).
    """
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    apply_fn, params, buffers = ft.functionalize(model)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 4, generator=g), torch.randn(8, 3, generator=g)
    if config == "num_items":
        # rank 0's half has 9 valid targets, rank 1's half 3: a mean of rank means would be wrong
        mask = torch.zeros(8, 3)
        mask[:4].view(-1)[:9] = 1
        mask[4:].view(-1)[:3] = 1

        def loss_fn(params, buffers, batch):
            x, y, m = batch
            err = ((apply_fn(params, buffers, x) - y) ** 2 * m).sum()
            return err, {"num_items": m.sum()}

        batch = (x, y, mask)
    else:
        if config == "fp16_overflow":
            x[6, 0] = 1e30  # in rank 1's half only: inf in fp16
        loss_fn = lambda params, buffers, batch: torch.nn.functional.mse_loss(  # noqa: E731
            apply_fn(params, buffers, batch[0]), batch[1])
        batch = (x, y)
    transforms = {
        "plain": [], "accumulate": [ft.accumulate(micro)], "clip": [ft.clip(0.05)], "ema": [ft.ema(0.5, warmup=False)],
        "fp16_overflow": [ft.mixed_precision("fp16"), ft.ema(0.5, warmup=False)],
        "num_items": [ft.accumulate(micro), ft.clip(0.5)],
        "all": [ft.accumulate(micro), ft.clip(0.05), ft.ema(0.5, warmup=False), ft.mixed_precision("fp16", init_scale=256.0)],
    }[config]
    step = ft.train_step(loss_fn, ft.optim.adamw(1e-2))
    for t in transforms:
        step = t(step)
    if rank:  # rank 1 starts from other weights: data_parallel's init must broadcast rank 0's
        params = {k: v + 1.0 for k, v in params.items()}
    return step, params, buffers, batch


def _dp_worker(configs, backend, flat=False):
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    report = {}
    for config in configs:
        step, params, buffers, batch = _problem(config, rank)
        ref_step, ref_params, ref_buffers, _ = _problem(config, 0, micro=2 * world)
        reference = ref_step.init(ref_params, ref_buffers)
        dp = ft.data_parallel()(step)
        state = dp.init(params, buffers, flat=flat)
        run = ft.compile(dp, backend=backend) if backend else dp
        ref_run = ft.compile(ref_step, backend=backend) if backend else ref_step
        rows = batch[0].shape[0] // world
        shard = tuple(t[rank * rows:(rank + 1) * rows] for t in batch)
        for _ in range(3):
            state, metrics = run(state, shard)
            reference, ref_metrics = ref_run(reference, batch)
        if flat:
            assert isinstance(state.params, ft.FlatParams) and isinstance(state.opt_state.exp_avg, ft.FlatParams)
        named = ft.unflat(state)  # a flat state compares by name
        err = max(float((a - b).abs().max()) for a, b in zip(T.tree_leaves(named), T.tree_leaves(reference))
                  if a.is_floating_point())
        exact = T.tree_equal(named.params, reference.params)
        whole = torch.cat([p.reshape(-1) for p in T.tree_leaves(named.params)])
        gathered = [torch.empty_like(whole) for _ in range(world)]
        dist.all_gather(gathered, whole)
        report[config] = {
            "err": err, "exact": exact,
            "ranks_identical": all(torch.equal(gathered[0], g) for g in gathered),
            "loss": (float(metrics["loss"]), float(ref_metrics["loss"])),
            "skipped": bool(metrics.get("skipped", False)),
            "scale": float(state.loss_scale.scale) if state.loss_scale is not None else None,
            "compiles": getattr(run, "compiles", None),
        }
    return report


def _check(report, compiled: bool):
    for config, r in report.items():
        assert r["ranks_identical"], f"{config}: ranks diverged"
        assert r["err"] <= 1e-6, f"{config}: data-parallel state differs from one process by {r['err']:.2e}"
        assert abs(r["loss"][0] - r["loss"][1]) <= 1e-6 * max(1.0, abs(r["loss"][1])), f"{config}: loss {r['loss']}"
        if compiled:
            assert r["compiles"] == 1, f"{config}: {r['compiles']} graphs over 3 steps"
    if "fp16_overflow" in report:
        r = report["fp16_overflow"]
        assert r["skipped"] and r["scale"] == 2.0 ** 16 * 0.5 ** 3, r  # every step skipped on both ranks
        assert r["exact"]  # skipped steps leave the params bitwise unchanged


def test_data_parallel_equals_one_process_eager():
    reports = ft.launch(_dp_worker, nprocs=2, args=(CONFIGS, None), timeout=240)
    for report in reports:
        _check(report, compiled=False)


def test_data_parallel_equals_one_process_compiled():
    # aot_eager traces the whole step (all-reduce included) as one graph quickly; the
    # inductor run below checks the generated code on the combination of everything
    reports = ft.launch(_dp_worker, nprocs=2, args=(CONFIGS, "aot_eager"), timeout=400)
    for report in reports:
        _check(report, compiled=True)


def test_data_parallel_inductor_all_transforms():
    reports = ft.launch(_dp_worker, nprocs=2, args=(["all"], "inductor"), timeout=400)
    for report in reports:
        _check(report, compiled=True)


def test_data_parallel_on_a_flat_state_equals_one_process():
    # one all-reduce per dtype buffer instead of one per parameter; the same law
    reports = ft.launch(_dp_worker, nprocs=2, args=(["plain", "clip", "fp16_overflow", "all"], None, True),
                        timeout=240)
    for report in reports:
        _check(report, compiled=False)


def _raise_on_rank_1():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise KeyError("rank one failed")
    t = torch.ones(1)
    dist.all_reduce(t)  # rank 0 waits on the dead peer: must fail, not hang
    return 0


def test_launch_reraises_a_rank_failure():
    with pytest.raises(KeyError, match="rank one failed") as info:
        ft.launch(_raise_on_rank_1, nprocs=2, timeout=60)
    assert any("rank 1 of 2 failed" in note for note in info.value.__notes__)


def test_data_parallel_is_identity_on_one_process():
    step, params, buffers, batch = _problem("clip", 0)
    a, _ = ft.data_parallel()(step)(ft.data_parallel()(step).init(params, buffers), batch)
    b, _ = step(step.init(params, buffers), batch)
    assert T.tree_equal(a.params, b.params)
