"""Per-call cost of hyper-parameters as data (issue 40), paired in one process: the same step called with a state
that holds its hyper-parameters (the default: inputs of the graph) and with one whose ``hyper`` fields are ``None``
(the constructor's numbers, constants of the graph: the code path before issue 40), eager and compiled.

The step is the main job's transforms on W1's model: MLP 32-64-64-1, batch 32, AdamW with warm-up + cosine
(10,000 steps), clip 1.0, EMA 0.999 (ft.ema's default warm-up). ``ft.compile(step)`` (inductor) builds one graph per
state kind. Rounds alternate the kinds, ``--calls`` calls each; the process CPU time per call is reported (the
machine is shared: ``time.process_time``, not the wall clock) with the paired ratio per round (data / constants).

    python bench/hyper.py --rounds 20 --calls 1000
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import functrain as ft
from functrain.core.hyper import holders


def constants(state: ft.TrainState) -> ft.TrainState:
    """``state`` with every ``hyper`` field ``None``: the step reads its constructor's numbers (graph constants)."""
    def strip(tree):
        if isinstance(tree, tuple) and "hyper" in getattr(type(tree), "_fields", ()):
            tree = tree._replace(hyper=None)
        if isinstance(tree, dict):
            return {k: strip(v) for k, v in tree.items()}
        if isinstance(tree, tuple) and hasattr(type(tree), "_fields"):
            return type(tree)._make(strip(v) for v in tree)
        return tree
    return state._replace(opt_state=strip(state.opt_state), slots=strip(state.slots))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--calls", type=int, default=1000)
    args = ap.parse_args()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 1))
    apply_fn, params, buffers = ft.functionalize(model)

    def loss_fn(params, buffers, batch):
        return torch.nn.functional.mse_loss(apply_fn(params, buffers, batch[0]), batch[1])

    opt = ft.optim.adamw(ft.optim.schedules.warmup_cosine(1e-3, warmup_steps=100, total_steps=10000),
                         weight_decay=0.01)
    step = ft.ema(0.999)(ft.clip(1.0)(ft.train_step(loss_fn, opt)))
    batches = [(torch.randn(32, 32), torch.randn(32, 1)) for _ in range(16)]
    cstep = ft.compile(step)
    runs = {}
    for path, fn in (("eager", step), ("compiled", cstep)):
        for kind in ("data", "constants"):
            state = step.init(params, buffers)
            state = state if kind == "data" else constants(state)
            assert (len(holders(state.opt_state)) > 0) == (kind == "data")
            t = time.perf_counter()
            for i in range(20):
                state, _ = fn(state, batches[i % 16])
            runs[path, kind] = {"state": state, "first20_s": time.perf_counter() - t, "cpu_us": []}
    assert cstep.compiles == 2, cstep.compiles  # one graph per kind of state
    for r in range(args.rounds):
        for path, fn in (("eager", step), ("compiled", cstep)):
            for kind in (("data", "constants") if r % 2 == 0 else ("constants", "data")):
                run = runs[path, kind]
                state = run["state"]
                c = time.process_time()
                for i in range(args.calls):
                    state, _ = fn(state, batches[i % 16])
                float(state.step)
                run["cpu_us"].append((time.process_time() - c) / args.calls * 1e6)
                run["state"] = state
    out = {}
    for path in ("eager", "compiled"):
        d, c = runs[path, "data"]["cpu_us"], runs[path, "constants"]["cpu_us"]
        ratios = sorted(a / b for a, b in zip(d, c))
        q = lambda p: ratios[min(len(ratios) - 1, int(p * len(ratios)))]  # noqa: E731
        out[path] = {"data_us": statistics.median(d), "constants_us": statistics.median(c),
                     "ratio_median": statistics.median(ratios), "ratio_q25": q(0.25), "ratio_q75": q(0.75)}
        print(f"{path}: data {out[path]['data_us']:.0f} us, constants {out[path]['constants_us']:.0f} us per call "
              f"(CPU); paired ratio data/constants median {out[path]['ratio_median']:.3f} "
              f"[q25 {out[path]['ratio_q25']:.3f}, q75 {out[path]['ratio_q75']:.3f}] over {args.rounds} rounds")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
