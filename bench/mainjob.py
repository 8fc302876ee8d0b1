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
* ``precompiled``: the ``background`` command on a cache folder one ``--precompile`` (with the default
  ``--steps 400``) filled first (timed and printed apart): issue 40's later run, of any ``--steps``;
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

**Phases** (issue 29; ``--no-phases`` turns them off): every Python process of a run imports
``bench/mainjob_site/sitecustomize.py`` (that folder is put first on ``PYTHONPATH``; ``FT_MAINJOB_PHASES`` names
a fresh folder for the records), which stamps the process's creation (the kernel's record), the interpreter up and
``import torch`` done, and each rank runs its program through ``bench/mainjob_phases.py``, which wraps a few named
functions of the program (the example's data and model, ``init_process_group``, the Trainer's clock, functrain's
trace and cache load; the anchor's first forward and torch's optimizer step hook) to stamp when each phase ended;
the programs themselves are unchanged. The phase table gives each phase's median over the rounds per variant and
caches, the first step's time from the launch, and paired ratios / differences to Accelerate's and to functrain
eager's first step (same round and caches). The lead's full comparison: ``--rounds 3`` at the default 400 steps.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
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
VARIANTS = ("blocking", "background", "precompiled", "eager", "accelerate")
ACC = re.compile(rb"ACC-RESULT first_step_s=([0-9.]+) total_s=([0-9.]+)")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _command(variant: str, results: str, steps: int, nproc: int, phases: bool = False) -> list[str]:
    entry = [PHASES_ENTRY] if phases else []  # each rank runs the program through it (bench/mainjob_phases.py)
    if variant == "accelerate":
        exe = os.path.join(os.path.dirname(sys.executable), "accelerate")
        launcher = [exe if os.path.exists(exe) else ACCELERATE, "launch"]
        return [*launcher, "--multi_gpu", "--num_processes", str(nproc), "--num_machines", "1", "--mixed_precision",
                "no", "--dynamo_backend", "no", "--main_process_port", str(_free_port()), *entry, ANCHOR, "--steps",
                str(steps), "--out", results]
    extra = {"blocking": ["--compile-blocking"], "background": [], "precompiled": [], "eager": ["--no-compile"],
             "precompile": ["--precompile"]}[variant]
    return [sys.executable, "-m", "functrain.launch", "--nproc", str(nproc), *entry, "examples/diffusion.py",
            "--steps", str(steps), "--results", results, *extra]


# -- the phases of a launch -------------------------------------------------------------------------------------
HERE = os.path.dirname(os.path.abspath(__file__))
PHASES_ENTRY = os.path.join(HERE, "mainjob_phases.py")
PHASES_SITE = os.path.join(HERE, "mainjob_site")  # its sitecustomize.py stamps every Python process of the run
# (name, from stamp, to stamp) of one rank, in the order a launch goes through them; "launch" is this script's
# Popen, "launcher" the launcher process's record. A phase whose stamps are missing is "-" (not measured there).
PHASES = (
    ("launcher up", "launch", "launcher.python"),        # the launcher's interpreter started
    ("launcher imports", "launcher.python", "process"),  # ... its imports (torch) and torchrun's agent, to the rank
    ("interpreter", "process", "python"),                 # the rank's interpreter + site
    ("import torch", "python", "torch"),
    ("import library", "torch", "library"),               # functrain (its launcher's boot imports it) / accelerate
    ("data", "data_start", "data"),                       # the example's digits_dataset() (scikit-learn's file)
    ("model", "model_start", "model"),
    ("distributed init", "dist_start", "dist_init"),
    ("other setup", None, None),                          # library -> loop, less data, model and distributed init
    ("first step", "loop", "first_step"),                 # the loop's start to the first step's return
    ("trace", "trace_start", "trace"),                    # functrain's compile: where it happens (from the launch)
    ("cache load", "load_start", "load"),
    ("compile (blocking)", "compile_start", "compile"),
)


def _end(proc: subprocess.Popen) -> None:
    """Kill the run's whole session (launcher, ranks) if it is still running; reap the launcher."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            proc.kill()
        proc.wait(30)


def read_phases(folder: str, launch: float) -> dict:
    """The run's stamps, in seconds from the launch: rank 0's, the launcher's (``launcher.*``), the latest rank's
    first step (``first_step_all``), the compiler's imports finished (``compile_imports``)."""
    records = []
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        if name.startswith("phases-") and name.endswith(".json"):
            try:
                with open(os.path.join(folder, name)) as f:
                    records.append(json.load(f))
            except (OSError, ValueError):
                continue
    ranks = [r for r in records if "script" in r["stamps"]]
    launchers = [r for r in records if r["rank"] is None and "script" not in r["stamps"]
                 and not any("compiler.worker" in str(a) for a in r["argv"])]
    out: dict = {}
    rank0 = next((r for r in ranks if r["rank"] in ("0", None)), None)
    if rank0 is not None:
        out.update({k: v - launch for k, v in rank0["stamps"].items()})
    if launchers:  # the first process started: accelerate's console script / python -m functrain.launch
        first = min(launchers, key=lambda r: r["stamps"].get("process", r["stamps"]["python"]))
        out.update({f"launcher.{k}": v - launch for k, v in first["stamps"].items()})
    firsts = [r["stamps"]["first_step"] for r in ranks if "first_step" in r["stamps"]]
    if firsts and len(firsts) == len(ranks):
        out["first_step_all"] = max(firsts) - launch
    out["launch"] = 0.0
    out["ranks"] = {r["rank"]: {k: round(v - launch, 3) for k, v in r["stamps"].items()} for r in ranks}
    out["notes"] = {r["rank"]: r["notes"] for r in ranks if r.get("notes")}
    return out


def phase_durations(st: dict) -> dict:
    """Each phase of :data:`PHASES` in seconds (``None``: not measured in that run)."""
    d: dict = {}
    for name, a, b in PHASES:
        if a is not None:
            d[name] = st[b] - st[a] if a in st and b in st else None
    known = [d.get(k) for k in ("data", "model", "distributed init")]
    if "library" in st and "loop" in st:
        d["other setup"] = st["loop"] - st["library"] - sum(x for x in known if x is not None)
    else:
        d["other setup"] = None
    return d


def one_run(results: str, cache: str, steps: int, nproc: int, timeout: float, variant: str = "background",
            phases: bool = False, policy: str = "always") -> dict:
    shutil.rmtree(results, ignore_errors=True)
    root = os.path.dirname(HERE)  # the checkout: functrain and examples/ (the anchor imports the example's model)
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, FUNCTRAIN_CACHE_DIR=os.path.join(cache, "functrain"),
               PYTHONUNBUFFERED="1", FT_EXAMPLES=os.path.join(root, "examples"), OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    if policy != "default":  # compile whatever the run's length and the load, and finish it into the caches
        env.update(FUNCTRAIN_COMPILE_POLICY=policy, FUNCTRAIN_COMPILE_FINISH="1")
    stamps = None
    if phases:
        stamps = tempfile.mkdtemp(prefix="ft-mainjob-phases-")
        env["FT_MAINJOB_PHASES"] = stamps
        env["PYTHONPATH"] = os.pathsep.join((PHASES_SITE, env["PYTHONPATH"]))
    cmd = _command(variant, results, steps, nproc, phases)
    metrics = os.path.join(results, "metrics.jsonl")
    seen: dict[str, float] = {}
    launch = time.time()
    t0 = time.perf_counter()
    # its own session: a timeout or an interrupted bench ends the launcher and its ranks together (_end)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=root,
                            start_new_session=True)
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
    try:
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
                break
            time.sleep(0.02)
    finally:  # (a timeout, or this script interrupted: nothing of the run is left running)
        _end(proc)
        if stamps is not None and sys.exc_info()[0] is not None:
            shutil.rmtree(stamps, ignore_errors=True)
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
    if stamps is not None:
        out["stamps"] = read_phases(stamps, launch)
        out["phases"] = phase_durations(out["stamps"])
        shutil.rmtree(stamps, ignore_errors=True)
    return out


def _workers(cache: str | None = None) -> list[int]:
    """Compile workers still running on this machine (a background run's detached compile finishing); with
    ``cache``, only those of this script's runs on that cache folder (their ``TORCHINDUCTOR_CACHE_DIR``: a shared
    machine runs other people's workers too, which this script must not wait for)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if b"functrain.compiler.worker" not in f.read():
                        continue
                if cache is not None:
                    with open(f"/proc/{entry}/environ", "rb") as f:
                        if f"TORCHINDUCTOR_CACHE_DIR={cache}".encode() not in f.read().split(b"\0"):
                            continue
                found.append(int(entry))
            except OSError:
                continue
    return found


def wait_for_workers(timeout: float, cache: str | None = None) -> float:
    """Wait (bounded) until no compile worker (of runs on ``cache``) runs: a run that ended before its background
    compile leaves its worker to finish into the caches (FUNCTRAIN_COMPILE_FINISH), and the next run must neither
    race it nor share the CPU with it. Returns the seconds waited."""
    t0 = time.perf_counter()
    while _workers(cache) and time.perf_counter() - t0 < timeout:
        time.sleep(0.1)
    return time.perf_counter() - t0


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def _fmt2(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _median(xs: list) -> float | None:
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2


def print_phase_table(rows: list[dict]) -> None:
    """Each phase's median over the rounds, one column per variant and caches; then the first step's time from the
    launch (rank 0; every rank), the first logged step, and paired ratios / differences (same round and caches) to
    Accelerate's and to functrain eager's first step."""
    cols = []
    for r in rows:
        if r["rc"] == 0 and r.get("phases") and (r["variant"], r["run"]) not in cols:
            cols.append((r["variant"], r["run"]))
    if not cols:
        return

    def runs(col: tuple) -> list[dict]:
        return [r for r in rows if (r["variant"], r["run"]) == col and r["rc"] == 0 and r.get("phases")]

    def paired(r: dict, variant: str) -> dict | None:
        return next((q for q in rows if q["round"] == r["round"] and q["variant"] == variant and q["run"] == r["run"]
                     and q["rc"] == 0 and q.get("stamps", {}).get("first_step")), None)

    lines = [(name, [_median([r["phases"].get(name) for r in runs(c)]) for c in cols]) for name, _, _ in PHASES]
    lines.append(("**first step, from the launch (rank 0)**",
                  [_median([r["stamps"].get("first_step") for r in runs(c)]) for c in cols]))
    lines.append(("first step, every rank", [_median([r["stamps"].get("first_step_all") for r in runs(c)])
                                             for c in cols]))
    lines.append(("compiler's imports done", [_median([r["stamps"].get("compile_imports") for r in runs(c)])
                                              for c in cols]))
    lines.append(("compiled step in use (switch)", [_median([r["stamps"].get("switch") for r in runs(c)])
                                                    for c in cols]))
    lines.append(("first logged step (outside)", [_median([r["first_step_s"] for r in runs(c)]) for c in cols]))
    lines.append(("total", [_median([r["total_s"] for r in runs(c)]) for c in cols]))
    for ref, how in (("accelerate", "/"), ("eager", "-")):
        vals = []
        for c in cols:
            pairs = [(r["stamps"].get("first_step"), paired(r, ref)) for r in runs(c)]
            pairs = [(a, q["stamps"]["first_step"]) for a, q in pairs if a is not None and q is not None]
            vals.append(_median([a / b if how == "/" else a - b for a, b in pairs]))
        lines.append((f"first step {how} {ref}'s (paired, median)", vals))
    n = [len(runs(c)) for c in cols]
    print(f"\nphases, seconds (median of {min(n)}-{max(n)} runs per column; load {_fmt(_median([r['load'] for r in rows]))})")
    print("| phase | " + " | ".join(f"{v} {k}" for v, k in cols) + " |")
    print("|---|" + "---|" * len(cols))
    for name, vals in lines:
        print(f"| {name} | " + " | ".join(_fmt2(v) for v in vals) + " |")


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
    p.add_argument("--no-phases", dest="phases", action="store_false",
                   help="run the programs bare (default: each rank through bench/mainjob_phases.py, which stamps "
                        "the phases of its launch)")
    p.add_argument("--policy", default="always", choices=("always", "never", "default"),
                   help="FUNCTRAIN_COMPILE_POLICY for the runs, with FUNCTRAIN_COMPILE_FINISH=1 (default always: a "
                        "cold run compiles and fills the caches the warm run reads, whatever its length and the "
                        "load); default: neither set, the policy decides as in a user's run")
    args = p.parse_args(argv)
    args.results = os.path.abspath(args.results)  # (the runs start in the checkout's folder)
    args.cache = os.path.abspath(args.cache) if args.cache else None
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        p.error(f"--variants: unknown {bad}; the variants are {', '.join(VARIANTS)}")
    runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    if os.environ.get("PYTHONDONTWRITEBYTECODE"):
        print("note: PYTHONDONTWRITEBYTECODE is set: every process of every run compiles functrain's (and the "
              "example's) sources again (about 0.2 s a process on a quiet machine, 1 s at load 11); unset it, or "
              "set PYTHONPYCACHEPREFIX, to time what a user with cached bytecode sees", flush=True)
    rows = []
    for rnd in range(args.rounds):
        for variant in variants:
            cache = args.cache or tempfile.mkdtemp(prefix=f"ft-mainjob-{variant}-")
            if variant == "precompiled":  # one --precompile (a 400-step job's) fills this folder first
                # (run through the same phase stamps as the runs: they wrap the example's functions, which the
                # warm start's key reads, so a precompile without them would be another program's)
                pre = one_run(args.results + "-pre", cache, 400, args.nproc, args.timeout, "precompile", args.phases,
                              args.policy)
                print(f"round {rnd} precompile: rc {pre['rc']}, {pre['total_s']:.1f} s", flush=True)
                if pre["rc"] != 0:
                    print(pre["tail"], file=sys.stderr)
            for name in runs:
                r = one_run(args.results, cache, args.steps, args.nproc, args.timeout, variant, args.phases,
                            args.policy)
                r.update(round=rnd, variant=variant, run=name, load=os.getloadavg()[0])
                r["worker_after_exit_s"] = wait_for_workers(args.timeout, cache)
                rows.append(r)
                print(f"round {rnd} {variant} {name}: rc {r['rc']}, first loss on the bar "
                      f"{_fmt(r['first_loss_on_bar_s'])}, first logged step {_fmt(r['first_step_s'])}, total "
                      f"{r['total_s']:.1f} s (load {r['load']:.1f}); its compile worker ran on for "
                      f"{r['worker_after_exit_s']:.1f} s after it", flush=True)
                if r.get("phases"):
                    print("   " + ", ".join(f"{k} {_fmt2(v)}" for k, v in r["phases"].items()) + "; first step "
                          f"at {_fmt2(r['stamps'].get('first_step'))} (every rank {_fmt2(r['stamps'].get('first_step_all'))})",
                          flush=True)
                for rank, notes in (r.get("stamps") or {}).get("notes", {}).items():
                    print(f"   rank {rank}: " + "; ".join(f"{k}: {v}" for k, v in notes.items()), flush=True)
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
    if args.phases:
        print_phase_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{k: v for k, v in r.items() if k != "tail" or r["rc"] != 0} for r in rows], f, default=str,
                      indent=1)
    return 0 if all(r["rc"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
