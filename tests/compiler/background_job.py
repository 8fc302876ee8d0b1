"""A background-compiled step in its own process, for tests/compiler/test_background.py.

    python tests/compiler/background_job.py MODE     (TORCHINDUCTOR_CACHE_DIR set by the test)

Prints one JSON line ``RESULT {...}`` at the end (and ``WORKER <pid>`` as soon as a compile
worker runs, for the tests that kill things). Modes:

* ``swap``: step until the compiled code takes over, then 20 more calls; counts the Python calls
  of the loss function (the compiled code makes none) and compares every state with the eager
  step's on the same batches (bitwise while eager, to 1e-5 after the switch).
* ``hold``: steps eagerly for ever (the test SIGKILLs this process while its worker compiles).
* ``follow``: as local rank 1 while another process compiles the same step: says ``FOLLOWING`` after its
  first call (it found the graph's lock held and started no worker), then steps until its code is compiled.
* ``hang``: with ``HANG_CXX`` set (in any mode: inductor's C++ compiler is then a script that sleeps in a
  worker), the worker hangs in it (bounded by ``FUNCTRAIN_COMPILE_TIMEOUT``, which the test sets low): eager
  steps go on, one warning.
* ``held``: this process holds the graph's compile lock, as another process compiling it would: this one
  follows that compile instead of starting a worker, and gives up at ``FUNCTRAIN_COMPILE_TIMEOUT``.
* ``fail``: inductor's C++ compiler is ``/bin/false`` (a broken toolchain): the worker fails.
* ``die``: the worker is SIGKILLed while it compiles.
* ``short``: ``ft.run`` of 3 steps, which end long before a cold compile: the run ends normally while its
  worker compiles (the test then watches the worker finish after this process has exited).
* ``again``: the same step by ``ft.run`` again, 40 steps: where its code came from and when it took over.
* ``corrupt``: ``switch_at`` far ahead; once the compiled code is ready, every cache entry it
  wrote is truncated; the switch must not load them (rebuilt here, with a warning).
"""
from __future__ import annotations

import fcntl
import json
import os
import signal
import sys
import time
import warnings

import torch

import functrain as ft
from functrain import tree as T

DEADLINE = 400.0  # seconds a mode may wait for the compiled code (a loaded 2-core machine, cold caches)


def problem():
    if os.environ.get("HANG_CXX"):  # what a worker is sent: its C++ compiler never returns (see the test)
        import torch._inductor.config as inductor_config
        inductor_config.cpp.cxx = (os.environ["HANG_CXX"],)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Dropout(0.1), torch.nn.Linear(16, 1))
    apply_fn, params, buffers = ft.functionalize(model)
    calls = [0]

    def loss_fn(p, b, batch):
        calls[0] += 1  # Python runs only eagerly (and once while tracing): the compiled code never calls it
        x, y = batch
        return torch.nn.functional.mse_loss(apply_fn(p, b, x), y)

    step = ft.train_step(loss_fn, ft.optim.adamw(1e-2))
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)) for _ in range(8)]
    return step, params, buffers, batches, calls


def announce(progress, said=[False]):  # noqa: B006 - once per process
    # a worker that has the graph (and this process holds the graph's lock for it)
    if not said[0] and progress.worker_pid is not None and progress.workers:
        print(f"WORKER {progress.worker_pid}", flush=True)
        said[0] = True


def swap() -> dict:
    step, params, buffers, batches, calls = problem()
    cstep = ft.compile(step, background=True)
    state = ref = step.init(params, buffers)
    t = time.perf_counter()
    state, _ = cstep(state, batches[0])
    first_s = time.perf_counter() - t
    p = cstep.progress
    out = {"first_call_s": first_s, "phase_after_first": p.phase, "worker_pid": p.worker_pid,
           "worker_alive_after_first": p.worker_pid is not None and _alive(p.worker_pid)}
    ref, _ = step(ref, batches[0])
    eager_equal = T.tree_equal(state, ref)
    i, t0 = 1, time.perf_counter()
    while p.phase != "compiled" and time.perf_counter() - t0 < DEADLINE:
        b = batches[i % 8]
        state, _ = cstep(state, b)
        ref, _ = step(ref, b)
        i += 1
        if p.phase != "compiled":
            eager_equal = eager_equal and T.tree_equal(state, ref)
    out.update(switch_call=i, eager_calls=p.eager_calls, compile_s=p.compile_s, phase=p.phase,
               eager_equal_bitwise=eager_equal, source=p.source)
    before = calls[0]
    for j in range(20):
        b = batches[(i + j) % 8]
        state, _ = cstep(state, b)
        ref, _ = step(ref, b)
    out["loss_calls_after_swap"] = calls[0] - before - 20  # the reference's 20 eager calls taken out
    out["compiles"] = cstep.compiles
    out["max_diff"] = max(float((a - b).abs().max()) for a, b in zip(T.tree_leaves(state.params),
                                                                       T.tree_leaves(ref.params)))
    out["close"] = T.tree_allclose(state, ref, rtol=1e-5, atol=1e-6)
    out["worker_gone"] = out["worker_pid"] is None or not _alive(out["worker_pid"])
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


def eager_until(cstep, step, state, ref, batches, until, limit=DEADLINE) -> tuple:
    """Call until ``until(progress)`` (bounded), checking the eager calls against ``step``; (state, ref, calls)."""
    p, i, t0 = cstep.progress, 0, time.perf_counter()
    while not until(p) and time.perf_counter() - t0 < limit:
        b = batches[i % 8]
        state, _ = cstep(state, b)
        ref, _ = step(ref, b)
        announce(p)
        i += 1
    return state, ref, i


def fault(mode: str) -> dict:
    step, params, buffers, batches, calls = problem()
    held = None
    if mode == "held":
        held = hold_the_lock(step, params, buffers, batches[0])
    if mode == "fail":
        import torch._inductor.config as inductor_config
        inductor_config.cpp.cxx = ("/bin/false",)  # what the worker is sent: its compiler fails
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cstep = ft.compile(step, background=True)
        state = ref = step.init(params, buffers)
        p = cstep.progress
        if mode == "die":
            state, ref, n = eager_until(cstep, step, state, ref, batches, lambda p: p.worker_pid is not None)
            time.sleep(2.0)  # it has imported torch and is compiling (or about to)
            os.kill(p.worker_pid, signal.SIGKILL)
        worker = p.worker_pid
        state, ref, n = eager_until(cstep, step, state, ref, batches, lambda p: p.phase in ("failed", "compiled"))
        equal = T.tree_equal(state, ref)
        for b in batches:  # eager for good now: no second warning
            state, _ = cstep(state, b)
            ref, _ = step(ref, b)
    ours = [str(w.message) for w in caught if "background compile" in str(w.message)]
    worker = worker or p.worker_pid
    return {"phase": p.phase, "reason": p.reason, "warnings": ours, "eager_equal_bitwise": equal and
            T.tree_equal(state, ref), "worker_gone": worker is None or not _alive(worker), "held": held is not None,
            "workers": p.workers}


def hold_the_lock(step, params, buffers, batch):
    """Take the per-graph compile lock of this step's graph (as another process compiling it would)."""
    from functrain.compiler import cache, graph_lock
    from functrain.compiler.backend import fake_inputs
    from functrain.compiler.capture import trace

    state = step.init(params, buffers)
    cap = trace(step.apply, state._replace(rng=None), batch, "fresh")
    key = graph_lock.graph_key(cap.gm, fake_inputs(cap.metas))
    folder = cache.check_private_folder(os.path.join(cache.inductor_dir(), "functrain-locks"))
    fd = os.open(os.path.join(folder, key + ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def corrupt() -> dict:
    step, params, buffers, batches, calls = problem()
    far = 10**9
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cstep = ft.compile(step, switch_at=far)
        state = ref = step.init(params, buffers)
        state, ref, n = eager_until(cstep, step, state, ref, batches, lambda p: p.phase == "ready")
        ready = cstep.progress.phase == "ready"
        damaged = 0
        root = os.environ["TORCHINDUCTOR_CACHE_DIR"]
        for sub in ("fxgraph", "aotautograd"):
            for folder, _, files in os.walk(os.path.join(root, sub)):
                for name in files:
                    path = os.path.join(folder, name)
                    with open(path, "r+b") as f:
                        f.truncate(max(os.path.getsize(path) // 3, 1))
                    damaged += 1
        # the switch comes at once: a state whose step count is past switch_at (its counter set, as a resume)
        state = state._replace(step=torch.tensor(far, dtype=torch.int64))
        ref = ref._replace(step=torch.tensor(far, dtype=torch.int64))
        for b in batches:
            state, _ = cstep(state, b)
            ref, _ = step(ref, b)
    ours = [str(w.message) for w in caught if "ft.compile" in str(w.message)]
    return {"ready": ready, "damaged": damaged, "phase": cstep.progress.phase, "warnings": ours,
            "compiles": cstep.compiles, "close": T.tree_allclose(state, ref, rtol=1e-5, atol=1e-6)}


def short() -> dict:
    from functrain.compiler import capture

    step, params, buffers, batches, calls = problem()
    capture.preload()  # the compiler's modules imported first, so the first call's trace is not put off
    capture.wait_for_imports()
    cstep = ft.compile(step)
    state = step.init(params, buffers)
    runner = cstep.runner(donate=True, background=True)  # what ft.run makes; given, ft.run runs it
    ft.run(runner, state, batches, num_steps=3, progress=False)
    p = runner.progress
    return {"phase": p.phase, "worker_pid": p.worker_pid, "eager_calls": p.eager_calls}


def again() -> dict:
    from functrain.compiler import capture

    step, params, buffers, batches, calls = problem()
    capture.preload()
    capture.wait_for_imports()
    cstep = ft.compile(step)
    state = step.init(params, buffers)
    runner = cstep.runner(donate=True, background=True)
    seen = []
    ft.run(runner, state, batches * 5, progress=False, on_step=lambda i, s, m: seen.append(runner.progress.phase))
    p = runner.progress
    first = seen.index("compiled") + 1 if "compiled" in seen else None
    root = os.environ["TORCHINDUCTOR_CACHE_DIR"]
    return {"phase": p.phase, "source": p.source, "compiled_from_step": first, "compiles": cstep.compiles,
            "reason": p.reason, "worker_pid": p.worker_pid,
            "cache": sorted(d for d in os.listdir(root) if d in ("fxgraph", "aotautograd"))}


def follow() -> dict:
    """Run as a rank other than local rank 0 (``LOCAL_RANK=1``) while another process compiles the same step."""
    from functrain.compiler import capture

    step, params, buffers, batches, calls = problem()
    capture.preload()
    capture.wait_for_imports()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cstep = ft.compile(step, background=True)
        state = step.init(params, buffers)
        state, _ = cstep(state, batches[0])  # traced here: it found the graph's lock held, or not
        p = cstep.progress
        print("FOLLOWING" if p.workers == 0 else "LEADING", flush=True)
        i, t0 = 1, time.perf_counter()
        while p.phase not in ("compiled", "failed") and time.perf_counter() - t0 < DEADLINE:
            state, _ = cstep(state, batches[i % 8])
            i += 1
            time.sleep(0.01)
    return {"phase": p.phase, "source": p.source, "workers": p.workers, "compiles": cstep.compiles,
            "warnings": [str(w.message) for w in caught if "ft.compile" in str(w.message)]}


def hold() -> dict:
    step, params, buffers, batches, calls = problem()
    cstep = ft.compile(step, background=True)
    state = step.init(params, buffers)
    i = 0
    while True:  # until SIGKILLed
        state, _ = cstep(state, batches[i % 8])
        announce(cstep.progress)
        i += 1


def main() -> None:
    mode = sys.argv[1]
    if mode == "swap":
        out = swap()
    elif mode == "corrupt":
        out = corrupt()
    elif mode == "hold":
        out = hold()
    elif mode == "follow":
        out = follow()
    elif mode in ("short", "again"):
        out = short() if mode == "short" else again()
    else:
        out = fault(mode)
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
