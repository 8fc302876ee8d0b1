"""The per-call cost of a runner's fast path, two functrain trees compared (interleaved, paired rounds).

    python bench/runner_call.py TREE_A TREE_B [--rounds 9] [--calls 3000]

Each round starts one process per tree (A then B, alternating which goes first); each process compiles a tiny step
with ``aot_eager`` (the host path dominates: the graph does almost nothing), warms up, then times ``--calls`` calls of
``cstep.runner(donate=True)`` in process CPU seconds (``time.process_time``: less sensitive to a loaded machine than
wall time). Prints each tree's median µs per call and the median of the per-round ratios B / A with its range.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

CHILD = r"""
import time, torch, functrain as ft
from functrain.compiler import capture
capture.preload(); capture.wait_for_imports()
step = ft.train_step(lambda p, b, x: ((p["w"] * x).sum(-1) - 1).pow(2).mean(), ft.optim.sgd(0.1))
run = ft.compile(step, backend="aot_eager").runner(donate=True)
state = ft.tree.tree_map(torch.clone, step.init({"w": torch.zeros(4)}))
x = torch.ones(2, 4)
for _ in range(200):
    state, _ = run(state, x)
n = int(__import__("sys").argv[1])
t0 = time.process_time()
for _ in range(n):
    state, _ = run(state, x)
print("US", (time.process_time() - t0) / n * 1e6, flush=True)
"""


def once(tree: str, calls: int) -> float:
    env = {**os.environ, "PYTHONPATH": tree, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", CHILD, str(calls)], env=env, capture_output=True, text=True,
                         timeout=600, cwd=tree)
    line = [x for x in out.stdout.splitlines() if x.startswith("US ")]
    if out.returncode or not line:
        raise SystemExit(out.stdout[-2000:] + out.stderr[-2000:])
    return float(line[-1].split()[1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--calls", type=int, default=3000)
    args = p.parse_args()
    a, b, ratios = [], [], []
    for r in range(args.rounds):
        if r % 2:
            tb, ta = once(args.b, args.calls), once(args.a, args.calls)
        else:
            ta, tb = once(args.a, args.calls), once(args.b, args.calls)
        a.append(ta)
        b.append(tb)
        ratios.append(tb / ta)
        print(f"round {r}: A {ta:.1f} µs  B {tb:.1f} µs  B/A {tb / ta:.3f}", flush=True)
    print(f"A median {statistics.median(a):.1f} µs/call, B median {statistics.median(b):.1f} µs/call; "
          f"B/A median {statistics.median(ratios):.3f} [{min(ratios):.3f}-{max(ratios):.3f}] over {args.rounds} rounds")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
