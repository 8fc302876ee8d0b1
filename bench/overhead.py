"""Where the time of one functrain step goes: a per-call breakdown of ``ft.compile``'s call path.

    python bench/overhead.py                  # W1, ~1 min (one cold compile, three warm ones)
    python bench/overhead.py --workload W3 --profile

It times, interleaved over rounds (median per call), from the outside in:

* ``ft.compile(step)(state, batch)``, state from ``init(seed=0)`` (the default: RNG carried in the state)
* the same ``CompiledStep`` on a state from ``init(seed=None)`` (``with_rng`` returns at once)
* ``torch.compile(step.apply, fullgraph=True)(state, batch)``: no ``check_inputs``, no ``with_rng``
* the inductor-compiled graph called directly on its flat tensor inputs: no Dynamo frame
  evaluation, guards, pytree flattening or output rebuilding, only AOTAutograd's runtime
  wrapper and the generated kernels
* the same bare call under ``torch.compiler.set_stance(skip_guard_eval_unsafe=True)``
  (guards skipped: what guard evaluation costs)
* a step compiled over the state's *flat* tensor leaves (``fn(*leaves) -> leaves``) with
  ``optree`` flattening and rebuilding the pytrees outside the graph (one way to cut
  Dynamo's per-call pytree work)
* the pieces on their own: ``check_inputs``, ``with_rng`` around a function that does nothing,
  ``optree.tree_leaves(state)``
* for scale: the eager functrain step and the hand-written ``torch_eager`` step, and the
  eager pieces (functrain's ``functional_call`` forward, ``grad_and_value``, foreach AdamW
  update; torch's module forward + backward and ``AdamW.step()``).

``--profile`` adds a cProfile of the eager functrain step and of the compiled call.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import tempfile
import time


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="W1")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--calls", type=int, default=200, help="calls per measurement per round")
    p.add_argument("--profile", action="store_true")
    args = p.parse_args()
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = "1"
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="ft-bench-inductor-"))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, root)

    import optree
    import torch
    from torch._inductor.compile_fx import compile_fx

    import functrain as ft
    from bench import variants, workloads
    from functrain.core.step import check_inputs, with_rng

    torch.set_num_threads(1)
    wl = workloads.build(workloads.WORKLOADS[args.workload.upper()], torch.device("cpu"))
    batch = wl.batches[0]

    step, params, buffers = workloads.functrain_step(wl)
    cstep = ft.compile(step)
    seeded = cstep.init(params, buffers, seed=0)
    unseeded = cstep.init(params, buffers, seed=None)
    t = time.perf_counter()
    cstep(seeded, batch)
    compile_s = time.perf_counter() - t
    cstep(unseeded, batch)

    bare = torch.compile(step.apply, fullgraph=True)
    bare(unseeded, batch)

    captured = {}

    def capture(gm, example_inputs):
        fn = compile_fx(gm, example_inputs)
        captured["fn"], captured["inputs"] = fn, list(example_inputs)
        return fn

    torch.compile(step.apply, fullgraph=True, backend=capture)(unseeded, batch)
    graph_fn, graph_inputs = captured["fn"], captured["inputs"]

    # the step over flat tensor leaves: Dynamo guards a flat list, optree rebuilds the pytrees outside
    # (Dynamo cannot take an optree PyTreeSpec from outside: rebuild from a template of leaf indices)
    n_in = len(optree.tree_leaves((unseeded, batch)))
    template = optree.tree_unflatten(optree.tree_structure((unseeded, batch)), list(range(n_in)))
    out_spec = {}

    # (and Dynamo's optree polyfill cannot flatten a tree with an empty dict, e.g. buffers={}:
    # flatten the output with torch.utils._pytree inside the graph)
    from torch.utils import _pytree as pytree

    def flat_apply(*leaves):
        state, b = optree.tree_map(lambda i: leaves[i], template)
        return pytree.tree_leaves(step.apply(state, b))

    out_spec["spec"] = pytree.tree_structure(step.apply(unseeded, batch))
    flat_compiled = torch.compile(flat_apply, fullgraph=True)

    def flat_call(state, b):
        return pytree.tree_unflatten(flat_compiled(*optree.tree_leaves((state, b))), out_spec["spec"])

    flat_call(unseeded, batch)

    def skip_guards():
        with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
            return bare(unseeded, batch)

    eager_state = step.init(params, buffers, seed=0)
    torch_eager = variants.TorchEager(wl)

    def noop(state, batch):
        return state, {}

    # the eager pieces: functrain's forward/backward and optimizer vs torch's
    loss_fn, opt = step.loss_fn, step.optimizer
    grads, _ = torch.func.grad_and_value(loss_fn)(unseeded.params, unseeded.buffers, batch)
    te = variants.TorchEager(wl)
    te.step(0)
    lossf = workloads.loss_of(wl)

    def torch_fwd_bwd():
        te.model.zero_grad(set_to_none=True)
        lossf(te.model(batch[0]), batch[1]).backward()

    torch_fwd_bwd()

    cases = {
        "ft.compile call, seeded state (default)": lambda: cstep(seeded, batch),
        "ft.compile call, seed=None state": lambda: cstep(unseeded, batch),
        "torch.compile(step.apply) call": lambda: bare(unseeded, batch),
        "inductor graph called directly (no Dynamo)": lambda: graph_fn(*graph_inputs),
        "torch.compile(step.apply), skip_guard_eval_unsafe=True": skip_guards,
        "torch.compile over flat leaves + optree in/out": lambda: flat_call(unseeded, batch),
        "check_inputs(state, batch)": lambda: check_inputs(seeded, batch),
        "with_rng(noop), seeded state": lambda: with_rng(noop, seeded, batch),
        "with_rng(noop), seed=None state": lambda: with_rng(noop, unseeded, batch),
        "optree.tree_leaves(state)": lambda: optree.tree_leaves(seeded),
        "functrain eager step (step(state, batch))": lambda: step(eager_state, batch),
        "functrain eager Step.apply (no with_rng)": lambda: step.apply(unseeded, batch),
        "torch_eager step (hand-written)": lambda: torch_eager.step(0),
        "eager piece: functrain loss_fn forward (functional_call)":
            lambda: loss_fn(unseeded.params, unseeded.buffers, batch),
        "eager piece: torch.func.grad_and_value(loss_fn)":
            lambda: torch.func.grad_and_value(loss_fn)(unseeded.params, unseeded.buffers, batch),
        "eager piece: functrain adamw update (foreach, out of place)":
            lambda: opt.update(grads, unseeded.opt_state, unseeded.params),
        "eager piece: torch forward + backward (module)": torch_fwd_bwd,
        "eager piece: torch.optim.AdamW.step() (for-loop)": te.opt.step,
    }
    for fn in cases.values():  # warm every path
        for _ in range(5):
            fn()
    times: dict[str, list[float]] = {k: [] for k in cases}
    for r in range(args.rounds):
        for name, fn in cases.items():
            n = args.calls if "eager" not in name else max(10, args.calls // 5)
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            times[name].append((time.perf_counter() - t0) / n)
    print(f"workload {args.workload}: {wl.describe}; torch {torch.__version__}, 1 thread; "
          f"first compiled call {compile_s:.1f} s; {args.rounds} rounds; state has "
          f"{len(optree.tree_leaves(seeded))} leaves, the graph {len(graph_inputs)} tensor inputs\n")
    print("| what | µs per call, median [min–max over rounds] |")
    print("|---|---|")
    for name, ts in times.items():
        print(f"| {name} | {statistics.median(ts) * 1e6:.1f} [{min(ts) * 1e6:.1f}–{max(ts) * 1e6:.1f}] |")
    med = {k: statistics.median(v) * 1e6 for k, v in times.items()}
    low = {k: min(v) * 1e6 for k, v in times.items()}
    ks = list(cases)

    def diff(a: int, b: int) -> str:
        return f"{med[ks[a]] - med[ks[b]]:.1f} µs (medians), {low[ks[a]] - low[ks[b]]:.1f} µs (minima)"

    print(f"\nft.compile's own cost per call (seeded − bare torch.compile): {diff(0, 2)}")
    print(f"  of which RNG handling (seeded − seed=None): {diff(0, 1)}")
    print(f"Dynamo frame + guards + pytree in/out (bare torch.compile − direct graph call): {diff(2, 3)}")
    print(f"  of which guard evaluation (bare − bare with skip_guard_eval_unsafe): {diff(2, 4)}")

    if args.profile:
        for title, fn, n in (("functrain eager step", lambda: step(eager_state, batch), 300),
                             ("ft.compile call, seeded", lambda: cstep(seeded, batch), 2000)):
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(n):
                fn()
            prof.disable()
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(18)
            print(f"\n### cProfile: {title}, {n} calls, by own time\n")
            print("```\n" + "\n".join(buf.getvalue().splitlines()[4:]) + "\n```")
    return 0


if __name__ == "__main__":
    sys.exit(main())
