"""2-rank data-parallel step time: compiled functrain vs hand-written PyTorch DDP, interleaved in one job.

    python bench/dp.py                         # launches itself on 2 processes (python -m functrain.launch)
    python bench/dp.py --rounds 10 --steps 50  # shorter
    python bench/dp.py --no-diag               # only the two main variants
    python -m functrain.launch --nproc 2 bench/dp.py --out-json /tmp/dp.json   # the same, launched by hand

Workload: MLP 32-64-64-1 (ReLU), MSE, AdamW(lr 1e-3, weight decay 0.01), batch 32 per rank, float32, CPU,
gloo, one thread per rank (OMP_NUM_THREADS=1, torch.set_num_threads(1)). Variants, all in the same 2-process
job, on the same batches:

* ``functrain_compiled``: ``ft.compile(ft.data_parallel()(ft.train_step(loss_fn, ft.optim.adamw(...))))``,
  the gradient all-reduce inside the compiled graph;
* ``torch_ddp``: ``DistributedDataParallel(model)`` + ``torch.optim.AdamW`` with its defaults (the usual
  hand-written loop: zero_grad, forward, backward, step);

and diagnostics (``--no-diag`` drops them), which say where the time goes:

* ``torch_ddp_foreach``: DDP with ``AdamW(foreach=True)``;
* ``allreduce_only``: one ``dist.all_reduce`` of a gradient-sized float32 buffer per step (the communication
  floor);
* ``functrain_compiled_local`` / ``torch_local``: the same steps without data parallelism (each rank trains
  alone, both ranks at once): compute only.

Each round runs every variant for ``--steps`` updates (the order rotates every round); a round's time is the
slower rank's wall time between two barriers, divided by the steps. Reported: the median per-step time, the
median of the per-round ratios functrain / variant with a bootstrap 95% interval and the min-max over rounds,
functrain's first call (compile) time, and graphs compiled during the timed rounds (must be 0). Before timing,
the data-parallel variants take the same warm-up steps from the same initial weights and their weights are
compared (max |Δw|).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from steps import busy_s  # noqa: E402 - the same machine-load measure as bench/steps.py

from functrain.bench.stats import bootstrap_ci  # noqa: E402

TARGET_SPEEDUP = 1.3  # compiled functrain at least this much faster per step than DDP
MAIN, BASE = "functrain_compiled", "torch_ddp"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--steps", type=int, default=100, help="updates per variant per round")
    p.add_argument("--warmup", type=int, default=20, help="untimed updates per variant before the rounds")
    p.add_argument("--batch", type=int, default=32, help="rows per rank")
    p.add_argument("--no-diag", action="store_true", help="time only functrain_compiled and torch_ddp")
    p.add_argument("--inductor-cache", default="fresh",
                   help="TORCHINDUCTOR_CACHE_DIR: 'fresh' (default: an empty temp folder, cold compile), "
                        "'default', or a folder")
    p.add_argument("--out-json", default=None, help="write every round's numbers here (rank 0)")
    p.add_argument("--out-md", default=None, help="also write the markdown report here (rank 0)")
    return p.parse_args(argv)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def self_launch(argv: list[str]) -> int:
    """Not under a launcher: run this file on 2 processes (a fresh inductor cache shared by both)."""
    args = parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ.setdefault("FUNCTRAIN_DIST_TIMEOUT", "600")  # two cold compiles on 2 cores can take a while
    fresh = None
    if args.inductor_cache == "fresh":
        fresh = os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="ft-bench-dp-inductor-")
        os.environ["FT_BENCH_DP_CACHE"] = "cold inductor cache"
    elif args.inductor_cache != "default":
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = args.inductor_cache
    from functrain.distributed import cli

    try:
        return cli.main(["--nproc", "2", os.path.abspath(__file__), *argv])
    finally:
        if fresh is not None:
            shutil.rmtree(fresh, ignore_errors=True)


def rank_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import functrain as ft

    torch.set_num_threads(1)
    info = ft.distributed.init()
    rank, world = info.rank, info.world_size
    if world != 2:
        log(f"bench/dp.py: expected 2 processes, got {world}")

    def all_max(x: float) -> float:
        t = torch.tensor([x], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    def all_sum(x: float) -> float:
        t = torch.tensor([x], dtype=torch.float64)
        dist.all_reduce(t)
        return float(t)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64),
                                torch.nn.ReLU(), torch.nn.Linear(64, 1))
    n_params = sum(p.numel() for p in model.parameters())
    g = torch.Generator().manual_seed(1000 + rank)  # each rank its own shard
    n_batches = 16
    batches = []
    for _ in range(n_batches):
        x = torch.randn(args.batch, 32, generator=g)
        batches.append((x, torch.sin(x[:, :1]) + 0.1 * torch.randn(args.batch, 1, generator=g)))
    mse = torch.nn.functional.mse_loss

    # ---- functrain: the whole step compiled (data-parallel, and the local diagnostic)
    def make_ft(parallel: bool):
        apply_fn, params, buffers = ft.functionalize(copy.deepcopy(model))

        def loss_fn(params, buffers, batch):
            x, y = batch
            return mse(apply_fn(params, buffers, x), y)

        step = ft.train_step(loss_fn, ft.optim.adamw(1e-3, weight_decay=0.01))
        if parallel:
            step = ft.data_parallel()(step)
        box = {"state": step.init(params, buffers)}
        compiled = ft.compile(step)

        def run(i: int) -> None:
            box["state"], _ = compiled(box["state"], batches[i % n_batches])
        return box, compiled, run

    # ---- hand-written PyTorch (DDP, and the local diagnostic)
    def make_torch(parallel: bool, foreach: bool | None = None):
        m = copy.deepcopy(model)
        net = DDP(m) if parallel else m
        opt = torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=0.01, foreach=foreach)

        def run(i: int) -> None:
            x, y = batches[i % n_batches]
            opt.zero_grad(set_to_none=True)
            mse(net(x), y).backward()
            opt.step()
        return m, run

    ft_box, cstep, ft_run = make_ft(True)
    ddp_model, ddp_run = make_torch(True)
    variants = {MAIN: ft_run, BASE: ddp_run}
    models = {BASE: ddp_model}  # data-parallel torch variants: compared with functrain after the warm-up
    compiled_steps = {MAIN: cstep}
    if not args.no_diag:
        models["torch_ddp_foreach"], variants["torch_ddp_foreach"] = make_torch(True, foreach=True)
        flat = torch.randn(n_params)
        variants["allreduce_only"] = lambda i: dist.all_reduce(flat)
        _, compiled_steps["functrain_compiled_local"], variants["functrain_compiled_local"] = make_ft(False)
        _, variants["torch_local"] = make_torch(False)

    # ---- warm-up: the first functrain call compiles; every variant takes the same steps on the same batches
    compile_s = {}
    for name, c in compiled_steps.items():
        dist.barrier()
        t0 = time.perf_counter()
        variants[name](0)
        compile_s[name] = all_max(time.perf_counter() - t0)
    for name, run in variants.items():
        for i in range(1 if name in compiled_steps else 0, args.warmup):
            run(i)
    dw = {}
    ref = ft_box["state"].params
    for name, m in models.items():
        got = dict(m.named_parameters())
        dw[name] = all_max(max(float((got[k].detach() - ref[k]).abs().max()) for k in ref))
    graphs_warmup = {n: c.compiles for n, c in compiled_steps.items()}
    log(f"[rank {rank}] warm-up done: compile {compile_s}, graphs {graphs_warmup}, max|dw| {dw}")

    # ---- timed rounds, interleaved
    names = list(variants)
    per_step = {n: [] for n in names}
    other = {n: [] for n in names}
    cpu_share = {n: [] for n in names}
    load0 = os.getloadavg()
    t_all = time.perf_counter()
    cursor = args.warmup
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]  # rotate the order every round
        for name in order:
            run = variants[name]
            dist.barrier()
            b0, c0, t0 = busy_s(), time.process_time(), time.perf_counter()
            for i in range(cursor, cursor + args.steps):
                run(i)
            t1, c1, b1 = time.perf_counter(), time.process_time(), busy_s()
            wall = all_max(t1 - t0)  # the slower rank
            cpu = all_sum(c1 - c0)  # both ranks' CPU time (all their threads)
            per_step[name].append(wall / args.steps)
            cpu_share[name].append(cpu / world / wall)
            other[name].append(max(0.0, (b1 - b0) - cpu) / wall)  # cores used by other processes
        cursor += args.steps
    elapsed = time.perf_counter() - t_all
    load1 = os.getloadavg()
    recompiles = {n: c.compiles - graphs_warmup[n] for n, c in compiled_steps.items()}
    if rank != 0:
        dist.destroy_process_group()
        return

    res = {"workload": f"MLP 32-64-64-1 ({n_params} params), MSE, AdamW, batch {args.batch}/rank, {world} ranks, "
                       f"gloo, fp32, CPU",
           "machine": f"{os.cpu_count()}-core {platform.machine()}, torch {torch.__version__}",
           "threads_per_rank": torch.get_num_threads(), "rounds": args.rounds, "steps": args.steps,
           "warmup": args.warmup, "compile_s": compile_s,
           "inductor_cache": os.environ.get("FT_BENCH_DP_CACHE", "inductor cache "
                                            + os.environ.get("TORCHINDUCTOR_CACHE_DIR", "default")),
           "graphs_warmup": graphs_warmup,
           "compiles_in_rounds": recompiles, "max_dw_warmup": dw, "loadavg_before": load0, "loadavg_after": load1,
           "elapsed_rounds_s": elapsed, "median_s": {n: statistics.median(v) for n, v in per_step.items()},
           "per_step_s": per_step, "other_load_cores": {n: statistics.median(v) for n, v in other.items()},
           "cpu_share": {n: statistics.median(v) for n, v in cpu_share.items()}, "ratios": {}}
    for name in names:
        if name == MAIN:
            continue
        rs = [a / b for a, b in zip(per_step[MAIN], per_step[name])]
        lo, hi = bootstrap_ci(rs)
        res["ratios"][name] = {"median": statistics.median(rs), "ci95": (lo, hi), "min": min(rs), "max": max(rs)}
    md = markdown(res)
    print(md, flush=True)
    if args.out_json:
        with open(args.out_json, "w") as f:
            json.dump(res, f, indent=1)
    if args.out_md:
        with open(args.out_md, "w") as f:
            f.write(md + "\n")
    dist.destroy_process_group()


def _us(s: float) -> str:
    return f"{s * 1e6:.0f} µs"


def markdown(res: dict) -> str:
    lines = [f"{res['workload']}; {res['machine']}; {res['threads_per_rank']} thread/rank; "
             f"{res['rounds']} rounds x {res['steps']} steps per variant, interleaved "
             f"({res['elapsed_rounds_s']:.1f} s); load average {res['loadavg_before'][0]:.2f} before, "
             f"{res['loadavg_after'][0]:.2f} after",
             "",
             "| variant | median step | functrain_compiled / variant: median [95% CI] (min–max over rounds) "
             "| other load (cores) | CPU/wall per rank |",
             "|---|---|---|---|---|"]
    for name, m in res["median_s"].items():
        r = res["ratios"].get(name)
        ratio = "—" if r is None else (f"{r['median']:.2f} [{r['ci95'][0]:.2f}–{r['ci95'][1]:.2f}] "
                                       f"({r['min']:.2f}–{r['max']:.2f})")
        lines.append(f"| {name} | {_us(m)} | {ratio} | {res['other_load_cores'][name]:.2f} | "
                     f"{res['cpu_share'][name]:.2f} |")
    base = res["ratios"][BASE]
    speedup = 1 / base["median"]
    lo, hi = 1 / base["ci95"][1], 1 / base["ci95"][0]
    met = "met" if speedup >= TARGET_SPEEDUP else "NOT met"
    lines += ["",
              f"* compiled functrain is **{speedup:.2f}x** faster per step than DDP (95% CI {lo:.2f}–{hi:.2f}x; "
              f"per-round {1 / base['max']:.2f}–{1 / base['min']:.2f}x); target ≥ {TARGET_SPEEDUP}x: **{met}**",
              f"* first call (compile, {res['inductor_cache']}, both ranks at once): "
              + ", ".join(f"{k} {v:.1f} s" for k, v in res["compile_s"].items())
              + "; compiles during timed rounds: **"
              + ", ".join(f"{k} {v}" for k, v in res["compiles_in_rounds"].items()) + "**",
              "* max |Δw| vs functrain_compiled after the same warm-up steps: "
              + ", ".join(f"{k} {v:.1e}" for k, v in res["max_dw_warmup"].items())]
    med = res["median_s"]
    if {"allreduce_only", "functrain_compiled_local", "torch_local"} <= set(med):
        lines.append(f"* where the time goes: compute alone {_us(med['functrain_compiled_local'])} (functrain) vs "
                     f"{_us(med['torch_local'])} (torch); one gradient all-reduce alone "
                     f"{_us(med['allreduce_only'])}; the data-parallel steps add "
                     f"{_us(med[MAIN] - med['functrain_compiled_local'])} (functrain) and "
                     f"{_us(med[BASE] - med['torch_local'])} (DDP) to their compute")
    return "\n".join(lines)


if __name__ == "__main__":
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise SystemExit(self_launch(sys.argv[1:]))
    rank_main(parse_args())
