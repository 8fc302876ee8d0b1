"""Per-call cost of hyper-parameters as data (issue 40): the main job's transforms on W1's model, this tree against
another (e.g. main), eager and compiled, in alternating processes.

The step: MLP 32-64-64-1, batch 32, AdamW with warm-up + cosine (10,000 steps), clip 1.0, EMA 0.999 (ft.ema's
default warm-up). Each process builds the step with the tree given, runs ``--calls`` calls eagerly and ``--calls``
calls of ``ft.compile(step)`` (inductor, ``cache_dir`` per tree: the first round compiles, the later ones load),
and reports the process CPU time per call (``time.process_time``: the machine is shared) and the wall time. Rounds
alternate the trees; the ratio is paired per round (this tree / the other).

    python bench/hyper.py --other /work/main --rounds 5 --calls 2000
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
import torch
import functrain as ft
calls = int(sys.argv[1]); cache = sys.argv[2]
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                            torch.nn.Linear(64, 1))
apply_fn, params, buffers = ft.functionalize(model)
def loss_fn(params, buffers, batch):
    return torch.nn.functional.mse_loss(apply_fn(params, buffers, batch[0]), batch[1])
opt = ft.optim.adamw(ft.optim.schedules.warmup_cosine(1e-3, warmup_steps=100, total_steps=10000), weight_decay=0.01)
step = ft.ema(0.999)(ft.clip(1.0)(ft.train_step(loss_fn, opt)))
batches = [(torch.randn(32, 32), torch.randn(32, 1)) for _ in range(16)]
out = {}
for name, fn in (("eager", step), ("compiled", ft.compile(step, cache_dir=cache))):
    state = step.init(params, buffers)
    for i in range(20):
        state, _ = fn(state, batches[i % 16])
    float(state.step)
    c, w = time.process_time(), time.perf_counter()
    for i in range(calls):
        state, _ = fn(state, batches[i % 16])
    float(state.step)
    out[name] = {"cpu_us": (time.process_time() - c) / calls * 1e6, "wall_us": (time.perf_counter() - w) / calls * 1e6}
print(json.dumps(out))
"""


def one(tree: str, calls: int, cache: str) -> dict:
    env = {**os.environ, "PYTHONPATH": tree, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", CHILD, str(calls), cache], env=env, capture_output=True,
                          text=True, timeout=1800, cwd=tempfile.gettempdir())
    if proc.returncode != 0:
        raise SystemExit(f"{tree}: {proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--other", required=True, help="the other tree (a functrain checkout), e.g. /work/main")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=2000)
    args = ap.parse_args()
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    caches = {t: tempfile.mkdtemp(prefix="hyper-bench-") for t in (here, args.other)}
    ratios: dict = {"eager": [], "compiled": []}
    for r in range(args.rounds):
        a, b = (one(here, args.calls, caches[here]), one(args.other, args.calls, caches[args.other])) if r % 2 == 0 \
            else tuple(reversed((one(args.other, args.calls, caches[args.other]), one(here, args.calls, caches[here]))))
        for k in ratios:
            ratios[k].append(a[k]["cpu_us"] / b[k]["cpu_us"])
        print(json.dumps({"round": r, "this": a, "other": b}), flush=True)
    for k, v in ratios.items():
        print(f"{k}: this / other CPU per call, median {statistics.median(v):.3f} [{min(v):.3f}-{max(v):.3f}] "
              f"over {len(v)} rounds")


if __name__ == "__main__":
    main()
