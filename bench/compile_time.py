"""Time ft.compile's first call of W1 in fresh processes: cold, warm cache, reused package.

    python bench/compile_time.py            # each scenario once, in order (~1-2 min on 2 cores)
    python bench/compile_time.py --repeat 3 # the median of three rounds

Each scenario is a new process (``import torch`` and ``functrain`` are timed apart from the first
call, which here means ``ft.compile(...)`` plus the first call: inductor is imported in either), with ``OMP_NUM_THREADS=1`` and folders under one temp folder:

* ``cold``: empty ``cache_dir`` and empty probe memo (``FUNCTRAIN_CACHE_DIR``): a first compile on a
  machine (inductor's CPU ISA probes included);
* ``cold_memo``: empty ``cache_dir``, the probe memo of ``cold``: a new graph (or results folder) on a
  machine that has compiled before;
* ``warm``: the ``cache_dir`` of ``cold_memo``: AOTAutograd's and inductor's caches hit;
* ``package_build``: an empty ``cache_dir`` with ``package=True``: compiles ahead of time (AOTInductor);
* ``package_load``: the same folder again: the package is loaded, nothing compiles.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
import functrain as ft
t2 = time.perf_counter()
sys.path.insert(0, sys.argv[3])
from bench.workloads import WORKLOADS, build, functrain_step
wl = build(WORKLOADS["W1"], torch.device("cpu"))
step, params, buffers = functrain_step(wl)
state = step.init(params, buffers)
t3 = time.perf_counter()
cstep = ft.compile(step, cache_dir=sys.argv[1], package=sys.argv[2] == "1")
s, m = cstep(state, wl.batches[0])
t4 = time.perf_counter()
from torch._dynamo.utils import counters
print(json.dumps({"import_torch_s": t1 - t0, "import_functrain_s": t2 - t1, "first_call_s": t4 - t3,
                  "process_to_first_step_s": t4 - t0,
                  "fx_hit": counters["inductor"]["fxgraph_cache_hit"], "fx_miss": counters["inductor"]["fxgraph_cache_miss"],
                  "package": [cstep._packages.built, cstep._packages.loaded] if cstep._packages else None}))
"""

SCENARIOS = [("cold", "a", "memo_cold", "0"), ("cold_memo", "b", "memo", "0"), ("warm", "b", "memo", "0"),
             ("package_build", "c", "memo", "1"), ("package_load", "c", "memo", "1")]


def one_round(root: str) -> dict:
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = {}
    for name, cache, memo, package in SCENARIOS:
        if name == "cold_memo":  # the memo the cold run wrote, in a folder of its own
            src = os.path.join(root, "memo_cold")
            os.makedirs(os.path.join(root, "memo"), mode=0o700, exist_ok=True)
            for f in os.listdir(src):
                with open(os.path.join(src, f), "rb") as a, open(os.path.join(root, "memo", f), "wb") as b:
                    b.write(a.read())
        env = {**os.environ, "OMP_NUM_THREADS": "1", "FUNCTRAIN_CACHE_DIR": os.path.join(root, memo),
               "PYTHONPATH": repo}
        env.pop("TORCHINDUCTOR_CACHE_DIR", None)
        r = subprocess.run([sys.executable, "-c", CHILD, os.path.join(root, cache), package, repo], env=env,
                           capture_output=True, text=True, timeout=900)
        if r.returncode != 0:
            raise RuntimeError(f"{name} failed:\n{r.stderr[-3000:]}")
        out[name] = json.loads(r.stdout.strip().splitlines()[-1])
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=1)
    args = p.parse_args(argv)
    rounds = []
    for _ in range(args.repeat):
        with tempfile.TemporaryDirectory(prefix="ft-compile-time-") as root:
            rounds.append(one_round(root))
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = float("nan")
    print(f"W1 first call of ft.compile(step), fresh processes, median of {args.repeat} (load {load:.1f}):")
    print(f"{'scenario':15s} {'first call s':>12s} {'import torch s':>14s} {'start->step s':>13s}  cache")
    for name, *_ in SCENARIOS:
        rs = [r[name] for r in rounds]
        med = {k: statistics.median(r[k] for r in rs) for k in ("first_call_s", "import_torch_s",
                                                                  "process_to_first_step_s")}
        last = rs[-1]
        cache = f"fx hit {last['fx_hit']} miss {last['fx_miss']}" + \
            (f", package built {last['package'][0]} loaded {last['package'][1]}" if last["package"] else "")
        print(f"{name:15s} {med['first_call_s']:12.2f} {med['import_torch_s']:14.2f} "
              f"{med['process_to_first_step_s']:13.2f}  {cache}")
    print(json.dumps(rounds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
