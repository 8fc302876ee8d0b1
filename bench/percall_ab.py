"""The per-call time of a compiled step under two inductor option sets, paired and interleaved, and whether the two
compiled steps compute the same numbers bit for bit.

    python bench/percall_ab.py                                   # W1: functrain's defaults (cpp_wrapper on a
                                                                 # CPU graph) against options={"cpp_wrapper": False}
    python bench/percall_ab.py --workload W3 --rounds 30 --calls 100

Both steps are compiled in this process (fresh inductor cache folder), from the same initial state; each round
runs ``--calls`` calls of A then of B (the order alternates per round), timing each block; reported: the median
per-call time of each and the median of the per-round ratios B/A with its spread. Before timing, both run the same
``--check`` steps from the same state and their states and metrics are compared bitwise.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="W1")
    p.add_argument("--a", default="{}", help="inductor options of A (JSON; {} = functrain's defaults)")
    p.add_argument("--b", default='{"cpp_wrapper": false}', help="inductor options of B (JSON)")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--check", type=int, default=5)
    args = p.parse_args(argv)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="ft-percall-"))
    import torch
    import optree
    import functrain as ft
    torch.set_num_threads(1)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from bench.workloads import WORKLOADS, build, functrain_step

    wl = build(WORKLOADS[args.workload], torch.device("cpu"))
    step, params, buffers = functrain_step(wl)
    state = step.init(params, buffers)
    opts = {"A": json.loads(args.a), "B": json.loads(args.b)}
    steps = {k: ft.compile(step, **({"options": o} if o else {})) for k, o in opts.items()}
    clone = lambda s: optree.tree_map(lambda t: t.clone() if torch.is_tensor(t) else t, s)  # noqa: E731
    results = {}
    for k, cs in steps.items():
        s = clone(state)
        for i in range(args.check):
            s, m = cs(s, wl.batches[i % len(wl.batches)])
        results[k] = (s, m)
    la, lb = optree.tree_leaves(results["A"]), optree.tree_leaves(results["B"])
    same = len(la) == len(lb) and all((not torch.is_tensor(x)) or torch.equal(x, y) for x, y in zip(la, lb))
    states = {k: clone(state) for k in steps}
    per = {"A": [], "B": []}
    ratios = []
    for r in range(args.rounds):
        block = {}
        for k in (("A", "B") if r % 2 == 0 else ("B", "A")):
            s, cs = states[k], steps[k]
            t = time.perf_counter()
            for i in range(args.calls):
                s, m = cs(s, wl.batches[i % len(wl.batches)])
            float(m["loss"])
            block[k] = (time.perf_counter() - t) / args.calls
            states[k] = s
            per[k].append(block[k])
        ratios.append(block["B"] / block["A"])
    q = statistics.quantiles(ratios, n=4)
    print(f"{args.workload}: A {opts['A'] or 'defaults'} {1e6 * statistics.median(per['A']):.1f} us/call, "
          f"B {opts['B']} {1e6 * statistics.median(per['B']):.1f} us/call; B/A median {statistics.median(ratios):.3f} "
          f"(quartiles {q[0]:.3f}-{q[2]:.3f}, {args.rounds} rounds x {args.calls} calls, load "
          f"{os.getloadavg()[0]:.1f}); after {args.check} steps bitwise equal: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
