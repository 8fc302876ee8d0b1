"""Time one training step written several ways, interleaved, in one process.

    python bench/steps.py                       # W1-W4, all variants, defaults (~6 min on 2 cores)
    python bench/steps.py --quick --no-compile  # smoke test, seconds
    python bench/steps.py --workloads W1 --rounds 30 --out-json /tmp/w1.json
    python bench/steps.py --sweep               # transformer LM at depth 2, 4, 8 (~8 min on 2 cores)

See bench/README.md for the workloads, variants and methodology.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import sys
import tempfile
import time
from typing import Any

DEFAULT_WORKLOADS = "W1,W2,W3,W4"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default=DEFAULT_WORKLOADS, help="comma-separated subset of W1,W2,W3,W4,T2,T4,T8 (default W1-W4)")
    p.add_argument("--variants", default=None,
                   help="comma-separated variants to run, diagnostic ones included (default: torch_eager, "
                        "functrain_eager, functrain_compiled, plus the --diag ones); torch_eager is always kept")
    p.add_argument("--diag", default="W1,W2",
                   help="workloads that also get the diagnostic variants (ft_compiled_noseed, bare_compile, "
                        "ft_compiled_donate, ...); 'none' for none, 'all'")
    p.add_argument("--strong", default="all",
                   help="workloads that also get the strongest hand-written PyTorch (torch_eager_foreach, "
                        "torch_eager_fused, torch_compiled); default 'all', 'none' for none")
    p.add_argument("--sweep", action="store_true",
                   help="the transformer depth sweep: workloads T2,T4,T8 with torch_eager, torch_eager_foreach, "
                        "torch_eager_fused, torch_compiled, functrain_compiled, ft_compiled_owned "
                        "(default 10 rounds x 2 updates; --workloads/--variants narrow it)")
    p.add_argument("--prewarm", action=argparse.BooleanOptionalAction, default=None,
                   help="before the first workload, compile each compiled variant once on a tiny 1-layer LM so "
                        "that one-time costs (inductor's start-up, each path's first lowering of the ops) are not "
                        "charged to the first workload's compile (default: on with --sweep, off otherwise)")
    p.add_argument("--rounds", type=int, default=None, help="timed rounds per workload (default 40)")
    p.add_argument("--steps", type=int, default=None,
                   help="optimizer updates per variant per round (default per workload: W1 100, W2 5, W3 40, W4 40)")
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed updates per variant before the rounds (default: half a round, at least 3)")
    p.add_argument("--quick", action="store_true", help="smoke test: 3 rounds of a few updates")
    p.add_argument("--no-compile", action="store_true", help="skip the compiled variants")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads and OMP/MKL_NUM_THREADS (default 1)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--inductor-cache", default="fresh",
                   help="TORCHINDUCTOR_CACHE_DIR: 'fresh' (default: an empty temp folder, cold-cache compile "
                        "times), 'default' (leave it), or a folder")
    p.add_argument("--wait-quiet", type=float, default=None, metavar="CORES",
                   help="before each round, wait (at most --wait-quiet-max s, default 3) until other processes use "
                        "less than CORES cores; for a shared machine")
    p.add_argument("--wait-quiet-max", type=float, default=3.0)
    p.add_argument("--dw-tol", type=float, default=1e-4,
                   help="max |Δw| allowed between functrain_eager and torch_eager (fp32 workloads)")
    p.add_argument("--out-json", default=None, help="write every round's numbers here")
    p.add_argument("--out-md", default=None, help="also write the markdown report here")
    return p.parse_args(argv)


def setup_env(args: argparse.Namespace) -> str:
    """Threads and inductor cache: must happen before torch is imported."""
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(args.threads)
    if args.inductor_cache == "fresh":
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="ft-bench-inductor-")
        return "fresh (cold)"
    if args.inductor_cache != "default":
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = args.inductor_cache
        return args.inductor_cache
    return "default"


def machine() -> str:
    model = "?"
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "?")
    except OSError:
        pass
    return f"{os.cpu_count()}-core {platform.machine()} ({model}), {platform.system()}"


def busy_s() -> float:
    """CPU-seconds the whole machine has been busy since boot (from /proc/stat; 0 where unavailable)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return 0.0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def other_load(window: float = 0.1) -> float:
    """Cores used by other processes over the next ``window`` seconds."""
    b0, c0, t0 = busy_s(), time.process_time(), time.perf_counter()
    time.sleep(window)
    return max(0.0, (busy_s() - b0 - (time.process_time() - c0)) / (time.perf_counter() - t0))


def wait_quiet(cores: float | None, max_s: float) -> None:
    if cores is None:
        return
    t0 = time.perf_counter()
    while other_load() >= cores and time.perf_counter() - t0 < max_s:
        pass


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def prewarm(names: list[str], device) -> float:
    """Compile the compiled variants in ``names`` once on a tiny 1-layer LM (d 32, seq 8); return the wall time.

    What it pays, once per process, is not charged to the first workload's first call: inductor's
    start-up (imports, compile workers, C++ headers) and each compile path's first lowering of the
    LM's ops (attention, layer norm, embedding), so that compile times compare across depths.
    """
    import torch

    from bench import variants, workloads

    t = time.perf_counter()
    tiny = workloads.Workload("T1-tiny", "prewarm", (), 2, "lm", kind="lm", layers=1, d_model=32, heads=2, seq=8,
                              vocab=16, n_batches=2)
    workloads.build(tiny, device)
    for name in names:
        if name in variants.COMPILED:
            v = variants.make_variant(name, tiny)
            v.first_step(0)
            v.step(1)
    torch._dynamo.reset()
    return time.perf_counter() - t


def run_workload(key: str, names: list[str], args: argparse.Namespace, device) -> dict[str, Any]:
    import torch

    from bench import variants, workloads
    from functrain.bench.syncs import SyncCounter

    # Dynamo keeps per-code-object state (compiled entries, and sizes seen, which turn a later
    # compile of the same function with new shapes dynamic): start each workload from a clean slate
    torch._dynamo.reset()
    wl = workloads.build(workloads.WORKLOADS[key], device)
    k = args.steps or wl.steps_per_round
    rounds = args.rounds or (10 if wl.kind == "lm" else 40)
    if args.quick:
        k, rounds = args.steps or max(2, k // 10), args.rounds or 3
    warmup = args.warmup if args.warmup is not None else max(3, k // 2)
    n = len(wl.batches)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    log(f"[{key}] {wl.describe}; {rounds} rounds x {k} updates, warm-up {warmup}")

    vs = []
    info: dict[str, dict[str, Any]] = {}
    failed: dict[str, str] = {}
    for name in names:  # warm-up, one variant at a time; the first call compiles
        try:
            v = variants.make_variant(name, wl)
            dyn_w0, t_w0 = variants.dynamo_counts()[1], time.perf_counter()
            v.first_step(0)
        except Exception as e:  # noqa: BLE001 - report the variant as failed and time the others
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            failed[name] = f"{type(e).__name__}: {first}"
            log(f"  warm-up {name}: FAILED: {failed[name]}")
            continue
        vs.append(v)
        for i in range(1, warmup - 1):
            v.step(i % n)
        counter = None
        if v.name == "torch_compiled":  # a dispatch mode around Dynamo code would change what it runs
            v.step((warmup - 1) % n)
            sync_desc = "not counted (fullgraph=False)" + (" + 1 sync: bool(isfinite(grad norm))" if wl.fp16 else "")
        elif v.compiled:  # fullgraph=True: the graph holds no host sync; run the last warm-up step plainly
            v.step((warmup - 1) % n)
            sync_desc = "0 (fullgraph graph)"
        else:
            with SyncCounter(host=v.host_tensors()) as counter:
                v.step((warmup - 1) % n)
            sync_desc = counter.describe()
        sync()
        warmup_s = time.perf_counter() - t_w0
        graphs = v.graphs_warmup
        if v.compiled and v.graphs is None:  # Dynamo-compiled: count every graph of the warm-up
            graphs = variants.dynamo_counts()[1] - dyn_w0
        info[v.name] = {"first_call_s": v.first_call_s, "warmup_s": warmup_s, "graphs": graphs, "syncs": sync_desc,
                        "syncs_total": None if counter is None else counter.total,
                        "host_reads": None if counter is None else counter.host_reads,
                        "aten_ops_per_update": None if counter is None else counter.ops,
                        "compiled": v.compiled}
        log(f"  warm-up {v.name}: first call {v.first_call_s:.3f} s, warm-up {warmup_s:.1f} s"
            + (f", {graphs} graph(s)" if v.compiled else f", syncs/update {sync_desc}"))

    base = next(v for v in vs if v.name == "torch_eager")
    for v in vs:  # every variant has now made `warmup` updates on the same batches
        info[v.name]["max_dw_warmup"] = None if v is base else variants.max_abs_diff(v.params(), base.params())
    graphs0 = {v.name: v.graphs for v in vs}
    dyn0 = variants.dynamo_counts()
    gc.collect()
    gc.freeze()  # the warm-up's heap: keep the per-round gc.collect() short
    wall: dict[str, list[float]] = {v.name: [] for v in vs}
    cpu: dict[str, list[float]] = {v.name: [] for v in vs}
    other: dict[str, list[float]] = {v.name: [] for v in vs}
    cursor = warmup
    t_start = time.perf_counter()
    for r in range(rounds):
        order = vs[r % len(vs):] + vs[:r % len(vs)]  # rotate the order every round
        idx = [(cursor + j) % n for j in range(k)]
        wait_quiet(args.wait_quiet, args.wait_quiet_max)
        for v in order:
            gc.collect()
            step = v.step
            sync()
            b0, c0, t0 = busy_s(), time.process_time(), time.perf_counter()
            for i in idx:
                step(i)
            sync()
            t1, c1, b1 = time.perf_counter(), time.process_time(), busy_s()
            wall[v.name].append(t1 - t0)
            cpu[v.name].append(c1 - c0)
            other[v.name].append(max(0.0, (b1 - b0) - (c1 - c0)) / (t1 - t0))
        cursor += k
    log(f"  {rounds} rounds in {time.perf_counter() - t_start:.1f} s")
    gc.unfreeze()
    dyn1 = variants.dynamo_counts()

    res: dict[str, Any] = {"key": key, "kind": wl.kind, "layers": wl.layers, "title": wl.title, "describe": wl.describe, "rounds": rounds, "k": k,
                           "warmup": warmup, "variants": {}, "notes": [],
                           "dynamo_frames_in_rounds": dyn1[0] - dyn0[0],
                           "dynamo_graphs_in_rounds": dyn1[1] - dyn0[1]}
    for v in vs:
        d = info[v.name]
        d["round_wall_s"], d["round_cpu_s"] = wall[v.name], cpu[v.name]
        d["round_s_per_update"] = [t / k for t in wall[v.name]]
        d["round_cpu_s_per_update"] = [t / k for t in cpu[v.name]]
        d["round_other_load"] = other[v.name]
        if v.compiled:
            now = v.graphs
            # CompiledStep counts its own graphs; for bare_compile use Dynamo's process-wide counters
            d["recompiles_in_rounds"] = (now - graphs0[v.name]) if now is not None else res["dynamo_graphs_in_rounds"]
            d["graphs"] = now if now is not None else d["graphs"]
        d["max_dw"] = None if v is base else variants.max_abs_diff(v.params(), base.params())
        d["eval_loss"] = workloads.eval_loss(wl, v.params())
        d["max_dema"] = variants.max_abs_diff(v.ema(), base.ema()) if v is not base else (
            0.0 if base.ema() is not None else None)
        res["variants"][v.name] = d
    if wl.fp16:
        res["notes"].append(f"{key}: after {warmup + rounds * k} updates: "
                            + "; ".join(f"{v.name} {v.scale_info()}" for v in vs))
    for name, err in failed.items():
        res["notes"].append(f"{key}: {name} failed in its first call and was not timed: {err[:300]}")
    res["failed_variants"] = failed
    fe = res["variants"].get("functrain_eager")
    if fe is not None and not wl.fp16 and fe["max_dw"] > args.dw_tol:
        res["notes"].append(f"{key}: functrain_eager's final weights differ from torch_eager's by "
                            f"{fe['max_dw']:.1e} > {args.dw_tol:g}")
        res["failed"] = True
    if res["dynamo_frames_in_rounds"] or res["dynamo_graphs_in_rounds"]:
        res["notes"].append(f"{key}: Dynamo compiled {res['dynamo_frames_in_rounds']} frame(s) / "
                            f"{res['dynamo_graphs_in_rounds']} graph(s) during the timed rounds")
        res["failed"] = True
    return res


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cache = setup_env(args)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if root not in sys.path:
        sys.path.insert(0, root)
    t_all = time.perf_counter()

    import torch

    import functrain as ft
    from bench import report, variants, workloads

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if args.sweep and args.workloads == DEFAULT_WORKLOADS:
        args.workloads = ",".join(workloads.SWEEP)
    keys = [k.strip().upper() for k in args.workloads.split(",") if k.strip()]
    bad = [k for k in keys if k not in workloads.WORKLOADS]
    if bad:
        print(f"unknown workload(s) {bad}; known: {list(workloads.WORKLOADS)}", file=sys.stderr)
        return 2

    def which(flag: str) -> set[str]:
        if flag.lower() == "none":
            return set()
        return set(keys) if flag.lower() == "all" else {k.strip().upper() for k in flag.split(",")}

    diag, strong = which(args.diag), which(args.strong)
    known = variants.MAIN + variants.STRONG + variants.DIAG
    chosen = None if args.variants is None else [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in chosen or [] if v not in known]
    if unknown:
        print(f"unknown variant(s) {unknown}; known: {list(known)}", file=sys.stderr)
        return 2
    if args.sweep and chosen is None:
        chosen = list(variants.SWEEP_VARIANTS)

    prewarm_s = None
    if (args.sweep if args.prewarm is None else args.prewarm) and not args.no_compile:
        prewarm_s = prewarm(chosen if chosen is not None else list(variants.MAIN + variants.STRONG), device)
        log(f"prewarm: one-time compile start-up took {prewarm_s:.1f} s (not charged to any workload)")

    results: dict[str, Any] = {}
    for key in keys:
        names = (list(variants.MAIN) + (list(variants.STRONG) if key in strong else [])
                 + (list(variants.DIAG) if key in diag else []))
        if chosen is not None:  # an explicit list: any variant, diagnostic or not
            names = [n for n in known if n in chosen or n == "torch_eager"]
        if args.no_compile:
            names = [n for n in names if n not in variants.COMPILED]
        res = run_workload(key, names, args, device)
        report.summarise(res)
        results[key] = res

    meta = {"date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"), "machine": machine(),
            "python": platform.python_version(), "torch": torch.__version__, "functrain": ft.__version__,
            "threads": torch.get_num_threads(), "device": str(device), "inductor_cache": cache,
            "argv": sys.argv[1:] if argv is None else argv, "prewarm_s": prewarm_s, "wall_min": (time.perf_counter() - t_all) / 60}
    if "W4" in results and device.type == "cpu":
        results["W4"]["notes"].append("W4: fp16 on CPU has no fast kernels (it is emulated, several times slower "
                                      "than fp32); these numbers show overhead and syncs, not fp16 speed. "
                                      "Measure fp16 speed on a GPU (--device cuda).")
    md = report.markdown(meta, results)
    print(md)
    if args.out_md:
        with open(args.out_md, "w") as f:
            f.write(md + "\n")
    if args.out_json:
        with open(args.out_json, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1, default=str)
    failed = [k for k, r in results.items() if r.get("failed")]
    if failed:
        print(f"\nFAILED checks in {failed} (see the notes above)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
