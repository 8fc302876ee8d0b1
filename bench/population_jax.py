"""The JAX + optax anchor of bench/population.py: the same 16 W1 MLPs trained by ``jax.jit(jax.vmap(step))``.

Runs under a JAX venv's Python (jax, jaxlib, optax, numpy; no torch). bench/population.py starts it as a worker
(``--jax-python /work/venv-jax/bin/python``), after writing the population's initial weights, per-member
hyper-parameters and batches to an .npz, so both sides train the same numbers; it then drives it round by round,
interleaved with its own variants. Standalone, for a look:

    /work/venv-jax/bin/python bench/population_jax.py --npz pop.npz --rounds 3

The step: one member's W1 step (MLP as ``x @ W.T + b`` per layer in torch's layout, ReLU between, MSE mean,
``optax.inject_hyperparams(optax.adamw)`` with torch.optim.AdamW's betas/eps), ``jax.vmap``-ed over the leading
member axis of the state and of the batch (each member its own batches), compiled whole by ``jax.jit`` with the
state donated. The learning rate and weight decay are data: ``inject_hyperparams`` keeps them in the optimizer
state, and the population's holds them with the member axis (shape ``(n,)``), as functrain's population does.

Timing: the batches are put on the device once (as the torch side's are tensors made before timing); a run is
``steps`` calls, then ``jax.block_until_ready`` of the state; wall and this process's CPU seconds are reported.
The first call (trace + XLA compile + run) is timed on its own as the compile time. float32 throughout.

Protocol (worker mode, ``--serve``): one JSON object a line on stdout (everything else goes to stderr); commands
one JSON object a line on stdin: ``{"op": "run"}`` -> ``{"event": "result", "wall": s, "cpu": s, "loss": [n]}``
(the last step's per-member losses), ``{"op": "exit"}``. At start-up: ``{"event": "ready", "compile_s": s,
"first_loss": [n], "version": ..., "affinity": [...]}`` where ``first_loss`` is the first call's per-member loss.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--npz", required=True, help="bench/population.py's export: params, hypers, batches")
    ap.add_argument("--serve", action="store_true", help="worker mode: JSON commands on stdin, results on stdout")
    ap.add_argument("--rounds", type=int, default=3, help="standalone mode: timed runs")
    ap.add_argument("--pin-cpu", type=int, default=None,
                    help="restrict this process to one CPU before importing jax (XLA sizes its thread pool from "
                         "the affinity mask; the shared harness's JAX worker does the same); -1: no pinning")
    args = ap.parse_args()
    if args.pin_cpu is not None and args.pin_cpu >= 0:
        os.sched_setaffinity(0, {args.pin_cpu})
    out = sys.stdout
    sys.stdout = sys.stderr  # the protocol owns stdout: stray prints (jax's, numpy's) go to stderr

    def send(**msg) -> None:
        out.write(json.dumps(msg) + "\n")
        out.flush()

    import jax
    import jax.numpy as jnp
    import jaxlib
    import numpy as np
    import optax

    with np.load(args.npz) as z:
        d = {k: z[k] for k in z.files}
    names = [str(s) for s in d["param_names"]]
    n_layers = len(names) // 2
    n = int(d["lr"].shape[0])

    def apply(params, x):
        for i in range(n_layers):
            x = x @ params[f"{2 * i}.weight"].T + params[f"{2 * i}.bias"]
            if i < n_layers - 1:
                x = jax.nn.relu(x)
        return x

    def loss_fn(params, x, y):
        return jnp.mean((apply(params, x) - y) ** 2)

    b1, b2 = (float(v) for v in d["betas"])
    tx = optax.inject_hyperparams(optax.adamw)(learning_rate=1e-3, b1=b1, b2=b2, eps=float(d["eps"]),
                                               weight_decay=0.0)

    def member_step(state, x, y):  # one member's step: what vmap batches over the member axis
        loss, grads = jax.value_and_grad(loss_fn)(state["params"], x, y)
        updates, opt = tx.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, loss

    step = jax.jit(jax.vmap(member_step), donate_argnums=0)

    params = {k: jnp.asarray(d[f"param.{k}"]) for k in names}
    opt = jax.vmap(tx.init)(params)  # the hyper-parameters come out with the member axis: (n,) each
    hp = dict(opt.hyperparams)
    hp["learning_rate"] = jnp.asarray(d["lr"], jnp.float32)  # per member, as data
    hp["weight_decay"] = jnp.asarray(d["weight_decay"], jnp.float32)
    opt = opt._replace(hyperparams=hp)
    state = {"params": params, "opt": opt}
    X = jnp.asarray(d["X"])  # (steps, n, batch, in): on the device before timing, like the torch side's tensors
    Y = jnp.asarray(d["Y"])
    steps = int(X.shape[0])
    jax.block_until_ready((state, X, Y))

    t = time.perf_counter()
    state, loss = step(state, X[0], Y[0])
    jax.block_until_ready(state)
    compile_s = time.perf_counter() - t
    xs = [(X[j], Y[j]) for j in range(steps)]  # slicing outside the timed loop
    ready = dict(event="ready", compile_s=compile_s, first_loss=np.asarray(loss).tolist(), members=n, steps=steps,
                 version=f"jax {jax.__version__}, jaxlib {jaxlib.__version__}, optax {optax.__version__}",
                 affinity=sorted(os.sched_getaffinity(0)), cache_entries=step._cache_size(),
                 lr_shape=list(state["opt"].hyperparams["learning_rate"].shape))

    def run() -> dict:
        nonlocal state
        c0, t0 = time.process_time(), time.perf_counter()
        s, loss = state, None
        for x, y in xs:
            s, loss = step(s, x, y)
        jax.block_until_ready(s)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        state = s
        return dict(event="result", wall=wall, cpu=cpu, loss=np.asarray(loss).tolist(),
                    cache_entries=step._cache_size())

    if not args.serve:
        print(json.dumps(ready))
        for _ in range(args.rounds):
            r = run()
            print(f"{steps / r['wall']:.1f} population steps/s wall, {steps / r['cpu']:.1f} per CPU s")
        return 0
    send(**ready)
    for line in sys.stdin:
        if not line.strip():
            continue
        op = json.loads(line)["op"]
        if op == "exit":
            break
        if op != "run":
            send(event="error", message=f"unknown op {op!r}: 'run' or 'exit'")
            return 2
        send(**run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
