"""denoising-diffusion-pytorch's ``GaussianDiffusion(Unet(...))`` trained with ``ft.Trainer``, from the package's names.

The package (``pip install denoising-diffusion-pytorch``; not a functrain dependency) trains with its own
``Trainer(diffusion, folder, train_batch_size=..., ...)``. The same run with functrain is the same names in a
``ft.TrainConfig`` and the same folder::

    config = ft.TrainConfig(train_batch_size=32, gradient_accumulate_every=2, train_lr=1e-4, train_num_steps=200,
                            ema_update_every=10, ema_decay=0.995, adam_betas=(0.9, 0.99), max_grad_norm=1.0,
                            split_batches=True)   # the package's train_batch_size is global
    trainer = ft.Trainer(diffusion, "digits/train", config, sample_fn=...)
    trainer.train()              # the diffusion module now holds the trained params
    trainer.ema_module()         # ... and this copy the EMA's (the package's trainer.ema.ema_model)

The data: scikit-learn's 1797 bundled 8x8 digits (no download), written once as 16x16 PNGs into
``--data`` (``train/`` for training, 197 held out), read back as the package reads a folder (resize,
center crop, horizontal flips, here inside the compiled step). At the end it prints the held-out loss of the
params and of the EMA: the diffusion loss of every held-out image at fixed timesteps and noise.

    python examples/ddpm.py --steps 200                        # Unet(self_condition=True), compiled
    python examples/ddpm.py --steps 200 --no-self-condition    # the Unet of bench/ddpm_reference.json

Self-conditioning is on, as many of the package's users train it: ``p_losses`` flips ``random() < 0.5`` from Python's
generator, which functrain seeds from the state's key at each step, eagerly and compiled (one compiled graph per side
of the coin, picked at each call from the key: docs/randomness.md). The run is reproducible and resumes exactly.
    python -m functrain.launch --nproc 2 examples/ddpm.py --steps 200   # the same updates, half a batch per rank
"""
from __future__ import annotations

import argparse
import os
import random
import time

import numpy as np
import torch

import functrain as ft

IMAGE_SIZE = 16
HELD_OUT = 197


def digits_folder(root: str, size: int = IMAGE_SIZE, held_out: int = HELD_OUT) -> tuple[str, torch.Tensor]:
    """Write the digits as ``size``x``size`` grey PNGs under ``root/train`` and ``root/held_out`` (once; a ``.done``
    file marks a complete folder) and return the training folder and the held-out images as ``(N, 1, size, size)``
    floats in [0, 1], read back from their PNGs (which are already ``size``x``size``: nothing to resize)."""
    from PIL import Image
    from sklearn.datasets import load_digits  # ships with scikit-learn: no download

    train, test = os.path.join(root, "train"), os.path.join(root, "held_out")
    if not os.path.exists(os.path.join(root, ".done")):
        images = (load_digits().images * (255.0 / 16.0)).round().astype(np.uint8)
        order = np.random.default_rng(0).permutation(len(images))
        for folder, index in ((test, order[:held_out]), (train, order[held_out:])):
            os.makedirs(folder, exist_ok=True)
            for i in index:
                Image.fromarray(images[i]).resize((size, size), Image.BILINEAR).save(os.path.join(folder, f"{i:04d}.png"))
        open(os.path.join(root, ".done"), "w").close()
    names = sorted(os.listdir(test))
    held = np.stack([np.array(Image.open(os.path.join(test, n)).convert("L")) for n in names])
    return train, torch.from_numpy(held).float().div_(255.0).unsqueeze(1)


def diffusion_model(dim: int = 16, self_condition: bool = False, seed: int = 0,
                    dim_mults: tuple = (1, 2, 4)) -> torch.nn.Module:
    """The package's ``GaussianDiffusion(Unet(...))`` for 16x16 grey images (its default objective and schedule)."""
    from denoising_diffusion_pytorch import GaussianDiffusion, Unet

    torch.manual_seed(seed)
    unet = Unet(dim=dim, dim_mults=dim_mults, channels=1, self_condition=self_condition)
    return GaussianDiffusion(unet, image_size=IMAGE_SIZE, timesteps=1000, sampling_timesteps=50)


@torch.no_grad()
def held_out_loss(diffusion: torch.nn.Module, images: torch.Tensor, draws: int = 4, seed: int = 0) -> float:
    """The mean diffusion loss of ``images`` at ``draws`` fixed (timestep, noise) pairs per image (and Python's coin
    seeded, for self-conditioning): the same number for the same weights, whoever trained them."""
    gen = torch.Generator().manual_seed(seed)
    state = random.getstate()
    random.seed(seed)
    was = diffusion.training
    diffusion.eval()
    device = next(diffusion.parameters()).device
    try:
        total = 0.0
        for _ in range(draws):
            t = torch.randint(0, diffusion.num_timesteps, (len(images),), generator=gen)
            noise = torch.randn(images.shape, generator=gen)
            total += float(diffusion(images.to(device), times=t.to(device), noise=noise.to(device)))
        return total / draws
    finally:
        diffusion.train(was)
        random.setstate(state)


def config_for(steps: int, results: str, **changes) -> ft.TrainConfig:
    """The issue's run in the package's names: batch 32 x 2, lr 1e-4, EMA 0.995 every 10, clip 1.0."""
    base = dict(train_batch_size=32, gradient_accumulate_every=2, train_lr=1e-4, train_num_steps=steps,
                ema_update_every=10, ema_decay=0.995, adam_betas=(0.9, 0.99), max_grad_norm=1.0,
                save_and_sample_every=max(steps, 1), num_samples=16, results_folder=results, split_batches=True,
                log_every=max(1, min(50, steps)))
    return ft.TrainConfig(**{**base, **changes})


def train(steps: int, results: str, data: str, *, dim: int = 16, self_condition: bool = False,
          dim_mults: tuple = (1, 2, 4), **changes):
    """Train with ``ft.Trainer``; return ``(trainer, diffusion, held-out images)``."""
    folder, held = digits_folder(data)
    diffusion = diffusion_model(dim, self_condition, dim_mults=dim_mults)
    config = config_for(steps, results, **changes)

    def sample_fn(ema_params: dict, n: int) -> torch.Tensor:  # from a copy holding the EMA: the model stays as is
        return trainer.ema_module(ema_params).sample(batch_size=n)

    trainer = ft.Trainer(diffusion, folder, config, sample_fn=sample_fn)
    trainer.train()
    return trainer, diffusion, held


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--results", default="results/ddpm")
    parser.add_argument("--data", default="results/ddpm-digits", help="where the digits are written as PNGs")
    parser.add_argument("--dim", type=int, default=16, help="the Unet's base width")
    parser.add_argument("--no-self-condition", dest="self_condition", action="store_false",
                        help="Unet(self_condition=False) (default: on; p_losses then flips a Python coin, drawn from "
                        "the state's key, compiled or not)")
    parser.add_argument("--precision", default="no", choices=["no", "bf16", "fp16"])
    parser.add_argument("--no-compile", action="store_true")
    args = parser.parse_args()
    start = time.perf_counter()
    trainer, diffusion, held = train(args.steps, args.results, args.data, dim=args.dim,
                                     self_condition=args.self_condition, compile=not args.no_compile,
                                     mixed_precision=args.precision)
    if trainer.rank == 0:
        params, ema = held_out_loss(diffusion, held), held_out_loss(trainer.ema_module(), held)
        print(f"held-out loss after {args.steps} updates: params {params:.4f}, EMA {ema:.4f} "
              f"({time.perf_counter() - start:.1f} s)", flush=True)


if __name__ == "__main__":
    main()
