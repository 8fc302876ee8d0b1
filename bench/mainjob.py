"""Time the README's main job from outside: launch to first logged step, and total wall time.

    python bench/mainjob.py                       # every variant, cold then warm, alternated, 1 round
    python bench/mainjob.py --variants background,accelerate --rounds 2
    python bench/mainjob.py --variants background --runs warm --cache /tmp/ft-ind   # one run on a given cache

Variants (``--variants``, default all, in this order within each round):

* ``blocking``: ``python -m functrain.launch --nproc 2 examples/diffusion.py --compile-blocking`` (the compile
  runs before the first step: ``TrainConfig.compile_background=False``);
* ``background``: the same without the flag (the default: eager steps while a worker compiles; a compile still
  running when the run ends finishes after it, into the caches: the script waits for it before the next run and
  reports how long it ran on);
* ``eager``: ``--no-compile``;
* ``accelerate``: the Accelerate anchor (``/work/shared/bench/anchors/diffusion_accelerate.py``, eager,
  ``accelerate launch --multi_gpu --num_processes 2 --main_process_port <a free port>``, ``FT_EXAMPLES=examples``;
  the ``accelerate`` beside this Python, else ``FT_ACCELERATE``, default ``/work/venvs/ddpm/bin/accelerate``).

Each variant runs *cold* (a new, empty cache folder) then *warm* (the same folder again, so inductor's /
AOTAutograd's on-disk caches and functrain's probe memo can hit; for ``eager`` and ``accelerate`` the second
run only repeats the first). Each run deletes its results folder first, sets ``TORCHINDUCTOR_CACHE_DIR`` and
``FUNCTRAIN_CACHE_DIR`` (the probe memo) under the cache folder, reads the output as it comes (a progress
bar redraws with ``\\r``, so the output is read in chunks, not lines) and polls ``RESULTS/metrics.jsonl``
every 20 ms. Reported, in seconds from the launch: the first output that shows a loss (the bar), the first
line in ``metrics.jsonl`` (the first logged step) and the exit. The anchor logs no step as it goes: its first
step is the ``first_step_s`` it prints (from its own start) plus its launcher's start-up (the outside total
minus the script's own total). A final table gives each run's ratios to the same round's Accelerate run
(paired: same round, close in time, so a change of load moves both).
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
import socket
import time

LOSS = re.compile(rb"loss[=: ]+[-+0-9.eE]+")


ANCHOR = "/work/shared/bench/anchors/diffusion_accelerate.py"
# accelerate is not installed beside this Python (functrain's torch 2.13): the machine's venv that has it
# (torch 2.14.1; the anchor's model comes from examples/, functrain from PYTHONPATH)
ACCELERATE = os.environ.get("FT_ACCELERATE", "/work/venvs/ddpm/bin/accelerate")
VARIANTS = ("blocking", "background", "eager", "accelerate")
ACC = re.compile(rb"ACC-RESULT first_step_s=([0-9.]+) total_s=([0-9.]+)")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _command(variant: str, results: str, steps: int, nproc: int) -> list[str]:
    if variant == "accelerate":
        exe = os.path.join(os.path.dirname(sys.executable), "accelerate")
        launcher = [exe if os.path.exists(exe) else ACCELERATE, "launch"]
        return [*launcher, "--multi_gpu", "--num_processes", str(nproc), "--num_machines", "1", "--mixed_precision",
                "no", "--dynamo_backend", "no", "--main_process_port", str(_free_port()), ANCHOR, "--steps",
                str(steps), "--out", results]
    extra = {"blocking": ["--compile-blocking"], "background": [], "eager": ["--no-compile"]}[variant]
    return [sys.executable, "-m", "functrain.launch", "--nproc", str(nproc), "examples/diffusion.py",
            "--steps", str(steps), "--results", results, *extra]


def one_run(results: str, cache: str, steps: int, nproc: int, timeout: float, variant: str = "background") -> dict:
    shutil.rmtree(results, ignore_errors=True)
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, FUNCTRAIN_CACHE_DIR=os.path.join(cache, "functrain"),
               PYTHONUNBUFFERED="1", FT_EXAMPLES="examples", OMP_NUM_THREADS="1")
    cmd = _command(variant, results, steps, nproc)
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
    out = {"rc": proc.returncode, "first_loss_on_bar_s": seen.get("bar"), "first_metrics_line_s": seen.get("metrics"),
           "first_metrics_line": first_line, "total_s": total, "tail": tail.decode(errors="replace")[-1500:]}
    if variant == "accelerate":
        m = ACC.search(bytes(tail))
        if m:  # its first step from its own start, plus the launcher's start-up (outside total - its own total)
            first_s, inside = float(m.group(1)), float(m.group(2))
            out["first_metrics_line_s"] = first_s + max(total - inside, 0.0)
    out["first_step_s"] = out["first_metrics_line_s"]
    return out


def _workers() -> list[int]:
    """Compile workers still running on this machine (a background run's detached compile finishing)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if b"functrain.compiler.worker" in f.read():
                        found.append(int(entry))
            except OSError:
                continue
    return found


def wait_for_workers(timeout: float) -> float:
    """Wait (bounded) until no compile worker runs: a run that ended before its background compile leaves its
    worker to finish into the caches (FUNCTRAIN_COMPILE_FINISH), and the next run must neither race it nor share
    the CPU with it. Returns the seconds waited."""
    t0 = time.perf_counter()
    while _workers() and time.perf_counter() - t0 < timeout:
        time.sleep(0.1)
    return time.perf_counter() - t0


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    p.add_argument("--runs", default="cold,warm", help="cold,warm (default) or one of them")
    p.add_argument("--rounds", type=int, default=1, help="repeat the whole alternation this many times")
    p.add_argument("--cache", default=None, help="inductor cache folder (default: a new empty temp folder per variant "
                                                 "and round)")
    p.add_argument("--results", default="/tmp/mj")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--json", default=None, help="write every run's numbers here")
    args = p.parse_args(argv)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        p.error(f"--variants: unknown {bad}; the variants are {', '.join(VARIANTS)}")
    runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    rows = []
    for rnd in range(args.rounds):
        for variant in variants:
            cache = args.cache or tempfile.mkdtemp(prefix=f"ft-mainjob-{variant}-")
            for name in runs:
                r = one_run(args.results, cache, args.steps, args.nproc, args.timeout, variant)
                r.update(round=rnd, variant=variant, run=name, load=os.getloadavg()[0])
                r["worker_after_exit_s"] = wait_for_workers(args.timeout)
                rows.append(r)
                print(f"round {rnd} {variant} {name}: rc {r['rc']}, first loss on the bar "
                      f"{_fmt(r['first_loss_on_bar_s'])}, first logged step {_fmt(r['first_step_s'])}, total "
                      f"{r['total_s']:.1f} s (load {r['load']:.1f}); its compile worker ran on for "
                      f"{r['worker_after_exit_s']:.1f} s after it", flush=True)
                if r["rc"] != 0:
                    print(r["tail"], file=sys.stderr)
            if not args.cache:
                shutil.rmtree(cache, ignore_errors=True)
    print("\n| round | variant | caches | first logged step s | total s | first / acc | total / acc | "
          "first / eager |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        def ref(variant: str) -> dict | None:
            return next((q for q in rows if q["round"] == r["round"] and q["variant"] == variant
                         and q["run"] == r["run"] and q["rc"] == 0), None)

        def ratio(a: float | None, b: dict | None, key: str) -> str:
            return "-" if a is None or b is None or not b.get(key) else f"{a / b[key]:.2f}"

        acc, eager = ref("accelerate"), ref("eager")
        print(f"| {r['round']} | {r['variant']} | {r['run']} | {_fmt(r['first_step_s'])} | {r['total_s']:.1f} | "
              f"{ratio(r['first_step_s'], acc, 'first_step_s')} | {ratio(r['total_s'], acc, 'total_s')} | "
              f"{ratio(r['first_step_s'], eager, 'first_step_s')} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{k: v for k, v in r.items() if k != "tail" or r["rc"] != 0} for r in rows], f, default=str,
                      indent=1)
    return 0 if all(r["rc"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
