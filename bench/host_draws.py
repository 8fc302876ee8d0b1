"""Python coins in a compiled step: what a step of 12 coins (4,096 outcomes) costs per call, with the bound on its
captures and without (issue 36 row 3).

    python bench/host_draws.py                    # 16 calls per variant under inductor, ~3 min on a loaded machine
    python bench/host_draws.py --calls 10 --backend aot_eager

The step: ``w * x`` summed, then 12 times ``if random.random() < 0.5: y = y * (1 + 0.01 k)`` (each coin a branch
of the capture), SGD. Variants, one after the other in one process (a compile is not a thing to interleave):

* ``bounded``: ``FUNCTRAIN_COMPILE_DRAW_CAPTURES`` unset (the default bound, 8);
* ``unbounded``: ``FUNCTRAIN_COMPILE_DRAW_CAPTURES=4096`` (every outcome compiled: what every call did before).

Each variant runs in a process of its own with an empty inductor cache folder (the two draw the same outcomes:
the second would find the first's graphs).

Reported per variant: graphs compiled, the CPU seconds (the process and its ended children: inductor's C++
compiler) and the wall seconds of each call (median and max over the calls that
compiled, and over those that did not), the resident set's growth from the first call's end to the last's (MiB), and whether every call
equalled the eager step (to 1e-6: inductor rounds differently). Then the host cost of picking a capture for a
call past the bound (``DrawCases.key`` with 8 captures of 12 coins known, the median of 2,000 calls, microseconds).
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _cpu() -> float:
    """CPU seconds of this process and of its children that have ended (inductor's C++ compiler runs)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def _loss(params, buffers, x):
    y = (params["w"] * x).sum()
    for k in range(12):
        if random.random() < 0.5:
            y = y * (1.0 + 0.01 * (k + 1))
    return y


def variant(name: str, bound: str | None, calls: int, backend: str) -> dict:
    import torch
    import functrain as ft

    if bound is None:
        os.environ.pop("FUNCTRAIN_COMPILE_DRAW_CAPTURES", None)
    else:
        os.environ["FUNCTRAIN_COMPILE_DRAW_CAPTURES"] = bound
    step = ft.train_step(_loss, ft.optim.sgd(0.01))
    cstep = ft.compile(step, backend=backend)
    a = b = step.init({"w": torch.ones(3)}, seed=0)
    compiled_s, other_s, walls, equal = [], [], [], True
    rss0 = None
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i in range(calls):
            x = torch.arange(3.0) + i
            a, _ = step(a, x)
            before = cstep.compiles
            t0, w0 = _cpu(), time.perf_counter()
            b, _ = cstep(b, x)
            dt = _cpu() - t0
            (compiled_s if cstep.compiles > before else other_s).append(dt)
            walls.append((cstep.compiles > before, time.perf_counter() - w0))
            equal &= bool(torch.allclose(a.params["w"], b.params["w"], rtol=1e-6, atol=1e-6))
            if rss0 is None:  # (after the first call: the compiler's imports are not the captures' cost)
                rss0 = _rss_mib()
    return {"name": name, "graphs": cstep.compiles, "compiled_s": compiled_s, "other_s": other_s, "walls": walls,
            "rss_growth_mib": _rss_mib() - rss0, "equal": equal}


def pick_cost() -> float:
    from functrain.compiler.host_draws import DrawCases, DrawPlan, OutcomeKey
    import torch

    cases = DrawCases(8)
    for j in range(8):  # 8 captures of 12 coins, each holding its own outcome
        plan = DrawPlan()
        plan.draws = [("random", ())] * 12
        plan.guards = [(i, "<", 0.5) for i in range(12)]
        plan.results = tuple(bool((j >> i) & 1) for i in range(12))

        class Cap:
            draws = plan
        cases.add(OutcomeKey(("sig", plan.results)), Cap)
    rngs = [{"key": torch.tensor([s, 0], dtype=torch.int64)} for s in range(2000)]
    times = []
    for rng in rngs:
        t0 = time.perf_counter()
        cases.key("sig", rng)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=16)
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--variant", choices=("bounded", "unbounded"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant is None:  # each variant in a process of its own, with a cache folder of its own (no hit)
        import subprocess
        import tempfile
        print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; backend {args.backend}; "
              f"{args.calls} calls per variant, each variant in a fresh process with an empty inductor cache")
        for name in ("bounded", "unbounded"):
            with tempfile.TemporaryDirectory() as cache:
                env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "OMP_NUM_THREADS": "1"}
                subprocess.run([sys.executable, __file__, "--variant", name, "--calls", str(args.calls),
                                "--backend", args.backend], env=env, check=True, timeout=3600)
        print(f"picking a capture past the bound (DrawCases.key, 8 captures of 12 coins): {pick_cost():.1f} us "
              f"median")
        return
    import torch
    torch.set_num_threads(1)
    r = variant(args.variant, None if args.variant == "bounded" else "4096", args.calls, args.backend)
    c, o = r["compiled_s"], r["other_s"]
    wc = [w for compiled, w in r["walls"] if compiled]
    wo = [w for compiled, w in r["walls"] if not compiled]

    def fmt(xs: list) -> str:
        return f"median {statistics.median(xs):.3f} s, max {max(xs):.3f} s" if xs else "-"
    print(f"{args.variant:10s} graphs {r['graphs']:3d}; calls that compiled ({len(c)}): CPU {fmt(c)}, wall {fmt(wc)}; "
          f"the others ({len(o)}): CPU {fmt(o)}, wall {fmt(wo)}; RSS +{r['rss_growth_mib']:.1f} MiB; equal to eager: "
          f"{r['equal']}", flush=True)


if __name__ == "__main__":
    main()
