"""A population of 16 W1 MLPs trained by one compiled step, against 16 compiled runs and a hand-written vmap.

    python bench/population.py                       # 16 members, 12 interleaved rounds (~3-5 min on 2 cores)
    python bench/population.py --rounds 4 --steps 10 # smoke
    python bench/population.py --members 64
    python bench/population.py --jax-python /work/venv-jax/bin/python   # + the JAX + optax vmap anchor
    python bench/population.py --workload diffusion --rounds 6         # the main job's model (examples/diffusion.py)

W1 (the shared harness's tiny workload, /work/shared/bench/workloads.py): MLP 32->64->64->1, batch 32 per member,
MSE, AdamW(lr 1e-3, weight decay 0.01); each member its own seed and its own batches (batch="per_member"). One
"population step" is one update of every member. Variants, timed interleaved in rounds in one process:

* ``population``: ``ft.compile(ft.population(16, batch="per_member")(step))``, one call per population step.
* ``sequential``: the 16 runs as 16 states of ``ft.compile(step)`` (one graph: the same shapes), one call each per
  population step: what 16 compiled runs one after another cost per update.
* ``hand_loop``: the PyTorch tutorial's ensemble, finished by hand: ``torch.func.stack_module_state`` of 16
  modules each step, ``vmap(functional_call)`` forward, ``backward`` into the modules' own parameters, then 16
  ``torch.optim.AdamW(foreach=True)`` steps (one per member).
* ``hand_stacked``: the same forward and backward on stacked leaf parameters with ONE ``torch.optim.AdamW`` over
  them (elementwise, so the same update as 16 optimizers with one lr): the strongest hand-written eager form.
* ``population_eager``: the population step without compiling.
* ``jax`` (with ``--jax-python``): the anchor, ``jax.jit(jax.vmap(step))`` with ``optax.inject_hyperparams(adamw)``
  (bench/population_jax.py) in a worker process of that JAX venv, pinned to one CPU (``--jax-pin-cpu``) as the
  shared harness pins its JAX worker. This script writes the population's initial weights, per-member
  hyper-parameters and batches to an .npz first, so both train the same numbers; the worker is driven round by
  round (one run per round, interleaved with the others); its wall and CPU seconds are its own (measured inside
  the worker around the calls and the final ``block_until_ready``). Checked and printed: the first call's
  per-member losses against ``population``'s, and the losses after the warm-up run (41 steps).

``--workload diffusion``: the README's main job's model (``examples/diffusion.py``: ``Diffusion``, the DDPM loss
over the 256-wide ``Denoiser`` MLP with its time embedding and dropout, the only size the example offers) with
the main job's step (``TrainConfig`` as the example sets it, built by the Trainer's own ``build_step``: AdamW
lr 1e-3 with warmup + cosine, betas (0.9, 0.99), wd 0, clip 1.0, EMA 0.99 every step), batch 64 digits per member,
each member its own seed and batches; variants ``population``, ``sequential`` and ``population_eager``. The
sequential runs are ``ft.member(state, i)`` of the population's initial state (so the same weights), each
compiled-step call drawing its noise from its own state's key.

Reported: population steps per second (wall and process CPU: the machine is shared), paired ratios against
``sequential`` per round, compile time of each compiled variant, the state's bytes, and the load average.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


class Bench:
    """What a workload's builder hands the timing loop: variants (a call runs one round of ``--steps`` population
    steps; it returns ``None`` to be timed here, or ``(wall_s, cpu_s)`` measured elsewhere: the JAX worker),
    compile times, state bytes, traced peaks, checks to print after the warm-up, and what to close at the end."""

    def __init__(self, title: str) -> None:
        self.title = title
        self.variants: dict[str, Callable[[], Any]] = {}
        self.compile_s: dict[str, float] = {}
        self.state_bytes: dict[str, int] = {}
        self.peak: dict[str, int] = {}
        self.notes: list[str] = []
        self.after_warmup: list[Callable[[], None]] = []
        self.close: list[Callable[[], None]] = []

    def add_loop(self, name: str, step: Callable, state: Any, data: list) -> dict:
        """Variant ``name``: one call of ``step`` per batch of ``data``, each round going on from the state the
        last one left; returns its box (``"s"``: that state, ``"m"``: the last metrics)."""
        box = {"s": state, "m": None}

        def run() -> None:
            s = box["s"]
            for b in data:
                s, box["m"] = step(s, b)
            box["s"] = s
        self.variants[name] = run
        return box


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="w1", choices=["w1", "diffusion"])
    p.add_argument("--members", type=int, default=16)
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--steps", type=int, default=None,
                   help="population steps per variant per round (default 40 for w1, 10 for diffusion)")
    p.add_argument("--variants", default=None,
                   help="default: population,sequential,hand_loop,hand_stacked,population_eager (+jax with "
                        "--jax-python) for w1; population,sequential,population_eager for diffusion")
    p.add_argument("--backend", default="inductor")
    p.add_argument("--jax-python", default=None,
                   help="the JAX venv's interpreter: adds the 'jax' variant (w1 only; bench/population_jax.py)")
    p.add_argument("--jax-pin-cpu", type=int, default=(os.cpu_count() or 1) - 1,
                   help="the CPU the JAX worker is pinned to (default: the highest; -1: no pinning)")
    p.add_argument("--pin-cpu", type=int, default=None,
                   help="pin this process to one CPU after compiling, before the warm-up round (default: not "
                        "pinned); with --jax-pin-cpu the same CPU, both sides run on the same core")
    p.add_argument("--jax-timeout", type=float, default=600.0, help="seconds before the JAX worker is declared hung")
    p.add_argument("--out-json", default=None)
    p.add_argument("--inductor-cache", default="fresh",
                   help="TORCHINDUCTOR_CACHE_DIR: 'fresh' (default: an empty temp folder, cold compile times), "
                        "'default' (leave it), or a folder")
    args = p.parse_args()
    if args.steps is None:
        args.steps = 40 if args.workload == "w1" else 10
    if args.variants is None:
        args.variants = ("population,sequential,hand_loop,hand_stacked,population_eager" if args.workload == "w1"
                         else "population,sequential,population_eager")
        if args.jax_python:
            args.variants += ",jax"
    if args.jax_python and args.workload != "w1":
        p.error(f"--jax-python: the JAX anchor is written for --workload w1, not {args.workload!r}")
    if args.jax_python and not (os.path.isfile(args.jax_python) and os.access(args.jax_python, os.X_OK)):
        p.error(f"--jax-python {args.jax_python!r} is not an executable file: give the JAX venv's interpreter "
                f"(python3 -m venv V && V/bin/pip install jax jaxlib optax; then --jax-python V/bin/python)")
    if "jax" in args.variants.split(",") and not args.jax_python:
        p.error("variant 'jax' needs --jax-python (the JAX venv's interpreter, e.g. /work/venv-jax/bin/python)")
    if args.inductor_cache != "default":
        folder = tempfile.mkdtemp(prefix="h39-inductor-") if args.inductor_cache == "fresh" else args.inductor_cache
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = folder

    import torch
    torch.set_num_threads(1)

    bench = build_w1(args) if args.workload == "w1" else build_diffusion(args)
    try:
        time_and_report(args, bench)
    finally:
        for fn in bench.close:
            fn()


def _nbytes(tree) -> int:
    import torch

    import functrain as ft
    return sum(x.numel() * x.element_size() for x in ft.tree.tree_leaves(tree) if torch.is_tensor(x))


def build_w1(args) -> Bench:
    import torch

    import functrain as ft

    n, dims, batch, lr, wd = args.members, (32, 64, 64, 1), 32, 1e-3, 0.01
    bench = Bench(f"{n} W1 MLPs")

    def model(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        layers: list = []
        for i, (a, b) in enumerate(zip(dims[:-1], dims[1:])):
            layers += [torch.nn.Linear(a, b)] + ([torch.nn.ReLU()] if i < len(dims) - 2 else [])
        return torch.nn.Sequential(*layers)

    g = torch.Generator().manual_seed(1234)
    w_true = torch.randn(dims[0], 1, generator=g) / dims[0] ** 0.5
    data = []
    for _ in range(args.steps):
        x = torch.randn(n, batch, dims[0], generator=g)
        data.append((x, x @ w_true + 0.1 * torch.randn(n, batch, 1, generator=g)))

    apply_fn, _, _ = ft.functionalize(model(0))

    def loss_fn(params, buffers, b):
        x, y = b
        return torch.nn.functional.mse_loss(apply_fn(params, buffers, x), y)

    step = ft.train_step(loss_fn, ft.optim.adamw(lr, weight_decay=wd))
    pop = ft.population(n, batch="per_member")(step)
    seeds = list(range(n))
    variants, compile_s, state_bytes, peak = bench.variants, bench.compile_s, bench.state_bytes, bench.peak
    wanted = args.variants.split(",")

    pstate = None
    if any(v in wanted for v in ("population", "population_eager", "jax")):
        pstate = pop.init(lambda s: ft.functionalize(model(s))[1], seeds=seeds)
        state_bytes["population"] = _nbytes(pstate)
        est = ft.memory(pop, pstate, data[0])
        peak["population (one call)"] = est.step_peak + est.new_state
    first: dict = {}   # the first call's per-member losses, and the losses after the warm-up run
    if "jax" in wanted:  # its start-up and compile first, alone, so the compile times do not overlap
        jaxw = JaxWorker(args, pstate, data)
        bench.close.append(jaxw.close)
        jaxw.ready()
    if "population" in wanted:
        cpop = ft.compile(pop, backend=args.backend) if args.backend != "inductor" else ft.compile(pop)
        t0 = time.perf_counter()
        s1, m1 = cpop(pstate, data[0])
        compile_s["population"] = time.perf_counter() - t0
        first["population"] = m1["loss"].tolist()
        box = bench.add_loop("population", cpop, s1, data)
        box["m"] = m1
    if "population_eager" in wanted:
        bench.add_loop("population_eager", pop, pstate, data)
    if "sequential" in wanted:
        cstep = ft.compile(step, backend=args.backend) if args.backend != "inductor" else ft.compile(step)
        states = [step.init(ft.functionalize(model(s))[1], seed=None) for s in seeds]
        state_bytes["sequential"] = sum(_nbytes(s) for s in states)
        est = ft.memory(step, states[0], (data[0][0][0], data[0][1][0]))
        peak["sequential (one member's call)"] = est.step_peak + est.new_state
        t0 = time.perf_counter()
        states[0] = cstep(states[0], (data[0][0][0], data[0][1][0]))[0]
        compile_s["sequential (one graph, shared by the 16)"] = time.perf_counter() - t0
        sbox = {"s": states}

        def run_sequential() -> None:
            ss = sbox["s"]
            for x, y in data:
                for i in range(n):
                    ss[i], m = cstep(ss[i], (x[i], y[i]))
        variants["sequential"] = run_sequential

    if "hand_loop" in wanted:
        from torch.func import functional_call, stack_module_state
        mods = [model(s) for s in seeds]
        opts = [torch.optim.AdamW(m.parameters(), lr=lr, weight_decay=wd, foreach=True) for m in mods]
        base = model(0).to("meta")

        def hand_loss(params, buffers, x, y):
            return torch.nn.functional.mse_loss(functional_call(base, (params, buffers), (x,)), y)

        vloss = torch.vmap(hand_loss)

        def run_hand_loop() -> None:
            for x, y in data:
                params, buffers = stack_module_state(mods)  # the tutorial's: new stacked leaves each step
                for o in opts:
                    o.zero_grad(set_to_none=True)
                vloss(params, buffers, x, y).sum().backward()
                for i, (mm, o) in enumerate(zip(mods, opts)):  # each member's grad into its own module
                    for name, prm in mm.named_parameters():
                        prm.grad = params[name].grad[i]
                    o.step()
        variants["hand_loop"] = run_hand_loop

    if "hand_stacked" in wanted:
        from torch.func import functional_call, stack_module_state
        sparams, sbuffers = stack_module_state([model(s) for s in seeds])
        sparams = {k: torch.nn.Parameter(v.detach().clone()) for k, v in sparams.items()}
        opt = torch.optim.AdamW(sparams.values(), lr=lr, weight_decay=wd, foreach=True)
        base2 = model(0).to("meta")

        def hand_loss2(params, buffers, x, y):
            return torch.nn.functional.mse_loss(functional_call(base2, (params, buffers), (x,)), y)

        vloss2 = torch.vmap(hand_loss2)

        def run_hand_stacked() -> None:
            for x, y in data:
                opt.zero_grad(set_to_none=True)
                vloss2(sparams, sbuffers, x, y).sum().backward()
                opt.step()
        variants["hand_stacked"] = run_hand_stacked

    if "jax" in wanted:
        ready = jaxw.ready()
        compile_s["jax (jit of vmap, first call)"] = ready["compile_s"]
        bench.notes.append(f"jax worker: {ready['version']}, affinity {ready['affinity']}, lr held as data of shape "
                           f"{tuple(ready['lr_shape'])}, jit cache entries after the first call "
                           f"{ready['cache_entries']}")
        first["jax"] = ready["first_loss"]
        jbox: dict = {}

        def run_jax() -> tuple[float, float]:
            r = jaxw.run()
            jbox["r"] = r
            return r["wall"], r["cpu"]
        variants["jax"] = run_jax

        def check_jax() -> None:  # both sides trained the same numbers? (float32 both; torch's hypers are f64)
            if "population" not in first:
                return
            a, b = torch.tensor(first["population"]), torch.tensor(first["jax"])
            bench.notes.append(f"check: first call, per-member loss, functrain population vs jax: max |diff| "
                               f"{(a - b).abs().max().item():.2e}, max rel {((a - b).abs() / a.abs()).max().item():.2e} "
                               f"(loss ~{a.mean().item():.3f}; {'agree' if torch.allclose(a, b, rtol=1e-5, atol=1e-6) else 'DIFFER'} "
                               f"at rtol 1e-5)")
            a, b = box["m"]["loss"].double(), torch.tensor(jbox["r"]["loss"], dtype=torch.float64)
            bench.notes.append(f"check: after the warm-up run ({args.steps + 1} steps), per-member loss: max rel diff "
                               f"{((a - b).abs() / a.abs()).max().item():.2e} "
                               f"({'agree' if torch.allclose(a, b, rtol=1e-3, atol=1e-6) else 'DIFFER'} at rtol 1e-3)")
            if jbox["r"]["cache_entries"] != ready["cache_entries"]:
                bench.notes.append(f"jax: the jit cache grew to {jbox['r']['cache_entries']} entries (recompiled)")
        bench.after_warmup.append(check_jax)
    return bench


class JaxWorker:
    """bench/population_jax.py in the JAX venv, driven over its stdin/stdout (one JSON object a line), every wait
    bounded by ``--jax-timeout``; on a timeout or an early exit the worker is killed and its stderr shown."""

    def __init__(self, args, pstate, data) -> None:
        import numpy as np
        import torch

        import functrain as ft
        self.timeout = args.jax_timeout
        self.dir = tempfile.mkdtemp(prefix="h39-jax-")
        hyper = ft.get_hyper(pstate)
        arrays = {f"param.{k}": v.detach().numpy() for k, v in pstate.params.items()}
        np.savez(os.path.join(self.dir, "pop.npz"), param_names=np.array(list(pstate.params)),
                 X=torch.stack([x for x, _ in data]).numpy(), Y=torch.stack([y for _, y in data]).numpy(),
                 lr=hyper["lr"].numpy(), weight_decay=hyper["weight_decay"].numpy(),
                 betas=np.array([float(hyper["beta1"][0]), float(hyper["beta2"][0])]),
                 eps=float(hyper["eps"][0]), **arrays)
        self.err = open(os.path.join(self.dir, "stderr.txt"), "w+")
        self.proc = subprocess.Popen(
            [args.jax_python, os.path.join(ROOT, "bench", "population_jax.py"), "--serve", "--npz",
             os.path.join(self.dir, "pop.npz"), "--pin-cpu", str(args.jax_pin_cpu)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err, text=True)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self._ready: dict | None = None

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def _recv(self, what: str) -> dict:
        try:
            line = self.lines.get(timeout=self.timeout)
        except queue.Empty:
            self.close()
            raise RuntimeError(f"the JAX worker sent nothing for {what} in {self.timeout:.0f} s (--jax-timeout); "
                               f"killed. Its stderr: {self._stderr()}") from None
        if line is None:
            rc = self.proc.wait(timeout=10)
            raise RuntimeError(f"the JAX worker exited (status {rc}) before {what}. Its stderr: {self._stderr()}")
        msg = json.loads(line)
        if msg.get("event") == "error":
            raise RuntimeError(f"the JAX worker failed at {what}: {msg}")
        return msg

    def _stderr(self) -> str:
        self.err.flush()
        self.err.seek(0)
        return self.err.read()[-3000:]

    def ready(self) -> dict:
        if self._ready is None:
            self._ready = self._recv("its start-up (import, data, first call)")
        return self._ready

    def run(self) -> dict:
        self.ready()
        self.proc.stdin.write(json.dumps({"op": "run"}) + "\n")
        self.proc.stdin.flush()
        return self._recv("a run")

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "exit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(timeout=30)
        self.err.close()


def build_diffusion(args) -> Bench:
    import torch

    import functrain as ft
    from functrain.trainer.build import build_step

    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from diffusion import Diffusion, digits_dataset  # the main job's model and data

    n, batch = args.members, 64
    bench = Bench(f"{n} main-job diffusion models (examples/diffusion.py's Diffusion, Denoiser width 256)")
    model = Diffusion()
    apply_fn, _, _ = ft.functionalize(model)

    def loss_fn(params, buffers, b):
        (images,) = b
        return apply_fn(params, buffers, images)

    # the main job's step, as examples/diffusion.py configures the Trainer (one process, no shard)
    config = ft.TrainConfig(
        train_batch_size=batch, gradient_accumulate_every=1, train_lr=1e-3, train_num_steps=400,
        adam_betas=(0.9, 0.99), max_grad_norm=1.0, ema_update_every=1, ema_decay=0.99, seed=0,
        lr_schedule="warmup_cosine", warmup_steps=40, min_lr=1e-4)
    step, _ = build_step(loss_fn, config, 1)
    bench.notes.append(f"the step: {[t.name for t in step.transforms]} over adamw (warmup_cosine lr 1e-3, betas "
                       f"(0.9, 0.99), wd 0)")
    pop = ft.population(n, batch="per_member")(step)
    (images,) = digits_dataset()[0].tensors
    g = torch.Generator().manual_seed(1234)
    data = [(images[torch.randint(0, len(images), (n, batch), generator=g)],) for _ in range(args.steps)]
    wanted = args.variants.split(",")
    unknown = set(wanted) - {"population", "sequential", "population_eager"}
    if unknown:
        raise SystemExit(f"--workload diffusion: variants {sorted(unknown)} are W1's; this workload has "
                         f"population, sequential, population_eager")
    pstate = pop.init(model, seeds=list(range(n)))
    bench.state_bytes["population"] = _nbytes(pstate)
    est = ft.memory(pop, pstate, data[0])
    bench.peak["population (one call)"] = est.step_peak + est.new_state
    if "population" in wanted:
        cpop = ft.compile(pop, backend=args.backend) if args.backend != "inductor" else ft.compile(pop)
        t0 = time.perf_counter()
        s1 = cpop(pstate, data[0])[0]
        bench.compile_s["population"] = time.perf_counter() - t0
        bench.add_loop("population", cpop, s1, data)
    if "population_eager" in wanted:
        bench.add_loop("population_eager", pop, pstate, data)
    if "sequential" in wanted:
        cstep = ft.compile(step, backend=args.backend) if args.backend != "inductor" else ft.compile(step)
        states = [ft.member(pstate, i) for i in range(n)]  # the same members, as n ordinary states
        bench.state_bytes["sequential"] = sum(_nbytes(s) for s in states)
        est = ft.memory(step, states[0], (data[0][0][0],))
        bench.peak["sequential (one member's call)"] = est.step_peak + est.new_state
        t0 = time.perf_counter()
        states[0] = cstep(states[0], (data[0][0][0],))[0]
        bench.compile_s[f"sequential (one graph, shared by the {n})"] = time.perf_counter() - t0
        sbox = {"s": states}

        def run_sequential() -> None:
            ss = sbox["s"]
            for (x,) in data:
                for i in range(n):
                    ss[i], m = cstep(ss[i], (x[i],))
        bench.variants["sequential"] = run_sequential
    return bench


def time_and_report(args, bench: Bench) -> None:
    from functrain.bench.stats import median, paired_ratios, spread

    variants = bench.variants
    if args.pin_cpu is not None:  # after the compiles (inductor's compile workers inherit the mask)
        os.sched_setaffinity(0, {args.pin_cpu})
        bench.notes.append(f"this process pinned to CPU {args.pin_cpu} for the timed rounds")
    for fn in variants.values():  # warm-up round, untimed
        fn()
    for fn in bench.after_warmup:
        fn()
    wall: dict = {k: [] for k in variants}
    cpu: dict = {k: [] for k in variants}
    loads = []
    t_start = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
    for r in range(args.rounds):
        order = list(variants) if r % 2 == 0 else list(reversed(variants))
        loads.append(os.getloadavg()[0])
        for name in order:
            gc.collect()
            c0, t0 = time.process_time(), time.perf_counter()
            measured = variants[name]()
            w, c = time.perf_counter() - t0, time.process_time() - c0
            if measured is not None:  # timed by the variant's own process (the JAX worker)
                w, c = measured
            wall[name].append(w)
            cpu[name].append(c)

    steps, n = args.steps, args.members
    out = {"workload": args.workload, "members": n, "rounds": args.rounds, "steps": steps, "load_avg": spread(loads),
           "cores": os.cpu_count(), "started_utc": t_start, "compile_s": bench.compile_s,
           "state_bytes": bench.state_bytes, "step_peak_bytes": bench.peak, "notes": bench.notes, "variants": {}}
    print(f"{bench.title}, {args.rounds} rounds x {steps} population steps from {t_start} UTC; load average "
          f"{median(loads):.1f} (min {min(loads):.1f}, max {max(loads):.1f}) on {os.cpu_count()} cores")
    for note in bench.notes:
        print(note)
    refs = [r for r in ("sequential", "jax") if r in variants]
    head = "".join(f" {'x ' + r + ' (paired wall [min, max])':>36s} {'(CPU)':>7s}" for r in refs)
    print(f"{'variant':18s} {'pop steps/s wall':>17s} {'per CPU s':>10s}{head}")
    for name in variants:
        rate_w = steps / median(wall[name])
        rate_c = steps / median(cpu[name])
        row = {"steps_per_s_wall": rate_w, "steps_per_s_cpu": rate_c, "wall": wall[name], "cpu": cpu[name]}
        cols = ""
        for ref in refs:
            rw = paired_ratios(wall[ref], wall[name])  # > 1: faster than ref
            rc = paired_ratios(cpu[ref], cpu[name])
            row[f"x_{ref}_wall"], row[f"x_{ref}_cpu"] = spread(rw), spread(rc)
            cols += f" {median(rw):20.2f} [{min(rw):.2f}, {max(rw):.2f}]".ljust(37) + f" {median(rc):7.2f}"
        out["variants"][name] = row
        print(f"{name:18s} {rate_w:17.1f} {rate_c:10.1f}{cols}")
    for k, v in bench.compile_s.items():
        print(f"compile, first call: {k}: {v:.1f} s")
    for k, v in bench.state_bytes.items():
        print(f"state bytes: {k}: {v / 1024:.0f} KiB")
    for k, v in bench.peak.items():
        print(f"allocated by a call above the state (ft.memory): {k}: {v / 1024:.0f} KiB")
    if args.out_json:
        with open(args.out_json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
