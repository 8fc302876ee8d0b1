"""A conv net's cold compile: denoising-diffusion-pytorch's Unet, ``torch.compile(model)`` against ``ft.compile``.

    python bench/convnet.py                      # every variant, one round (about 15 min on a quiet 2-core CPU)
    python bench/convnet.py --variants torch_compile,ft_blocking --dim-mults 1,2

The model is the one of issue 19: ``GaussianDiffusion(Unet(dim=16, dim_mults=(1, 2), channels=1))`` on 16x16
grey images (random images: compile time and step time do not depend on the values), batch 32, Adam(1e-4,
(0.9, 0.99)). Needs the package (``pip install -e ".[ddpm]"``: it pulls torchvision, so a venv whose torch matches
it; see docs/index.md). Every run is a process of its own with ``torch.set_num_threads(--threads)``; a *cold*
run gets a new, empty inductor cache folder (``TORCHINDUCTOR_CACHE_DIR``; the machine's ISA-probe memo,
``FUNCTRAIN_CACHE_DIR``, is kept, so a first compile on the machine is not what is measured).

Variants, run in this order (a ``*_variant`` run reuses the cache folder of the run before it: what a user pays
for a second configuration of the same model on the same machine):

* ``eager``: ``ft.train_step(diffusion, ft.optim.adam(...))`` uncompiled (the per-update baseline);
* ``torch_compile``: ``torch.compile(diffusion)`` and an eager ``torch.optim.Adam``, cold;
* ``torch_compile_variant``: the same compiled model with ``torch.optim.AdamW`` (the optimizer runs eagerly: only
  the model is compiled, and its graphs are in the cache);
* ``ft_blocking``: ``ft.compile(step, background=False)``, cold: the first call traces, compiles and steps;
* ``ft_variant``: the same step with ``ft.optim.adamw`` instead, blocking, in ``ft_blocking``'s cache (a whole-step
  graph: the optimizer is in it);
* ``ft_background``: ``ft.compile(step, background=True)``, cold: eager steps from the first call while a worker
  compiles; the run goes on until the compiled step has run ``--after`` steps (or ``--limit`` seconds);
* not run unless asked for: ``ft_blocking_flat`` / ``ft_variant_flat``, the blocking pair on the flat state
  (``step.init(..., flat=True)``: one buffer per dtype, so the update is one kernel).

Reported per run: seconds from the process start to the end of the first update (imports included; for
``ft_background`` also to the switch and the step it happened at), the median seconds per update afterwards (for
``ft_background``: eager before the switch and compiled after it), and the load average.
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

VARIANTS = ("eager", "torch_compile", "torch_compile_variant", "ft_blocking", "ft_variant", "ft_background",
            "ft_blocking_flat", "ft_variant_flat")
DEFAULT = VARIANTS[:6]
REUSES = {"torch_compile_variant": "torch_compile", "ft_variant": "ft_blocking", "ft_variant_flat": "ft_blocking_flat"}

CHILD = r"""
import json, os, statistics, sys, time
t0 = time.perf_counter()
import torch
import functrain as ft
from denoising_diffusion_pytorch import GaussianDiffusion, Unet

variant, dim, mults, threads, steps, after, limit = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), \
    int(sys.argv[5]), int(sys.argv[6]), float(sys.argv[7])
torch.set_num_threads(threads)
torch.manual_seed(0)
model = GaussianDiffusion(Unet(dim=dim, dim_mults=tuple(int(m) for m in mults.split(",")), channels=1),
                          image_size=16, timesteps=1000, sampling_timesteps=50)
params = sum(p.numel() for p in model.parameters())
batches = [torch.rand(32, 1, 16, 16, generator=torch.Generator().manual_seed(i)) for i in range(4)]
stamps = []
out = {"variant": variant, "params": params}

if variant.startswith("torch_compile"):
    cmodel = torch.compile(model)
    kind = torch.optim.AdamW if variant.endswith("variant") else torch.optim.Adam
    opt = kind(model.parameters(), lr=1e-4, betas=(0.9, 0.99))
    for i in range(steps):
        loss = cmodel(batches[i % 4])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        float(loss)
        stamps.append(time.perf_counter())
else:
    fn, p, b = ft.functionalize(model)
    opt = (ft.optim.adamw if variant.startswith("ft_variant") else ft.optim.adam)(1e-4, betas=(0.9, 0.99))
    step = ft.train_step(fn, opt)
    if variant.startswith("ft_background"):
        step = ft.compile(step, background=True, donate=True)
    elif variant != "eager":
        step = ft.compile(step, background=False, donate=True)
    state = step.init(p, b, flat=variant.endswith("_flat"))
    progress = getattr(step, "progress", None)
    switched = None
    i = 0
    while True:
        state, m = step(state, batches[i % 4])
        float(m["loss"])
        stamps.append(time.perf_counter())
        i += 1
        if progress is not None and switched is None and progress.phase == "compiled":
            switched = i  # this call ran the compiled code (the switch happens in the call)
            out["switch_s"] = stamps[-1] - t0
            out["compile_s"] = progress.compile_s
        if progress is None and i >= steps:
            break
        if progress is not None and ((switched is not None and i >= switched + after)
                                     or stamps[-1] - t0 > limit):
            break
    out["switched_at"] = switched
    out["phase"] = progress.phase if progress is not None else None
    out["reason"] = progress.reason if progress is not None else None
    if progress is not None:
        step.close()

out["first_s"] = stamps[0] - t0
gaps = [b - a for a, b in zip(stamps, stamps[1:])]
if out.get("switched_at"):
    k = out["switched_at"]
    out["eager_s"] = statistics.median(gaps[:k - 2]) if k > 2 else None
    out["step_s"] = statistics.median(gaps[k:]) if len(gaps) > k else None
else:
    out["step_s"] = statistics.median(gaps) if gaps else None
out["steps"] = len(stamps)
print("RESULT " + json.dumps(out), flush=True)
"""


def _load() -> str:
    try:
        return "%.1f" % os.getloadavg()[0]
    except OSError:
        return "?"


def one(variant: str, cache: str, args: argparse.Namespace) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "OMP_NUM_THREADS": str(args.threads),
           "FUNCTRAIN_COMPILE_FINISH": "0"}
    before = _load()
    try:
        proc = subprocess.run([sys.executable, "-c", CHILD, variant, str(args.dim), args.dim_mults, str(args.threads),
                               str(args.steps), str(args.after), str(args.limit)],
                              env=env, capture_output=True, text=True, timeout=args.limit + 900)
    except subprocess.TimeoutExpired:
        return {"variant": variant, "error": "timed out"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        return {"variant": variant, "error": f"rc {proc.returncode}: {proc.stderr.strip()[-600:]}"}
    res = json.loads(lines[-1][len("RESULT "):])
    res["load"] = f"{before}-{_load()}"
    return res


def _fmt(v, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default=",".join(DEFAULT), help=f"comma-separated, of {', '.join(VARIANTS)}")
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--dim-mults", default="1,2")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--steps", type=int, default=21, help="updates per run (not ft_background)")
    p.add_argument("--after", type=int, default=20, help="ft_background: compiled updates after the switch")
    p.add_argument("--limit", type=float, default=900.0, help="ft_background: stop after this many seconds")
    p.add_argument("--json", default=None, help="write the rows here")
    args = p.parse_args(argv)
    chosen = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in chosen if v not in VARIANTS]
    if bad:
        p.error(f"unknown variant(s) {bad}; choose from {list(VARIANTS)}")
    rows, caches = [], {}
    with tempfile.TemporaryDirectory(prefix="ft-convnet-") as root:
        for v in (v for v in VARIANTS if v in chosen):
            cache = caches.get(REUSES.get(v, v))  # a variant reuses its base's cache (a new one if it did not run)
            reused = REUSES.get(v) if cache is not None else None
            if cache is None:
                cache = caches[v] = tempfile.mkdtemp(dir=root)
            res = one(v, cache, args)
            res["caches"] = f"{reused}'s" if reused else ("-" if v == "eager" else "cold")
            rows.append(res)
            print(json.dumps(res), flush=True)
    print()
    print("| variant | caches | first update s | switch s (at step) | eager s/update | s/update | load |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['variant']} | {r['caches']} | error: {r['error'][:200]} | | | | |")
            continue
        switch = f"{_fmt(r.get('switch_s'))} ({r.get('switched_at')})" if r["variant"] == "ft_background" else ""
        print(f"| {r['variant']} | {r['caches']} | {_fmt(r['first_s'])} | {switch} | {_fmt(r.get('eager_s'), '.3f')} | "
              f"{_fmt(r.get('step_s'), '.3f')} | {r['load']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
