"""denoising-diffusion-pytorch's own Trainer vs ft.Trainer on the same data and hyper-parameters.

    python bench/ddpm.py                          # every implementation, one process each, then the table
    python bench/ddpm.py --impl package --steps 200 --json /tmp/pkg.json     # one run
    PYTHONPATH=/path/to/old/functrain python bench/ddpm.py --impls ft-compiled,ft-eager   # "before" numbers

Needs the package (``pip install denoising-diffusion-pytorch``: it pulls torchvision, so a torch that matches
it) and scikit-learn. The run is examples/ddpm.py's: 16x16 digits (1600 training PNGs, 197 held out),
``Unet(dim=16, dim_mults=(1, 2, 4), channels=1)``, ``GaussianDiffusion(timesteps=1000)``, batch 32 x 2
accumulated, lr 1e-4, Adam(0.9, 0.99), clip 1.0, EMA 0.995 every 10, horizontal flips, for ``--steps`` updates.

Implementations (each in its own process, ``torch.set_num_threads(--threads)``):

* ``package``: the package's ``Trainer(diffusion, folder, ...)`` (accelerate, ema-pytorch's EMA, its DataLoader
  with ``cpu_count()`` workers), ``calculate_fid=False``, no sampling during the run;
* ``ft-eager`` / ``ft-compiled`` / ``ft-compiled-bf16``: ``ft.Trainer(diffusion, folder, config)`` with the same
  names (``compile=False`` / ``True`` / ``mixed_precision="bf16"``). With a functrain that has no
  ``ImageFolder`` (an older one, for "before" numbers) the dataset is the package's own ``Dataset`` and the
  config keeps only the fields that functrain knows.

Reported per run: the seconds to the end of the first update (includes compiling), the median seconds per
update after it (update-end timestamps: ema-pytorch's ``update`` for the package, ``on_log`` at every step
for functrain), and the held-out loss (examples/ddpm.py's ``held_out_loss``: fixed timesteps and noise) of
the params and of the EMA. Timings on a shared machine are noisy: say the load.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IMPLS = ("package", "ft-eager", "ft-compiled", "ft-compiled-bf16")


def _example():
    spec = importlib.util.spec_from_file_location("ddpm_example", os.path.join(ROOT, "examples", "ddpm.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_package(ex, steps: int, folder: str, held, results: str, seed: int) -> dict:
    import torch
    from denoising_diffusion_pytorch import Trainer

    diffusion = ex.diffusion_model(16, seed=seed)
    trainer = Trainer(diffusion, folder, train_batch_size=32, gradient_accumulate_every=2, train_lr=1e-4,
                      train_num_steps=steps, ema_update_every=10, ema_decay=0.995, adam_betas=(0.9, 0.99),
                      save_and_sample_every=10**9, num_samples=16, results_folder=results, amp=False,
                      calculate_fid=False, max_grad_norm=1.0)
    stamps = []
    update = trainer.ema.update

    def timed_update():
        update()
        stamps.append(time.perf_counter())

    trainer.ema.update = timed_update
    t0 = time.perf_counter()
    trainer.train()
    return {"t0": t0, "stamps": stamps, "params": ex.held_out_loss(trainer.model, held),
            "ema": ex.held_out_loss(trainer.ema.ema_model, held), "torch": torch.__version__}


def run_functrain(ex, impl: str, steps: int, folder: str, held, results: str, seed: int) -> dict:
    import torch
    import functrain as ft

    diffusion = ex.diffusion_model(16, seed=seed)
    names = {f.name for f in dataclasses.fields(ft.TrainConfig)}
    wanted = dict(train_batch_size=32, gradient_accumulate_every=2, train_lr=1e-4, train_num_steps=steps,
                  ema_update_every=10, ema_decay=0.995, adam_betas=(0.9, 0.99), max_grad_norm=1.0,
                  save_and_sample_every=10**9, num_samples=16, results_folder=results, log_every=1, trackers=(),
                  compile=impl != "ft-eager", mixed_precision="bf16" if impl.endswith("bf16") else "no",
                  split_batches=True)
    config = ft.TrainConfig(**{k: v for k, v in wanted.items() if k in names})
    data = folder
    if not hasattr(ft, "data") or not hasattr(ft.data, "ImageFolder"):  # an older functrain: the package's Dataset
        from denoising_diffusion_pytorch.denoising_diffusion_pytorch import Dataset
        data = Dataset(folder, 16, augment_horizontal_flip=True, convert_image_to="L")
    stamps = []
    trainer = ft.Trainer(diffusion, data, config, on_log=lambda step, m: stamps.append(time.perf_counter()))
    t0 = time.perf_counter()
    state = trainer.train()
    ema_model = ex.diffusion_model(16, seed=seed)
    ft.to_module(ema_model, state.ema)
    params_model = ex.diffusion_model(16, seed=seed)  # (an older Trainer leaves the module untrained)
    ft.to_module(params_model, state.params)
    return {"t0": t0, "stamps": stamps, "params": ex.held_out_loss(params_model, held),
            "ema": ex.held_out_loss(ema_model, held), "torch": torch.__version__,
            "functrain": os.path.dirname(os.path.dirname(os.path.abspath(ft.__file__)))}


def one(impl: str, steps: int, threads: int, seed: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    ex = _example()
    folder, held = ex.digits_folder(os.path.join(tempfile.gettempdir(), "functrain-ddpm-digits"))
    with tempfile.TemporaryDirectory() as results:
        if impl == "package":
            out = run_package(ex, steps, folder, held, results, seed)
        else:
            out = run_functrain(ex, impl, steps, folder, held, os.path.join(results, "run"), seed)
    stamps = out.pop("stamps")
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return {"impl": impl, "steps": steps, "first_s": stamps[0] - out.pop("t0"),
            "per_update_s": statistics.median(gaps) if gaps else None, **out}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impl", choices=IMPLS, help="one run, in this process")
    p.add_argument("--impls", default=",".join(IMPLS), help="the runs of the table (each in a subprocess)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the result(s) here")
    p.add_argument("--timeout", type=float, default=3600)
    a = p.parse_args()
    if a.impl:
        result = one(a.impl, a.steps, a.threads, a.seed)
        text = json.dumps(result)
        if a.json:
            with open(a.json, "w") as f:
                f.write(text)
        print(text, flush=True)
        return
    rows = []
    for impl in a.impls.split(","):
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            env = dict(os.environ, OMP_NUM_THREADS=str(a.threads))
            subprocess.run([sys.executable, __file__, "--impl", impl, "--steps", str(a.steps), "--threads",
                            str(a.threads), "--seed", str(a.seed), "--json", f.name], check=True, env=env,
                           timeout=a.timeout)
            rows.append(json.load(open(f.name)))
    print(f"| run | first update (s) | s / update | held-out loss, params | held-out loss, EMA |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['impl']} | {r['first_s']:.1f} | {r['per_update_s']:.3f} | {r['params']:.4f} | {r['ema']:.4f} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
