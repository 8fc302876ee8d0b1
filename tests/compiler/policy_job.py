"""The compile policy in a process of its own, for tests/compiler/test_compile_policy.py.

    python tests/compiler/policy_job.py MODE     (TORCHINDUCTOR_CACHE_DIR and FUNCTRAIN_COMPILE_* set by the test)

Prints ``WORKER <pid>`` as soon as a compile worker has its graph and one line ``RESULT {...}`` at the end. Modes:

* ``run N``: ``ft.run`` of N steps on a runner of its own, the phase of every step recorded; the decision.
* ``fresh N``: the same in a process that has not imported the compiler (as a user's first run): whether the run
  imported it.
* ``until N``: ``ft.run`` of N steps, stopped once the compiled step has taken over (or after 400 s).
* ``precompile``: ``cstep.precompile(state, batch)``, then exits.
* ``precompile-slow``: the same with inductor's C++ compiler ``SLOW_CXX`` (a ``g++`` that waits before it
  compiles), for the test that kills it mid-compile.
* ``exit`` / ``raise`` / ``hold``: ``ft.run`` whose worker compiles a slow (cold) graph; ``exit``: 3 steps then a
  normal exit; ``raise``: an exception out of the loop after the worker is seen; ``hold``: steps on until killed.
"""
from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import functrain as ft  # noqa: E402
from background_job import problem  # noqa: E402


def _setup(imported=True):
    from functrain.compiler import capture

    step, params, buffers, batches, calls = problem()
    if imported:
        capture.preload()  # the compiler imported first: the first call traces (as a long-running job's would)
        capture.wait_for_imports()
    cstep = ft.compile(step)
    return step, cstep, step.init(params, buffers), batches


def announce(runner, said=[False]):  # noqa: B006 - once per process
    p = runner.progress
    if not said[0] and p.worker_pid is not None and p.workers:
        print(f"WORKER {p.worker_pid}", flush=True)
        said[0] = True
        return True
    return False


def run(n: int, until: bool = False, imported: bool = True) -> dict:
    step, cstep, state, batches = _setup(imported)
    runner = cstep.runner(donate=True, background=True)
    seen, pids = [], set()
    deadline = time.monotonic() + 400

    def on_step(i, s, m):
        seen.append(runner.progress.phase)
        if runner.progress.worker_pid is not None:
            pids.add(runner.progress.worker_pid)
        announce(runner)
        return until and (runner.progress.phase == "compiled" or time.monotonic() > deadline)

    ft.run(runner, state, batches * (n // len(batches) + 1), num_steps=n, progress=False, on_step=on_step)
    d = runner.background.decision
    p = runner.progress
    return {"phases": seen, "workers": p.workers, "pids": sorted(pids), "phase": p.phase, "source": p.source,
            "decision": d.record() if d is not None else None, "steps": len(seen),
            "compiler_imported": "torch._inductor.compile_fx" in sys.modules, "dynamo": "torch._dynamo" in sys.modules}


def precompile() -> dict:
    step, cstep, state, batches = _setup()
    seconds = cstep.precompile(state, batches[0])
    return {"seconds": seconds}


def precompile_slow() -> dict:
    import torch._inductor.config as inductor_config

    inductor_config.cpp.cxx = (os.environ["SLOW_CXX"],)  # (a worker is sent the config with the graph)
    return precompile()


def outlive(how: str) -> dict:
    os.environ["FUNCTRAIN_COMPILE_POLICY"] = "always"  # (the compile starts; what matters is its end)
    step, cstep, state, batches = _setup()
    runner = cstep.runner(donate=True, background=True)

    def on_step(i, s, m):
        if announce(runner) and how == "raise":
            raise RuntimeError("the run fails while its worker compiles")
        if how == "hold":
            time.sleep(0.01)  # (a slow step: the test kills this process)
        return False

    n = 3 if how == "exit" else 10**7
    ft.run(runner, state, batches * 2, num_steps=n, progress=False, on_step=on_step)
    announce(runner)
    return {"phase": runner.progress.phase, "worker_pid": runner.progress.worker_pid}


def main() -> None:
    mode = sys.argv[1]
    if mode in ("run", "until", "fresh"):
        result = run(int(sys.argv[2]), until=mode == "until", imported=mode != "fresh")
    elif mode == "precompile":
        result = precompile()
    elif mode == "precompile-slow":
        result = precompile_slow()
    else:
        result = outlive(mode)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
