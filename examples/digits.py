"""Train a small MLP on scikit-learn's bundled 8x8 digits with a compiled functrain step.

    python examples/digits.py              # ~1 minute on a laptop CPU, prints test accuracy
    python examples/digits.py --steps 300 --no-compile
"""
from __future__ import annotations

import argparse
import time

import torch

import functrain as ft


def load(device: torch.device, seed: int = 0):
    from sklearn.datasets import load_digits  # the data ships inside scikit-learn: no download

    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float32) / 16.0
    y = torch.tensor(y, dtype=torch.int64)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    x, y = x[perm], y[perm]
    n_test = len(x) // 5
    return (x[n_test:].to(device), y[n_test:].to(device)), (x[:n_test].to(device), y[:n_test].to(device))


def batches(x: torch.Tensor, y: torch.Tensor, batch_size: int, seed: int):
    """Shuffled fixed-size batches, epoch after epoch (the same order for the same seed)."""
    g = torch.Generator().manual_seed(seed)
    while True:
        perm = torch.randperm(len(x), generator=g).to(x.device)
        for i in range(0, len(x) - batch_size + 1, batch_size):
            idx = perm[i:i + batch_size]
            yield x[idx], y[idx]


def main() -> float:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-compile", action="store_true", help="run the step eagerly")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)

    torch.manual_seed(args.seed)
    (x_train, y_train), (x_test, y_test) = load(device, args.seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Dropout(0.1), torch.nn.Linear(128, 10)).to(device)
    apply_fn, params, buffers = ft.functionalize(model)

    def loss_fn(params, buffers, batch):
        x, y = batch
        logits = apply_fn(params, buffers, x)
        loss = torch.nn.functional.cross_entropy(logits, y)
        return loss, {"accuracy": (logits.argmax(-1) == y).float().mean()}

    schedule = ft.optim.schedules.warmup_cosine(args.lr, warmup_steps=args.steps // 10, total_steps=args.steps)
    step = ft.train_step(loss_fn, ft.optim.adamw(schedule, weight_decay=1e-4))
    step = ft.ema(0.99, warmup=False)(ft.clip(1.0)(step))
    state = step.init(params, buffers, seed=args.seed)
    run_step = step if args.no_compile else ft.compile(step)

    t0 = time.perf_counter()
    state = ft.run(run_step, state, batches(x_train, y_train, args.batch_size, args.seed), num_steps=args.steps,
                   log_every=100, on_log=lambda i, m: print(f"step {i:5d}  loss {m['loss']:.4f}  "
                                                         f"train acc {m['accuracy']:.3f}  lr {m['lr']:.2e}"))
    seconds = time.perf_counter() - t0

    model.eval()
    with torch.no_grad():
        acc = (apply_fn(state.params, state.buffers, x_test).argmax(-1) == y_test).float().mean().item()
        ema_acc = (apply_fn(state.ema, state.buffers, x_test).argmax(-1) == y_test).float().mean().item()
    compiled = "eager" if args.no_compile else f"compiled ({run_step.compiles} graph)"
    print(f"{args.steps} steps, {compiled}, {seconds:.1f} s including compilation")
    print(f"test accuracy {acc:.4f}  (EMA weights {ema_acc:.4f})")
    return acc


if __name__ == "__main__":
    main()
