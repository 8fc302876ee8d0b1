"""Compile time against depth: the transformer LM at 2, 4, 8, 16, 32 layers (d 128) and a GPT-2-small config.

    python bench/depth.py                          # T2 T4 T8 T16 T32 gpt2, each in a fresh process, cold cache
    python bench/depth.py --depths 2,32 --no-gpt2  # a subset
    python bench/depth.py --reuse off              # the whole step traced flat (ft.compile(reuse_blocks=False))
    python bench/depth.py --flat-state             # the state made with step.init(flat="blocks"): a buffer per
                                                   # repeated block and one per dtype for the rest
    python bench/depth.py --flat-state --flat-layout both --rounds 2   # that against one buffer per dtype
                                                   # (step.init(flat=True)), paired, interleaved

Each configuration runs in a new process with an empty inductor cache folder (the probe memo of the
machine is kept: ``FUNCTRAIN_CACHE_DIR`` is left as it is, so a first compile on the machine is not
what is measured). Reported, in seconds: the trace alone (``make_fx`` of the step, in the same process
before the compile: the trace repeats inside the first call), the first call of ``ft.compile(step)``
(blocking: trace, AOTAutograd, inductor, C++ compile, one step) in wall seconds and in CPU seconds (the
process's and the C++ compiler's: what a loaded machine changes least), the graph's node count, the
region calls whose fake-tensor propagation ran (missed torch's fake-tensor cache) and their seconds, and
the median of 5 steady calls. The GPT-2-small configuration is ``transformers.GPT2Config()`` (12 layers, d 768,
12 heads, vocabulary 50257) built without any download, trained on random tokens (batch 2, 64 tokens).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

CHILD = r"""
import json, os, statistics, sys, time
t0 = time.perf_counter()
import torch
import functrain as ft
torch.set_num_threads(1)
sys.path.insert(0, sys.argv[2])
what = sys.argv[1]
if what == "gpt2":
    import transformers
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config())
    model.config.use_cache = False
    apply_fn, params, buffers = ft.functionalize(model)
    def loss_fn(p, b, batch):
        return apply_fn(p, b, input_ids=batch[0], labels=batch[0]).loss
    g = torch.Generator().manual_seed(1)
    batch = (torch.randint(0, 50257, (2, 64), generator=g),)
else:
    from bench.workloads import WORKLOADS, Workload, build, functrain_step
    depth = int(what)
    wl = Workload(f"T{depth}", f"transformer {depth} layers", (), 16, "lm", kind="lm", layers=depth,
                  steps_per_round=2, n_batches=2)
    build(wl, torch.device("cpu"))
    step, params, buffers = functrain_step(wl)
    batch = wl.batches[0]
if what == "gpt2":
    step = ft.train_step(loss_fn, ft.optim.adamw(1e-4))
flat = os.environ.get("FT_BENCH_FLAT", "")
state = step.init(params, buffers)
if flat:  # "blocks": a buffer per repeated block (step.init(flat="blocks")); "one": one buffer per dtype (flat=True)
    state = ft.flat(state, blocks=flat == "blocks")
reuse = os.environ.get("FT_BENCH_REUSE", "on") == "on"
from functrain.compiler.capture import trace
t = time.perf_counter()
cap = trace(step.apply, state._replace(rng=None), batch, "fresh", reuse_blocks=reuse)
trace_s = time.perf_counter() - t
nodes = sum(len(m.graph.nodes) for m in cap.gm.modules() if isinstance(m, torch.fx.GraphModule))
regions = sum(1 for _ in cap.gm.named_children())
del cap
cstep = ft.compile(step, reuse_blocks=reuse)
import resource
def cpu():  # this process's CPU seconds and its waited-for children's (the C++ compiler): robust to load
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime
t, c = time.perf_counter(), cpu()
s, m = cstep(state, batch)
first, first_cpu = time.perf_counter() - t, cpu() - c
times = []
for _ in range(6):
    t = time.perf_counter(); s, m = cstep(s, batch); float(m["loss"]); times.append(time.perf_counter() - t)
from torch._dynamo.utils import compilation_time_metrics
fake = compilation_time_metrics.get("invoke_subgraph_fake_tensor", [])  # a region call that missed the cache
print("RESULT " + json.dumps({"trace_s": trace_s, "first_call_s": first, "first_call_cpu_s": first_cpu, "nodes": nodes, "regions": regions,
                              "step_s": statistics.median(times[1:]), "compiles": cstep.compiles,
                              "region_fake_runs": len(fake), "region_fake_s": sum(fake)}))
"""


def run_one(what: str, root: str, timeout: float, env_extra: dict) -> dict:
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cache = tempfile.mkdtemp(prefix=f"depth-{what}-", dir=root)
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")]), **env_extra}
    t = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", CHILD, what, repo], env=env, capture_output=True, text=True,
                         timeout=timeout)
    wall = time.perf_counter() - t
    lines = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    if out.returncode or not lines:
        return {"what": what, "error": (out.stdout + out.stderr)[-1500:]}
    return {"what": what, "process_s": wall, **json.loads(lines[-1][7:])}


def load() -> float:
    return os.getloadavg()[0]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--depths", default="2,4,8,16,32")
    p.add_argument("--no-gpt2", action="store_true")
    p.add_argument("--timeout", type=float, default=3600.0)
    p.add_argument("--reuse", default="on", choices=["on", "off", "both"],
                   help="ft.compile(reuse_blocks=...) (default on here; ft.compile's default is off); both: on then off at each depth (paired)")
    p.add_argument("--flat-state", action="store_true",
                   help="step.init(params, buffers, flat=True): the update runs over one buffer per dtype, not per parameter")
    p.add_argument("--flat-layout", default="blocks", choices=["blocks", "one", "both"],
                   help="with --flat-state: blocks (a buffer per repeated block, step.init(flat=\"blocks\")), one (one "
                        "buffer per dtype, ft.flat(state, blocks=False)), both: blocks then one at each depth (paired)")
    p.add_argument("--rounds", type=int, default=1, help="repeat the whole sweep (rounds interleave the configurations)")
    p.add_argument("--out-json", default=None)
    args = p.parse_args(argv)
    todo = [d.strip() for d in args.depths.split(",") if d.strip()] + ([] if args.no_gpt2 else ["gpt2"])
    modes = ["on", "off"] if args.reuse == "both" else [args.reuse]
    layouts = ([""] if not args.flat_state else ["blocks", "one"] if args.flat_layout == "both"
               else [args.flat_layout])
    root = tempfile.mkdtemp(prefix="ft-depth-")
    rows = []
    for rnd in range(args.rounds):
        for what in todo:
            for mode in modes:
                for layout in layouts:
                    before = load()
                    r = run_one(what, root, args.timeout, {"FT_BENCH_REUSE": mode, "FT_BENCH_FLAT": layout})
                    r["load_before"], r["load_after"], r["reuse"], r["layout"], r["round"] = (
                        before, load(), mode, layout or "tree", rnd)
                    rows.append(r)
                    print(json.dumps(r), flush=True)
    print(f"\nstate: {'flat (blocks: step.init(flat=blocks); one: step.init(flat=True))' if args.flat_state else 'a tree of parameters'}")
    print("\n| round | model | reuse_blocks | state | nodes (all graphs) | regions | region fake runs (s) | trace s | "
          "first call s | first call CPU s | step ms | load |\n|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['round']} | {r['what']} | {r['reuse']} | {r['layout']} | error | | | | | | | |")
            continue
        name = "GPT-2 small" if r["what"] == "gpt2" else f"T{r['what']}"
        print(f"| {r['round']} | {name} | {r['reuse']} | {r['layout']} | {r['nodes']} | {r['regions']} | "
              f"{r['region_fake_runs']} ({r['region_fake_s']:.1f}) | {r['trace_s']:.1f} | {r['first_call_s']:.1f} | "
              f"{r['first_call_cpu_s']:.1f} | {1e3 * r['step_s']:.1f} | {r['load_before']:.1f}-{r['load_after']:.1f} |")
    if args.out_json:
        with open(args.out_json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
