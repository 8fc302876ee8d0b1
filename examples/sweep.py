"""A learning-rate sweep as one run: 16 digits classifiers (16 learning rates, 16 seeds) trained by one compiled step.

    python examples/sweep.py               # ~1 minute on a laptop CPU: each member's test accuracy, and the best
    python examples/sweep.py --steps 100 --no-compile

``ft.population(16, batch="shared")`` turns the classifier's step (AdamW, clipping, EMA) into one step over 16
members: each member has its own initialisation (its seed), its own learning rate (a value in its optimizer
state: ``ft.set_hyper`` with a tensor of 16), its own moments, clipping norm and EMA, and every member sees the
same batches. The best member comes out as an ordinary state (``ft.member``) that the plain step trains on.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

import functrain as ft

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from digits import batches, load  # noqa: E402 - the digits example's data (scikit-learn's, no download)


def main() -> tuple[int, float]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--members", type=int, default=16)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr-min", type=float, default=1e-4)
    parser.add_argument("--lr-max", type=float, default=1e-1)
    parser.add_argument("--no-compile", action="store_true", help="run the population step eagerly")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)

    (x_train, y_train), (x_test, y_test) = load(device, seed=0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 10)).to(device)
    apply_fn, _, _ = ft.functionalize(model)

    def loss_fn(params, buffers, batch):
        x, y = batch
        logits = apply_fn(params, buffers, x)
        return torch.nn.functional.cross_entropy(logits, y), {"accuracy": (logits.argmax(-1) == y).float().mean()}

    step = ft.ema(0.99, warmup=False)(ft.clip(1.0)(ft.train_step(loss_fn, ft.optim.adamw(1e-3, weight_decay=1e-4))))
    n = args.members
    pop = ft.population(n, batch="shared")(step)
    seeds = list(range(n))
    lrs = torch.logspace(torch.log10(torch.tensor(args.lr_min)), torch.log10(torch.tensor(args.lr_max)), n,
                         dtype=torch.float64)
    state = pop.init(model, seeds=seeds)               # member i: the model re-initialised with seed i
    state = ft.set_hyper(state, lr=lrs)                # member i: learning rate lrs[i]
    run_step = pop if args.no_compile else ft.compile(pop)

    def log(i: int, m: dict) -> None:
        losses = m["loss"]
        print(f"step {i:4d}  loss best {min(losses):.4f}  median {sorted(losses)[len(losses) // 2]:.4f}  "
              f"worst {max(losses):.4f}")

    t0 = time.perf_counter()
    state = ft.run(run_step, state, batches(x_train, y_train, args.batch_size, seed=0), num_steps=args.steps,
                   log_every=100, on_log=log)
    seconds = time.perf_counter() - t0

    with torch.no_grad():  # every member's test accuracy in one batched forward pass
        logits = torch.func.vmap(apply_fn, in_dims=(0, 0, None))(state.params, state.buffers, x_test)
        accuracy = (logits.argmax(-1) == y_test).float().mean(-1).tolist()
    for i in range(n):
        print(f"member {i:2d}  seed {seeds[i]:2d}  lr {lrs[i]:.2e}  test accuracy {accuracy[i]:.4f}")
    best = max(range(n), key=lambda i: accuracy[i])
    what = "eager" if args.no_compile else "compiled"
    print(f"{n} members x {args.steps} steps, one {what} step: {seconds:.1f} s including compilation")
    print(f"best: member {best} (lr {lrs[best]:.2e}), test accuracy {accuracy[best]:.4f}")

    winner = ft.member(state, best)  # an ordinary state of the plain step: train it on, save it, export it
    assert winner.params["0.weight"].shape == model[0].weight.shape
    return best, accuracy[best]


if __name__ == "__main__":
    main()
