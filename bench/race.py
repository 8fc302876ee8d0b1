"""The fastest runner per call, as a run decides it (functrain/compiler/race.py): a background compile's JIT code
against the package built in the same run, for each workload, in fresh processes.

    python bench/race.py                          # W1 and W3, 2 repeats each
    python bench/race.py --workloads W1,W2 --repeats 3

Each repeat is one process with fresh caches: ``ft.compile(step, package=True, switch_at=2)`` with a background
runner (the Trainer's path), the package's build waited for (``wait_for_packages``), then calls until the race is
decided. Printed per repeat: the runner kept, the race's ratio (the median over its 32 rounds of the package's
time per call over the JIT code's), and both runners' median time per call in the race.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

CHILD = r"""
import json, os, statistics, sys, torch, functrain as ft
sys.path.insert(0, sys.argv[2])
from bench.workloads import WORKLOADS, build, functrain_step
from functrain.compiler import race as race_mod
torch.set_num_threads(1)
wl = build(WORKLOADS[sys.argv[3]], torch.device("cpu"))
step, params, buffers = functrain_step(wl)
state = step.init(params, buffers)
cstep = ft.compile(step, cache_dir=sys.argv[1], package=True, switch_at=2)
run = cstep.runner(donate=True, background=True)
n, times = 0, {}
for _ in range(4):
    state, _ = run(state, wl.batches[n % len(wl.batches)]); n += 1
written = cstep.wait_for_packages()
while run.progress.runner is None and n < 4 + 10 * race_mod.POLL_EVERY + 2 * race_mod.ROUNDS + 1:
    race = next(iter(run.graphs.races.values()), None)
    if race is not None and race.package is not None:
        times = list(race.times)
    state, _ = run(state, wl.batches[n % len(wl.batches)]); n += 1
jit = [t for i, t in enumerate(times) if (i % 2 == 0) == ((i // 2) % 2 == 0)]
pkg = [t for i, t in enumerate(times) if (i % 2 == 0) != ((i // 2) % 2 == 0)]
print(json.dumps({"written": written, "runner": run.progress.runner, "ratio": run.progress.runner_ratio,
                  "jit_us": statistics.median(jit) * 1e6 if jit else None,
                  "package_us": statistics.median(pkg) * 1e6 if pkg else None}))
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default="W1,W3")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--timeout", type=float, default=900.0)
    args = p.parse_args(argv)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for r in range(args.repeats):
        for name in args.workloads.split(","):
            with tempfile.TemporaryDirectory(prefix="ft-race-") as tmp:
                env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
                env.update(OMP_NUM_THREADS="1", FUNCTRAIN_CACHE_DIR=os.path.join(tmp, "memo"))
                proc = subprocess.run([sys.executable, "-c", CHILD, os.path.join(tmp, "cache"), root, name],
                                      env=env, capture_output=True, text=True, timeout=args.timeout)
                if proc.returncode:
                    print(f"{name} repeat {r}: failed\n{proc.stderr[-2000:]}")
                    continue
                out = json.loads(proc.stdout.strip().splitlines()[-1])
                ratio = f"{out['ratio']:.3f}" if out["ratio"] is not None else "-"
                us = (f"JIT {out['jit_us']:.1f} µs, package {out['package_us']:.1f} µs"
                      if out["jit_us"] is not None else "no race")
                print(f"{name} repeat {r}: kept {out['runner']}, ratio {ratio} ({us}; package written: "
                      f"{out['written']})", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
