"""Compile time of the transformers model matrix (tests/models/tiny_models.py): ft.compile against torch.compile.

    python bench/models.py                    # every family, cold then cached, both paths (~1 min each on 2 cores)
    python bench/models.py gpt2 t5            # some of them

For each family, fresh processes (``OMP_NUM_THREADS=1``) time the first call of the documented step
(``ft.clip(1.0)(ft.accumulate(2)(ft.train_step(model loss, adamw)))``), blocking, with inductor:

* ``ft cold``: ``ft.compile(step, background=False)`` with an empty ``cache_dir`` (one per family and path);
* ``ft cached``: the same in a new process: AOTAutograd's and inductor's caches hit;
* ``dynamo cold`` / ``dynamo cached``: ``capture="dynamo"``, i.e. ``torch.compile(fullgraph=True)`` of the step.

Phases of the first call (each a process CPU figure, children included): ``trace`` (functrain's ``make_fx``
capture; Dynamo's own trace is not split out: ``—``), and the rest (AOTAutograd,
inductor's lowering and code generation, the C++ compiler, which runs in compile subprocesses) as ``backend``.
Wall and CPU seconds are both printed: on a loaded machine, read the CPU column.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

CHILD = r"""
import json, os, resource, sys, time
def cpu():
    a, b = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime
import torch, functrain as ft
sys.path.insert(0, os.path.join(sys.argv[4], "tests", "models"))
from tiny_models import documented_step
from functrain.compiler import capture
traced = [0.0]
real_trace = capture.trace
def timed(*a, **k):
    t = cpu(); out = real_trace(*a, **k); traced[0] += cpu() - t; return out
capture.trace = timed
import functrain.compiler.runtime as runtime
runtime.trace = timed
step, state, batch, _ = documented_step(sys.argv[1])
step(state, batch(0))  # (the eager step once: imports and first-call work are not the compile's)
w, c = time.perf_counter(), cpu()
cstep = ft.compile(step, background=False, capture=sys.argv[2], cache_dir=sys.argv[3])
cstep(state, batch(0))
wall, total = time.perf_counter() - w, cpu() - c
if sys.argv[2] == "dynamo":
    traced[0] = None  # (Dynamo's own trace is not split out here)
print(json.dumps({"wall_s": wall, "cpu_s": total, "trace_cpu_s": traced[0], "graphs": cstep.compiles}))
"""


def run(name: str, capture: str, cache: str, repo: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=repo, FUNCTRAIN_COMPILE_POLICY="always")
    out = subprocess.run([sys.executable, "-c", CHILD, name, capture, cache, repo], capture_output=True, text=True,
                         env=env, timeout=1800)
    if out.returncode != 0:
        return {"error": (out.stderr.strip().splitlines() or ["?"])[-1][:200]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def _s(x: float | None) -> str:
    return "—" if x is None else f"{x:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="*")
    parser.add_argument("--paths", default="auto,dynamo", help="comma-separated captures: auto, dynamo")
    args = parser.parse_args()
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, os.path.join(repo, "tests", "models"))
    from tiny_models import MODELS

    names = args.models or list(MODELS)
    print("| model | path | cold wall s | cold CPU s | trace CPU s | backend CPU s | cached wall s | cached CPU s |")
    print("|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as root:
        for name in names:
            for capture in args.paths.split(","):
                cache = os.path.join(root, f"{name}-{capture}")
                cold, cached = run(name, capture, cache, repo), run(name, capture, cache, repo)
                if "error" in cold or "error" in cached:
                    print(f"| {name} | {capture} | {cold.get('error') or cached.get('error')} |", flush=True)
                    continue
                print(f"| {name} | {'ft.compile' if capture == 'auto' else 'torch.compile (dynamo)'} | "
                      f"{cold['wall_s']:.1f} | {cold['cpu_s']:.1f} | {_s(cold['trace_cpu_s'])} | "
                      f"{_s(None if cold['trace_cpu_s'] is None else cold['cpu_s'] - cold['trace_cpu_s'])} | "
                      f"{cached['wall_s']:.1f} | {cached['cpu_s']:.1f} |",
                      flush=True)


if __name__ == "__main__":
    main()
