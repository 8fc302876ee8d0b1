"""Time the README's main job from outside: launch to first logged step, and total wall time.

    python bench/mainjob.py                       # cold (fresh caches) then warm (the caches of the cold run)
    python bench/mainjob.py --runs warm --cache /tmp/ft-ind   # one run on a given cache folder

Each run deletes the results folder first, starts

    python -m functrain.launch --nproc 2 examples/diffusion.py --steps 400 --results RESULTS

with ``TORCHINDUCTOR_CACHE_DIR`` and ``FUNCTRAIN_CACHE_DIR`` (the probe memo) under ``--cache``, reads its
output as it comes (a progress bar redraws with ``\\r``, so the output is read in chunks, not lines) and polls
``RESULTS/metrics.jsonl`` every 20 ms. Reported, in seconds from the launch: the first output that shows a loss
(the progress bar), the first line in ``metrics.jsonl``, and the exit. *cold*: the cache folder is new and
empty; *warm*: the same folder again, so inductor's / AOTAutograd's on-disk caches and functrain's probe memo
can hit (the Trainer uses inductor's per-process default folder, which the variable sets).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time

LOSS = re.compile(rb"loss[=: ]+[-+0-9.eE]+")


def one_run(results: str, cache: str, steps: int, nproc: int, timeout: float) -> dict:
    shutil.rmtree(results, ignore_errors=True)
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, FUNCTRAIN_CACHE_DIR=os.path.join(cache, "functrain"),
               PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "functrain.launch", "--nproc", str(nproc), "examples/diffusion.py",
           "--steps", str(steps), "--results", results]
    metrics = os.path.join(results, "metrics.jsonl")
    seen: dict[str, float] = {}
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    tail = bytearray()

    def reader() -> None:
        buf = b""
        while True:
            chunk = proc.stdout.read1(4096) if hasattr(proc.stdout, "read1") else proc.stdout.read(1)
            if not chunk:
                return
            buf = (buf + chunk)[-512:]
            tail.extend(chunk)
            del tail[:-4000]
            if "bar" not in seen and LOSS.search(buf):
                seen["bar"] = time.perf_counter() - t0

    th = threading.Thread(target=reader, daemon=True)
    th.start()
    first_line = None
    while proc.poll() is None:
        if "metrics" not in seen:
            try:
                with open(metrics) as f:
                    line = f.readline()
                if line.endswith("\n"):
                    seen["metrics"] = time.perf_counter() - t0
                    first_line = json.loads(line)
            except (OSError, ValueError):
                pass
        if time.perf_counter() - t0 > timeout:
            proc.kill()
            break
        time.sleep(0.02)
    total = time.perf_counter() - t0
    th.join(5)
    return {"rc": proc.returncode, "first_loss_on_bar_s": seen.get("bar"), "first_metrics_line_s": seen.get("metrics"),
            "first_metrics_line": first_line, "total_s": total, "tail": tail.decode(errors="replace")[-1500:]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", default="cold,warm", help="cold,warm (default) or one of them")
    p.add_argument("--cache", default=None, help="inductor cache folder (default: a new empty temp folder)")
    p.add_argument("--results", default="/tmp/mj")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--timeout", type=float, default=600.0)
    args = p.parse_args(argv)
    cache = args.cache or tempfile.mkdtemp(prefix="ft-mainjob-inductor-")
    out = {}
    for name in [r.strip() for r in args.runs.split(",") if r.strip()]:
        r = one_run(args.results, cache, args.steps, args.nproc, args.timeout)
        out[name] = r
        print(f"{name}: rc {r['rc']}, first loss on the bar {r['first_loss_on_bar_s']}, first metrics.jsonl line "
              f"{r['first_metrics_line_s']} ({r['first_metrics_line']}), total {r['total_s']:.1f} s", flush=True)
        if r["rc"] != 0:
            print(r["tail"], file=sys.stderr)
    print(json.dumps({k: {kk: vv for kk, vv in v.items() if kk != "tail"} for k, v in out.items()}, default=str))
    return 0 if all(r["rc"] == 0 for r in out.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
