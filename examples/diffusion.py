"""A tiny denoising diffusion model (DDPM) on scikit-learn's 8x8 digits, trained with ``ft.Trainer``.

The main job of the README: on 2 processes for a short warmup + cosine
schedule it writes, under ``results/diffusion/``, checkpoints, EMA sample grids
captioned with their step, ``metrics.jsonl`` and ``metrics.png`` (loss, eval
losses of the params and of the EMA on a held-out split, grad norm, lr), and at
the end ``model.safetensors`` / ``ema.safetensors`` and a summary; running it
again resumes from the newest checkpoint.

    python -m functrain.launch --nproc 2 examples/diffusion.py --steps 400
    python examples/diffusion.py --steps 400            # one process
    python -m functrain.launch --nproc 2 examples/diffusion.py --shard optimizer   # sharded state (ZeRO-2)
    python examples/diffusion.py --precompile           # compile the step ahead into the caches, and exit
"""
from __future__ import annotations

import argparse
import math
import os

import torch

import functrain as ft

T_STEPS = 100


def schedule(device: torch.device | str = "cpu") -> dict:
    """The DDPM noise schedule (linear betas) as tensors."""
    betas = torch.linspace(1e-4, 0.05, T_STEPS, device=device)
    alphas = 1.0 - betas
    bar = torch.cumprod(alphas, 0)
    return {"betas": betas, "alphas": alphas, "bar": bar}


class Denoiser(torch.nn.Module):
    """Predicts the noise in a noisy 8x8 image from the image and the timestep (an MLP with a time embedding)."""

    def __init__(self, width: int = 256):
        super().__init__()
        self.time = torch.nn.Sequential(torch.nn.Linear(32, width), torch.nn.SiLU())
        self.inp = torch.nn.Linear(64, width)
        self.body = torch.nn.Sequential(torch.nn.SiLU(), torch.nn.Linear(width, width), torch.nn.SiLU(),
                                        torch.nn.Dropout(0.05), torch.nn.Linear(width, width), torch.nn.SiLU(),
                                        torch.nn.Linear(width, 64))

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        freqs = torch.exp(-math.log(1000.0) * torch.arange(16, device=x.device) / 16)
        angles = t.float()[:, None] * freqs[None]
        emb = torch.cat([angles.sin(), angles.cos()], dim=1)
        return self.body(self.inp(x.flatten(1)) + self.time(emb)).view_as(x)


class Diffusion(torch.nn.Module):
    """``forward(images) -> loss``: what ``ft.Trainer`` trains when given a module."""

    def __init__(self):
        super().__init__()
        self.net = Denoiser()
        for k, v in schedule().items():
            self.register_buffer(k, v, persistent=False)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x0 = images * 2.0 - 1.0  # [0, 1] -> [-1, 1]
        t = torch.randint(0, T_STEPS, (x0.shape[0],), device=x0.device)
        noise = torch.randn_like(x0)
        a = self.bar[t].view(-1, 1, 1, 1)
        xt = a.sqrt() * x0 + (1 - a).sqrt() * noise
        return torch.nn.functional.mse_loss(self.net(xt, t), noise)

    @torch.no_grad()
    def sample(self, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
        device = self.bar.device
        x = torch.randn(n, 1, 8, 8, generator=generator, device=device)
        for i in reversed(range(T_STEPS)):
            t = torch.full((n,), i, device=device)
            eps = self.net(x, t)
            alpha, bar, beta = self.alphas[i], self.bar[i], self.betas[i]
            x = (x - beta / (1 - bar).sqrt() * eps) / alpha.sqrt()
            if i:
                x = x + beta.sqrt() * torch.randn(x.shape, generator=generator, device=device)
        return ((x + 1) / 2).clamp(0, 1)


def digits_images():
    """scikit-learn's 8x8 digits (``load_digits().images``, 1797 x 8 x 8, float64), read from the file scikit-learn
    ships (no download) with numpy: importing scikit-learn takes about a second, longer than the rest of this
    example's start-up after torch; ``load_digits`` where that file is not found."""
    import importlib.util

    import numpy as np

    spec = importlib.util.find_spec("sklearn")  # (finds the package without importing it)
    folder = next(iter(spec.submodule_search_locations or ()), None) if spec is not None else None
    path = os.path.join(folder, "datasets", "data", "digits.csv.gz") if folder else None
    if path is None or not os.path.isfile(path):
        from sklearn.datasets import load_digits

        return load_digits().images
    return np.loadtxt(path, delimiter=",")[:, :-1].reshape(-1, 8, 8)  # (the last column: the label)


def digits_dataset(held_out: int = 197) -> tuple[torch.utils.data.TensorDataset, torch.utils.data.TensorDataset]:
    """The 1797 digits as (train, held-out) splits, the held-out ones fixed by a seeded permutation."""
    images = torch.tensor(digits_images(), dtype=torch.float32).unsqueeze(1) / 16.0
    order = torch.randperm(len(images), generator=torch.Generator().manual_seed(0))
    train, test = order[held_out:], order[:held_out]
    return torch.utils.data.TensorDataset(images[train]), torch.utils.data.TensorDataset(images[test])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--results", default="results/diffusion")
    parser.add_argument("--save-every", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--precision", default="no", choices=["no", "bf16", "fp16"])
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--compile-blocking", action="store_true",
                        help="compile before the first step (TrainConfig.compile_background=False) instead of "
                             "training eagerly while the step compiles in the background")
    parser.add_argument("--shard", default="none", choices=["none", "optimizer", "params"],
                        help="TrainConfig.shard: split the optimizer state and EMA (optimizer), and the params "
                             "too (params), over the processes")
    parser.add_argument("--precompile", action="store_true",
                        help="compile the training step ahead into the compile caches and exit (a later run "
                             "starts compiled); on one process or with the same --nproc as the run")
    args = parser.parse_args()

    config = ft.TrainConfig(
        train_batch_size=args.batch_size, gradient_accumulate_every=1, train_lr=1e-3,
        train_num_steps=args.steps, adam_betas=(0.9, 0.99), max_grad_norm=1.0, ema_update_every=1,
        ema_decay=0.99, save_and_sample_every=args.save_every, num_samples=25, mixed_precision=args.precision,
        results_folder=args.results, seed=0, log_every=20, compile=not args.no_compile, compile_package=True,
        compile_background=not args.compile_blocking,
        lr_schedule="warmup_cosine", warmup_steps=min(50, args.steps // 10), min_lr=1e-4,
        eval_every=0, eval_batch_size=32,  # evaluate at every save, on the held-out split
        shard=args.shard)
    model = Diffusion()

    def sample_fn(ema_params: dict, n: int) -> torch.Tensor:
        ft.to_module(model, ema_params)  # the module is only a skeleton here: training state lives in the trainer
        return model.sample(n, generator=torch.Generator(device=model.bar.device).manual_seed(0))

    if not args.precompile and (hint := finished(args.results, args.steps)) is not None:
        if os.environ.get("RANK", "0") == "0":
            print(hint, flush=True)
        return
    train, held_out = digits_dataset()
    trainer = ft.Trainer(model, train, config, sample_fn=sample_fn, eval_dataset=held_out)
    if args.precompile:
        trainer.precompile()
        return
    trainer.train()


def finished(results: str, steps: int) -> str | None:
    """This script's words for a job already at ``--steps`` (the Trainer's own name the config field,
    ``train_num_steps``, which this script sets from ``--steps``); ``None`` if there is training left."""
    done = ft.CheckpointManager(os.path.join(results, "checkpoints")).steps() \
        if os.path.isdir(os.path.join(results, "checkpoints")) else []
    if not done or done[-1] < steps:
        return None
    return (f"{os.path.abspath(results)} is at step {done[-1]} of --steps {steps}: nothing to train. To train on, run "
            f"again with a larger --steps (e.g. --steps {2 * done[-1]}): it resumes at step {done[-1]}, and the lr "
            f"schedule (warm-up, then cosine over --steps) is recomputed over the new length, so the lr goes back up "
            f"near its peak and decays again (the resume line gives both numbers)")


if __name__ == "__main__":
    main()
