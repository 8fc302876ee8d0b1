"""Rematerialisation on the transformer LM workloads: peak memory, step time, the same update, and ft.memory.

    python bench/remat.py                                    # T4, T8 (d 128, seq 64) and T4L (seq 512)
    python bench/remat.py --workloads T4 --policies none,nothing_saveable --steps 5
    python bench/remat.py --out-json /tmp/remat.json
    python bench/remat.py --paired T4 nothing_saveable --steps 20   # step time, both in one process, alternated

Each (workload, policy) runs in a fresh process (``MALLOC_MMAP_THRESHOLD_=65536`` so freed blocks go back to the
system and RSS follows the live tensors; one thread): the workload's functrain step (``bench/workloads.py``:
AdamW, batch 16) with every block of the model marked ``ft.remat(model.blocks, policy)`` (``none``: unmarked),
compiled with inductor and donated as ``ft.run`` donates (``ft.compile(step).runner(donate=True)``). Reported:

* ``estimate``: ft.memory's step peak, before the first step (the first call compiles that capture);
* ``peak``: the RSS high-water mark of one step above the RSS before it, after ``--warmup`` steps (the first
  compiles), so the compiler's own memory is not counted;
* ``alloc``: the same step's peak counted at torch's allocator (torch.profiler's memory profile: each tensor's
  create and destroy), which the RSS misses where malloc reuses small blocks without asking the system;
* ``step_s``: the median time of ``--steps`` timed steps;
* ``dparams``: max |params - params of ``none``| after the warm-up and timed steps (the same batches): remat
  changes memory, never the update (float rounding only);
* ``x none`` of the time: with ``--rounds N`` the median over rounds of the step time's ratio to the ``none`` run
  of the same round (runs interleaved, so a load that comes and goes hits both sides of a ratio alike).

The target (issue 17): peak <= 0.5x of ``none`` at <= 1.35x its step time.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

WORKLOADS = {"T4": dict(layers=4, seq=64), "T8": dict(layers=8, seq=64), "T4L": dict(layers=4, seq=512)}
POLICIES = ("none", "nothing_saveable", "dots_saveable")


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return -1


def worker(name: str, policy: str, warmup: int, steps: int) -> dict:
    import torch

    import functrain as ft
    from bench import workloads as W
    from functrain.compiler.estimate import allocated_peak

    torch.set_num_threads(1)
    wl = W.Workload(name, name, (), 16, "lm", kind="lm", n_batches=4, **WORKLOADS[name])
    W.build(wl, torch.device("cpu"))
    module = W.make_model(wl)
    module.load_state_dict(wl.init_state)
    if policy != "none":
        ft.remat(module.blocks, policy)
    apply_fn, params, buffers = ft.functionalize(module)
    params = {k: v.detach().clone() for k, v in params.items()}

    def loss_fn(p, b, batch):
        x, y = batch
        return W.lm_loss(apply_fn(p, b, x), y)

    step = ft.train_step(loss_fn, ft.optim.adamw(lr=wl.lr))
    state = step.init(params, buffers)
    cstep = ft.compile(step)
    est = ft.memory(cstep, state, wl.batches[0], donate=True)
    run = cstep.runner(donate=True)
    out = {"workload": name, "policy": policy, "estimate": est.step_peak, "state": est.state_total,
           "peak_at": est.peak_at}
    t0 = time.perf_counter()
    for i in range(warmup):
        state, _ = run(state, wl.batches[i % len(wl.batches)])
        if i == 0:
            out["first_step_s"] = time.perf_counter() - t0
    gc.collect()
    rest = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    times = []
    for i in range(steps):
        t = time.perf_counter()
        state, metrics = run(state, wl.batches[(warmup + i) % len(wl.batches)])
        float(metrics["loss"])
        times.append(time.perf_counter() - t)
        if i == 0:
            out["peak"] = _status("VmHWM") - rest
    out["step_s"] = statistics.median(times)
    out["alloc_peak"], (state, _) = allocated_peak(run, state, wl.batches[0])
    out["loss"] = float(metrics["loss"])
    torch.save({k: v.clone() for k, v in state.params.items()}, f"/tmp/remat-bench-{name}-{policy}.pt")
    return out


def paired_worker(name: str, policy: str, warmup: int, steps: int) -> dict:
    """Step time of ``policy`` against no remat in ONE process: both steps compiled, then called alternately
    (the order flipped each pair), so a load that comes and goes hits both sides of each ratio alike."""
    import copy

    import torch

    import functrain as ft
    from bench import workloads as W
    from functrain.compiler.estimate import allocated_peak

    torch.set_num_threads(1)
    wl = W.Workload(name, name, (), 16, "lm", kind="lm", n_batches=4, **WORKLOADS[name])
    W.build(wl, torch.device("cpu"))
    runs, states = {}, {}
    for p in ("none", policy):
        module = W.make_model(wl)
        module.load_state_dict(wl.init_state)
        if p != "none":
            ft.remat(module.blocks, p)
        apply_fn, params, buffers = ft.functionalize(module)
        params = {k: v.detach().clone() for k, v in params.items()}

        def loss_fn(pp, b, batch, apply_fn=apply_fn):
            return W.lm_loss(apply_fn(pp, b, batch[0]), batch[1])

        step = ft.train_step(loss_fn, ft.optim.adamw(lr=wl.lr))
        states[p] = step.init(params, buffers)
        runs[p] = ft.compile(step).runner(donate=True)
    for i in range(warmup):
        for p in runs:
            states[p], _ = runs[p](states[p], wl.batches[i % len(wl.batches)])
    times = {p: [] for p in runs}
    for i in range(steps):
        order = ("none", policy) if i % 2 == 0 else (policy, "none")
        for p in order:
            t = time.perf_counter()
            states[p], metrics = runs[p](states[p], wl.batches[(warmup + i) % len(wl.batches)])
            float(metrics["loss"])
            times[p].append(time.perf_counter() - t)
    ratios = [a / b for a, b in zip(times[policy], times["none"])]
    dp = max(float((states["none"].params[k] - states[policy].params[k]).abs().max()) for k in states["none"].params)
    return {"workload": name, "policy": policy, "paired_ratio": statistics.median(ratios),
            "step_s_none": statistics.median(times["none"]), "step_s": statistics.median(times[policy]),
            "ratios": ratios, "dparams": dp}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=9)
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--rounds", type=int, default=1,
                   help="repeat every (workload, policy) this many times, interleaved: on a loaded machine the "
                        "step-time ratio is the median of each round's ratio to that round's 'none'")
    p.add_argument("--out-json")
    p.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    p.add_argument("--paired", nargs=2, metavar=("WORKLOAD", "POLICY"),
                   help="time POLICY against no remat in one process, alternating calls (prints one JSON line)")
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(*args.worker, args.warmup, args.steps)))
        return
    if args.paired:
        print(json.dumps(paired_worker(*args.paired, args.warmup, args.steps)))
        return
    import torch

    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536",
           "PYTHONPATH": os.path.join(HERE, "..")}
    results, rounds = [], []
    for rnd in range(args.rounds):
        this = []
        for name in args.workloads.split(","):
            for policy in args.policies.split(","):
                cmd = [sys.executable, os.path.abspath(__file__), "--worker", name, policy, "--warmup",
                       str(args.warmup), "--steps", str(args.steps)]
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
                if proc.returncode:
                    r = {"workload": name, "policy": policy, "error": proc.stderr.strip().splitlines()[-1][:300]}
                else:
                    r = json.loads(proc.stdout.strip().splitlines()[-1])
                r["round"] = rnd
                this.append(r)
                print(json.dumps(r), flush=True)
        rounds.append(this)
    # the table: the last round's peaks and estimates (deterministic up to RSS noise), step-time ratios paired
    # per round (each policy against the 'none' run of its own round), their median
    results = rounds[-1]
    for r in results:
        ratios = []
        for this in rounds:
            mine = [x for x in this if x["workload"] == r["workload"] and x["policy"] == r["policy"]]
            none = [x for x in this if x["workload"] == r["workload"] and x["policy"] == "none"]
            if mine and none and "error" not in mine[0] and "error" not in none[0]:
                ratios.append(mine[0]["step_s"] / none[0]["step_s"])
        r["time_ratio"] = statistics.median(ratios) if ratios else float("nan")
        r["time_ratios"] = ratios
    mib = 1 << 20
    print(f"\n{'workload':<8} {'policy':<18} {'peak MiB':>9} {'x none':>7} {'s/step':>7} {'x none':>7} "
          f"{'est MiB':>8} {'est/peak':>8} {'alloc MiB':>9} {'est/alloc':>9} {'max|dp|':>9}")
    base = {r["workload"]: r for r in results if r["policy"] == "none" and "error" not in r}
    for r in results:
        if "error" in r:
            print(f"{r['workload']:<8} {r['policy']:<18} did not run: {r['error']}")
            continue
        b = base.get(r["workload"])
        ref = f"/tmp/remat-bench-{r['workload']}-none.pt"
        dp = float("nan")
        if os.path.exists(ref):
            a, c = torch.load(ref), torch.load(f"/tmp/remat-bench-{r['workload']}-{r['policy']}.pt")
            dp = max(float((a[k] - c[k]).abs().max()) for k in a)
        r["dparams"] = dp
        print(f"{r['workload']:<8} {r['policy']:<18} {r['peak'] / mib:9.1f} "
              f"{r['peak'] / b['peak'] if b else float('nan'):7.2f} {r['step_s']:7.3f} "
              f"{r['time_ratio']:7.2f} {r['estimate'] / mib:8.1f} "
              f"{r['estimate'] / r['peak']:8.2f} {r['alloc_peak'] / mib:9.1f} "
              f"{r['estimate'] / r['alloc_peak']:9.2f} {dp:9.2e}")
    if args.out_json:
        with open(args.out_json, "w") as f:
            json.dump({"args": vars(args), "results": results, "rounds": rounds}, f, indent=1)


if __name__ == "__main__":
    main()
