"""A population of 16 W1 MLPs trained by one compiled step, against 16 compiled runs and a hand-written vmap.

    python bench/population.py                       # 16 members, 12 interleaved rounds (~3-5 min on 2 cores)
    python bench/population.py --rounds 4 --steps 10 # smoke
    python bench/population.py --members 64

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

Reported: population steps per second (wall and process CPU: the machine is shared), paired ratios against
``sequential`` per round, compile time of each compiled variant, the state's bytes, and the load average.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--members", type=int, default=16)
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--steps", type=int, default=40, help="population steps per variant per round")
    p.add_argument("--variants", default="population,sequential,hand_loop,hand_stacked,population_eager")
    p.add_argument("--backend", default="inductor")
    p.add_argument("--out-json", default=None)
    p.add_argument("--inductor-cache", default="fresh",
                   help="TORCHINDUCTOR_CACHE_DIR: 'fresh' (default: an empty temp folder, cold compile times), "
                        "'default' (leave it), or a folder")
    args = p.parse_args()
    if args.inductor_cache != "default":
        import tempfile
        folder = tempfile.mkdtemp(prefix="h39-inductor-") if args.inductor_cache == "fresh" else args.inductor_cache
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = folder

    import torch
    torch.set_num_threads(1)
    import functrain as ft
    from functrain.bench.stats import median, paired_ratios, spread

    n, dims, batch, lr, wd = args.members, (32, 64, 64, 1), 32, 1e-3, 0.01

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

    def nbytes(tree) -> int:
        return sum(x.numel() * x.element_size() for x in ft.tree.tree_leaves(tree) if torch.is_tensor(x))

    variants: dict = {}
    compile_s: dict = {}
    state_bytes: dict = {}
    peak: dict = {}  # ft.memory: the state, and what one call allocates above it (traced, not run)
    wanted = args.variants.split(",")

    if "population" in wanted or "population_eager" in wanted:
        pstate = pop.init(lambda s: ft.functionalize(model(s))[1], seeds=seeds)
        state_bytes["population"] = nbytes(pstate)
        est = ft.memory(pop, pstate, data[0])
        peak["population (one call)"] = est.step_peak + est.new_state
    if "population" in wanted:
        cpop = ft.compile(pop, backend=args.backend) if args.backend != "inductor" else ft.compile(pop)
        t0 = time.perf_counter()
        box = {"s": cpop(pstate, data[0])[0]}
        compile_s["population"] = time.perf_counter() - t0

        def run_population() -> None:
            s = box["s"]
            for b in data:
                s, m = cpop(s, b)
            box["s"] = s
        variants["population"] = run_population
    if "population_eager" in wanted:
        ebox = {"s": pstate}

        def run_population_eager() -> None:
            s = ebox["s"]
            for b in data:
                s, m = pop(s, b)
            ebox["s"] = s
        variants["population_eager"] = run_population_eager
    if "sequential" in wanted:
        cstep = ft.compile(step, backend=args.backend) if args.backend != "inductor" else ft.compile(step)
        states = [step.init(ft.functionalize(model(s))[1], seed=None) for s in seeds]
        state_bytes["sequential"] = sum(nbytes(s) for s in states)
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

    for fn in variants.values():  # warm-up round, untimed
        fn()
    wall: dict = {k: [] for k in variants}
    cpu: dict = {k: [] for k in variants}
    loads = []
    for r in range(args.rounds):
        order = list(variants) if r % 2 == 0 else list(reversed(variants))
        loads.append(os.getloadavg()[0])
        for name in order:
            gc.collect()
            c0, t0 = time.process_time(), time.perf_counter()
            variants[name]()
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)

    steps = args.steps
    out = {"members": n, "rounds": args.rounds, "steps": steps, "load_avg": spread(loads), "cores": os.cpu_count(),
           "compile_s": compile_s, "state_bytes": state_bytes, "step_peak_bytes": peak, "variants": {}}
    print(f"{n} W1 MLPs, {args.rounds} rounds x {steps} population steps; load average "
          f"{median(loads):.1f} (min {min(loads):.1f}, max {max(loads):.1f}) on {os.cpu_count()} cores")
    print(f"{'variant':18s} {'pop steps/s wall':>17s} {'per CPU s':>10s} {'x sequential (paired, wall)':>28s} "
          f"{'(CPU)':>8s}")
    for name in variants:
        rate_w = steps / median(wall[name])
        rate_c = steps / median(cpu[name])
        row = {"steps_per_s_wall": rate_w, "steps_per_s_cpu": rate_c, "wall": wall[name], "cpu": cpu[name]}
        ratio = ""
        if "sequential" in variants:
            rw = paired_ratios(wall["sequential"], wall[name])  # > 1: faster than sequential
            rc = paired_ratios(cpu["sequential"], cpu[name])
            row["x_sequential_wall"], row["x_sequential_cpu"] = spread(rw), spread(rc)
            ratio = f"{median(rw):8.2f} [{min(rw):.2f}, {max(rw):.2f}]      {median(rc):8.2f}"
        out["variants"][name] = row
        print(f"{name:18s} {rate_w:17.1f} {rate_c:10.1f} {ratio}")
    for k, v in compile_s.items():
        print(f"compile, first call: {k}: {v:.1f} s")
    for k, v in state_bytes.items():
        print(f"state bytes: {k}: {v / 1024:.0f} KiB")
    for k, v in peak.items():
        print(f"allocated by a call above the state (ft.memory): {k}: {v / 1024:.0f} KiB")
    if args.out_json:
        with open(args.out_json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
