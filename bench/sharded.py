"""State bytes, peak RSS and step time per rank on 2 ranks: replicated vs sharded functrain, DDP and FSDP2.

    python bench/sharded.py                          # ~100M params (24 x Linear(2048, 2048)), 2 gloo ranks
    python bench/sharded.py --width 1024 --depth 8   # smaller
    python bench/sharded.py --variants params,fsdp2 --out-json /tmp/sharded.json

Workload: an MLP of ``--depth`` Linear(width, width) layers with ReLU, MSE, AdamW(lr 1e-4, weight decay 0.01)
and an EMA of the params (decay 0.999), float32, batch ``--batch`` rows per rank, CPU, gloo, one thread per rank.
Each variant runs in its own 2-process job (``ft.launch``), so that its memory high-water mark is its own;
``MALLOC_MMAP_THRESHOLD_`` is fixed at 1 MiB in the workers so freed tensors go back to the OS and RSS follows
live memory. Variants:

* ``replicated``: ``ft.compile(ft.data_parallel()(ft.ema(d, warmup=False)(step)))``
* ``optimizer`` / ``params``: the same with ``ft.data_parallel(shard="optimizer" | "params")``
* ``blocks``: ``ft.data_parallel(shard="params", blocks=model)``, each block gathered when it runs (marked with
  ``ft.remat(model, "everything_saveable")``, or ``--remat POLICY``)

In the functrain variants the module's own parameters are emptied once the params are copied out of it
(``ft.functionalize``'s function, and ``blocks=``, keep the module alive: its whole parameters would stay in
memory otherwise, as they did in the runs before 2026-12-04 13:00).
* ``ddp``: ``DistributedDataParallel`` + ``torch.optim.AdamW(foreach=True)`` + an EMA by ``torch._foreach_lerp_``
* ``fsdp2``: ``fully_shard`` on every block and the model (a CPU device mesh) + the same AdamW and EMA on the
  sharded parameters

``--estimate`` adds, for the functrain variants, ``ft.memory``'s step peak (before the first step) and the
allocator's peak of one step counted by torch.profiler (``functrain.compiler.estimate.allocated_peak``).

``--remat POLICY`` marks every block of the functrain variants with ``ft.remat``. A Linear + ReLU block saves
nothing but its input anyway, so remat shows with ``--ffn`` blocks (width -> 4 width -> width) and a large
``--batch``, where activations inside the blocks dominate the step's peak.

Reported per variant (rank 0; ranks are symmetric): ``state_bytes`` (params + optimizer moments + EMA held at
rest by this rank), its ratio to ``replicated``, RSS at rest after init, the peak RSS of the init (VmHWM from the start
of the init on, absolute: what the process held at most while initialising) and ``init_delta``, the init's own high-water mark above the RSS before
it (functrain: ``step.init``, the params already made; DDP/FSDP2: the wrapping or ``fully_shard`` plus the first
step, since torch's AdamW makes its moments there), and
of the timed steps (VmHWM reset after the warm-up steps, so the compiler's memory is not counted), and the median step time over ``--steps`` timed steps after
``--warmup`` untimed ones (the first compiles), the slower rank's, between barriers.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import functrain as ft  # noqa: E402

VARIANTS = ("replicated", "optimizer", "params", "blocks", "ddp", "fsdp2")
LR, WD, DECAY = 1e-4, 0.01, 0.999


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return -1


def _reset_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
    except OSError:
        pass


def _model(width: int, depth: int, ffn: bool = False) -> torch.nn.Module:
    """``depth`` blocks ``Linear(width, width)`` + ReLU (the last without), or with ``ffn`` transformer-style
    feed-forward blocks ``Linear(width, 4 width)`` + GELU + ``Linear(4 width, width)``: FSDP2 shards each block,
    and ``--remat`` marks each block."""
    torch.manual_seed(0)
    if ffn:
        return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                                                         torch.nn.Linear(4 * width, width)) for _ in range(depth)])
    blocks = [torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU()) for _ in range(depth - 1)]
    return torch.nn.Sequential(*blocks, torch.nn.Sequential(torch.nn.Linear(width, width)))


def _nbytes(tensors) -> int:
    total = 0
    for t in tensors:
        if hasattr(t, "to_local"):
            t = t.to_local()
        total += t.numel() * t.element_size()
    return total


def _worker(variant: str, width: int, depth: int, batch: int, warmup: int, steps: int, remat: str = "none",
            ffn: bool = False, estimate: bool = False) -> dict:
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(1 + rank)
    data = [(torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g)) for _ in range(4)]
    out: dict = {"variant": variant if remat == "none" else f"{variant}+remat"}
    model = _model(width, depth, ffn)
    out["num_params"] = sum(p.numel() for p in model.parameters())

    if variant in ("replicated", "optimizer", "params", "blocks"):
        if remat != "none" or variant == "blocks":
            ft.remat(model, remat if remat != "none" else "everything_saveable")  # each block: a unit
        apply_fn, params, buffers = ft.functionalize(model)
        params = {k: v.detach().clone() for k, v in params.items()}  # own storage
        # apply_fn (and blocks=) keep the module; its own tensors are not needed once the params are copied
        for p_ in model.parameters():
            p_.data = torch.empty(0)
        blocks = model
        del model
        gc.collect()

        def loss_fn(p, b, xy):
            return torch.nn.functional.mse_loss(apply_fn(p, b, xy[0]), xy[1])

        base = ft.ema(DECAY, warmup=False)(ft.train_step(loss_fn, ft.optim.adamw(LR, weight_decay=WD)))
        shard = {"replicated": "none", "blocks": "params"}.get(variant, variant)
        step = ft.data_parallel(shard=shard, blocks=blocks if variant == "blocks" else None)(base)
        gc.collect()
        rest = _status("VmRSS")
        _reset_peak()
        state = step.init(params, buffers)
        out["init_delta"] = _status("VmHWM") - rest  # step.init alone: the params exist already
        del params
        gc.collect()
        out["state_bytes"] = _nbytes(ft.tree.tree_leaves(state.params)) + _nbytes(
            [x for x in ft.tree.tree_leaves(state.opt_state) if x.dim() > 0]) + _nbytes(
            ft.tree.tree_leaves(state.ema))
        cstep = ft.compile(step, donate=True)
        if estimate:  # ft.memory's step peak, before the first step (that call compiles the capture it traces)
            out["estimate"] = ft.memory(cstep, state, data[0], donate=True).step_peak

        def run(i):
            nonlocal state
            state, _ = cstep(state, data[i % len(data)])
    else:
        gc.collect()
        rest = _status("VmRSS")
        _reset_peak()
        if variant == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            net = DistributedDataParallel(model)
            params = list(model.parameters())
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (world,))
            for block in model:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
            net = model
            params = list(model.parameters())
        opt = torch.optim.AdamW(params, lr=LR, weight_decay=WD, foreach=True)
        with torch.no_grad():
            ema = [p.detach().clone() for p in params]

        def run(i):
            x, y = data[i % len(data)]
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.mse_loss(net(x), y).backward()
            opt.step()
            with torch.no_grad():
                torch._foreach_lerp_(ema, [p.detach() for p in params], 1.0 - DECAY)

        run(0)  # the moments exist after the first step
        out["init_delta"] = _status("VmHWM") - rest  # wrapping/sharding + the first step (which makes the moments)
        out["state_bytes"] = _nbytes(params) + _nbytes(
            [v for s in opt.state.values() for k, v in s.items() if k != "step"]) + _nbytes(ema)
    gc.collect()
    out["rss_at_rest"] = _status("VmRSS")
    out["peak_rss_init"] = _status("VmHWM")
    for i in range(warmup):
        if i == 0:
            t0 = time.perf_counter()
        run(i)
        if i == 0:
            out["first_step_s"] = time.perf_counter() - t0
    gc.collect()
    _reset_peak()  # the peak of the steps, not of the compiler's own memory in the first one
    times = []
    for i in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        run(i)
        dist.barrier()
        times.append(time.perf_counter() - t0)
    out["peak_rss_steps"] = _status("VmHWM")
    out["step_s"] = statistics.median(times)
    if estimate and "estimate" in out:  # the allocator's own count of one more step's peak, to check it against
        from functrain.compiler.estimate import allocated_peak

        out["alloc_peak"], _ = allocated_peak(run, steps)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--depth", type=int, default=24)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--timeout", type=float, default=1200)
    p.add_argument("--remat", default="none", help="functrain variants: ft.remat(model, POLICY) on every block "
                   "(e.g. nothing_saveable); none by default")
    p.add_argument("--ffn", action="store_true", help="transformer-style feed-forward blocks (width -> 4 width -> "
                   "width, GELU) instead of Linear + ReLU: activations inside each block, which remat recomputes")
    p.add_argument("--estimate", action="store_true", help="functrain variants: ft.memory's step peak (before the "
                   "first step) and the allocator's peak of one step (torch.profiler), per rank")
    p.add_argument("--out-json")
    args = p.parse_args(argv)
    if args.remat != "none" and set(args.variants.split(",")) - {"replicated", "optimizer", "params", "blocks"}:
        p.error("--remat applies to the functrain variants (replicated, optimizer, params, blocks) only")
    env = {"OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
    results = []
    for variant in args.variants.split(","):
        if variant not in VARIANTS:
            raise SystemExit(f"unknown variant {variant!r}; choose from {VARIANTS}")
        try:
            reports = ft.launch(_worker, nprocs=2, timeout=args.timeout, env=env,
                                args=(variant, args.width, args.depth, args.batch, args.warmup, args.steps,
                                      args.remat, args.ffn, args.estimate))
            r = dict(reports[0])
            r["step_s"] = max(x["step_s"] for x in reports)  # barriers make them equal; take the slower
            r["peak_rss_steps_max_rank"] = max(x["peak_rss_steps"] for x in reports)
        except Exception as e:  # noqa: BLE001 - a variant that cannot run here is reported, not hidden
            r = {"variant": variant, "error": f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:300]}"}
        results.append(r)
        print(json.dumps(r), flush=True)
    base = next((r for r in results if r["variant"].startswith("replicated") and "error" not in r), None)
    mib = 1 << 20
    print(f"\n{'variant':<17} {'state MiB':>9} {'x repl':>7} {'RSS rest':>9} {'peak init':>9} {'init +':>7} "
          f"{'peak step':>9} {'s/step':>7} {'x repl':>7}")
    for r in results:
        if "error" in r:
            print(f"{r['variant']:<17} did not run: {r['error']}")
            continue
        ratio = r["state_bytes"] / base["state_bytes"] if base else float("nan")
        tratio = r["step_s"] / base["step_s"] if base else float("nan")
        print(f"{r['variant']:<17} {r['state_bytes'] / mib:9.0f} {ratio:7.3f} {r['rss_at_rest'] / mib:9.0f} "
              f"{r['peak_rss_init'] / mib:9.0f} {r['init_delta'] / mib:7.0f} {r['peak_rss_steps'] / mib:9.0f} {r['step_s']:7.3f} {tratio:7.2f}")
    for r in results:
        if "alloc_peak" in r:
            print(f"{r['variant']:<17} ft.memory step peak {r['estimate'] / mib:7.0f} MiB, allocator's peak "
                  f"{r['alloc_peak'] / mib:7.0f} MiB: {r['estimate'] / r['alloc_peak']:.2f}x")
    if results:
        print(f"(params: {results[0].get('num_params', 0) / 1e6:.1f} M; MiB per rank; rank 0)")
    if args.out_json:
        with open(args.out_json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
