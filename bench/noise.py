"""A transform that draws random numbers, eager against compiled, on the CPU (issue 31).

    python bench/noise.py                          # 30 rounds of 50 steps, ~2 min (3 compiles)
    python bench/noise.py --rounds 10 --steps 20   # quicker
    python bench/noise.py --out-json /tmp/noise.json

The workload: an MLP 64-256-256-1 (82,689 parameters, ReLU), MSE, batch 32, AdamW lr 1e-3, with the gradient noise
transform of docs/transforms.md (``GradNoise``: ``g + std * torch.randn_like(g)`` per gradient leaf). Variants,
timed in one process on one thread, interleaved (each round every variant makes ``--steps`` updates on the same
batches, in an order rotated every round):

* ``eager``: the step called eagerly (the baseline of the ratios);
* ``compiled``: ``ft.compile(step)``, as it is now: on the CPU inductor's ``fallback_random`` (torch's kernels draw
  the numbers, the eager step's);
* ``compiled_inductor_rng``: ``ft.compile(step, options={"fallback_random": False})``: inductor's own generator,
  what a compiled CPU step drew before;
* ``plain_eager``, ``plain_compiled``: the same step without the transform (what the noise costs).

Reported per variant: the median time per update over rounds [min-max], the paired ratio to ``eager`` (the median
over rounds of variant / eager in the same round, with a 95% bootstrap interval), and, before the rounds, whether the
compiled variants drew the eager step's noise bit for bit. Then one draw alone: ``torch.randn_like`` of 82,689
floats eagerly and compiled both ways (the median of ``--draws`` calls).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

import torch  # noqa: E402

import functrain as ft  # noqa: E402
from functrain.bench.stats import bootstrap_ci, median  # noqa: E402


class GradNoise(ft.Transform):
    """docs/transforms.md's example: Gaussian noise added to the gradients, with a count in its slot."""

    name = "grad_noise"
    order = 50

    def __init__(self, std):
        self.std = std

    def init(self, params, buffers):
        return {"count": torch.zeros((), dtype=torch.int64)}

    def transform(self, ctx):
        noise = ft.tree.tree_map(torch.randn_like, ctx.grads)
        ctx.grads = ft.tree.tree_map(lambda g, n: g + self.std * n, ctx.grads, noise)
        ctx.metrics["noise"] = ft.tree.tree_leaves(noise)[0]  # (compared between variants, not timed apart)
        ctx.set_slot(self, {"count": ctx.slot(self)["count"] + 1})


def build(noise: bool):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                torch.nn.ReLU(), torch.nn.Linear(256, 1))
    apply_fn, params, buffers = ft.functionalize(model)

    def loss_fn(p, b, batch):
        x, y = batch
        return torch.nn.functional.mse_loss(apply_fn(p, b, x), y)

    step = ft.train_step(loss_fn, ft.optim.adamw(1e-3))
    if noise:
        step = GradNoise(1e-3)(step)
    return step, step.init(params, buffers, seed=0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--draws", type=int, default=200)
    ap.add_argument("--out-json")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(32, 64, generator=g), torch.randn(32, 1, generator=g)) for _ in range(args.steps)]

    noisy, noisy_state = build(True)
    plain, plain_state = build(False)
    variants = {
        "eager": (noisy, noisy_state),
        "compiled": (ft.compile(noisy), noisy_state),
        "compiled_inductor_rng": (ft.compile(noisy, options={"fallback_random": False}), noisy_state),
        "plain_eager": (plain, plain_state),
        "plain_compiled": (ft.compile(plain), plain_state),
    }
    states, first_call, same_noise = {}, {}, {}
    _, want = noisy(noisy_state, batches[0])
    for name, (fn, state) in variants.items():
        t0 = time.perf_counter()
        new, metrics = fn(state, batches[0])
        first_call[name] = time.perf_counter() - t0
        if "noise" in metrics:
            same_noise[name] = bool(torch.equal(metrics["noise"], want["noise"]))
        for b in batches[1:args.warmup]:
            new, _ = fn(new, b)
        states[name] = new
        print(f"{name}: first call {first_call[name]:.1f} s", file=sys.stderr)

    names = list(variants)
    per_round = {n: [] for n in names}
    load = [os.getloadavg()[0]]
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            fn = variants[name][0]
            state = states[name]
            t0 = time.perf_counter()
            for b in batches:
                state, _ = fn(state, b)
            per_round[name].append((time.perf_counter() - t0) / len(batches))
            states[name] = state
        load.append(os.getloadavg()[0])

    results = {}
    for name in names:
        t = per_round[name]
        base = per_round["plain_eager" if name.startswith("plain") else "eager"]
        ratios = [a / b for a, b in zip(t, base)]
        lo, hi = bootstrap_ci(ratios)
        results[name] = {"median_s": median(t), "min_s": min(t), "max_s": max(t), "ratio": median(ratios),
                         "ratio_ci": [lo, hi], "first_call_s": first_call[name],
                         "same_noise_as_eager": same_noise.get(name), "rounds_s": t}

    x = torch.randn(sum(p.numel() for p in noisy_state.params.values()))
    draw = {"eager": torch.randn_like, "compiled": torch.compile(torch.randn_like, fullgraph=True,
                                                                  options={"fallback_random": True}),
            "compiled_inductor_rng": torch.compile(torch.randn_like, fullgraph=True)}
    draw_s = {}
    for name, fn in draw.items():
        for _ in range(10):
            fn(x)
        ts = []
        for _ in range(args.draws):
            t0 = time.perf_counter()
            fn(x)
            ts.append(time.perf_counter() - t0)
        draw_s[name] = median(ts)

    print(f"| variant | per update, median [min-max] | paired ratio [95% CI] | first call s | noise = eager's |")
    print("|---|---|---|---|---|")
    for name, v in results.items():
        base = "plain_eager" if name.startswith("plain") else "eager"
        same = "-" if v["same_noise_as_eager"] is None else ("bitwise" if v["same_noise_as_eager"] else "no")
        print(f"| {name} | {v['median_s'] * 1e3:.3f} ms [{v['min_s'] * 1e3:.3f}-{v['max_s'] * 1e3:.3f}] | "
              f"{v['ratio']:.2f} [{v['ratio_ci'][0]:.2f}-{v['ratio_ci'][1]:.2f}] x {base} | "
              f"{v['first_call_s']:.1f} | {same} |")
    print()
    print(f"torch.randn_like of {x.numel():,} floats: " +
          ", ".join(f"{n} {s * 1e3:.3f} ms" for n, s in draw_s.items()))
    print(f"load average over the rounds: {min(load):.1f}-{max(load):.1f} (2 cores)")
    if args.out_json:
        with open(args.out_json, "w") as f:
            json.dump({"results": results, "draw_s": draw_s, "load": load, "args": vars(args)}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
