"""denoising-diffusion-pytorch's own ``Trainer`` line through ft.Trainer, with the real package (skipped where it is
not installed: it needs torchvision, see .ci/run's second venv): every argument of its ``Trainer`` is honoured or
refused by name with why; its line trains and writes the sample grids the package writes (from the EMA), with
checkpoints that are never pickles; save_best_and_latest_only keeps the best and the newest."""
from __future__ import annotations

import importlib.util
import inspect
import os

import pytest
import torch

import functrain as ft

pytest.importorskip("denoising_diffusion_pytorch")
pytest.importorskip("sklearn")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def ex():
    spec = importlib.util.spec_from_file_location("ddpm_example", os.path.join(ROOT, "examples", "ddpm.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def digits(tmp_path_factory, ex):
    return ex.digits_folder(str(tmp_path_factory.mktemp("digits")))


def _package_defaults():
    from denoising_diffusion_pytorch import Trainer

    params = inspect.signature(Trainer.__init__).parameters
    return {k: p.default for k, p in params.items() if k not in ("self", "diffusion_model", "folder")}


def test_every_argument_of_the_packages_trainer_is_honoured_or_refused_by_name(ex, digits, tmp_path):
    """All of the package's Trainer arguments at its defaults: refused only for calculate_fid=True (its default), naming
    why; with calculate_fid=False the config is TrainConfig's defaults with the package's split_batches=True, and the
    folder is read as the package reads it (flipped; augment_horizontal_flip=False: not)."""
    folder, _ = digits
    given = {**_package_defaults(), "results_folder": str(tmp_path)}
    with pytest.raises(ValueError,
                       match=r"cannot honour calculate_fid=True.*download at run time.*calculate_fid=False"):
        ft.Trainer(ex.diffusion_model(), folder, **given)
    trainer = ft.Trainer(ex.diffusion_model(), folder, **{**given, "calculate_fid": False})
    assert trainer.config == ft.TrainConfig(results_folder=str(tmp_path), split_batches=True)
    assert "random_flip" in repr(trainer.step)
    plain = ft.Trainer(ex.diffusion_model(), folder, **{**given, "calculate_fid": False,
                                                         "augment_horizontal_flip": False})
    assert "random_flip" not in repr(plain.step)
    with pytest.raises(ValueError, match=r"keep_best='eval_loss_ema'.*no eval_dataset="):
        ft.Trainer(ex.diffusion_model(), folder, **{**given, "calculate_fid": False, "save_best_and_latest_only": True})


def test_the_packages_line_trains_and_writes_its_sample_grids(ex, digits, tmp_path, capfd):
    """ft.Trainer(diffusion, folder, **the package's keywords) trains (eager, 4 updates) and, with no sample_fn,
    samples the EMA model at each save as the package does: sample-2.png, sample-4.png; the checkpoints are folders
    (no model-*.pt pickle); the module is trained; run again, it says it is done and trains nothing."""
    from denoising_diffusion_pytorch import GaussianDiffusion, Unet

    folder, _ = digits
    torch.manual_seed(0)  # small, and 2 DDIM sampling steps: a grid in a second on a loaded CPU
    diffusion = GaussianDiffusion(Unet(dim=8, dim_mults=(1, 2), channels=1), image_size=ex.IMAGE_SIZE, timesteps=1000,
                                  sampling_timesteps=2)
    before = {k: v.clone() for k, v in diffusion.state_dict().items()}
    results = str(tmp_path / "results")
    line = dict(train_batch_size=16, train_lr=8e-5, train_num_steps=4, gradient_accumulate_every=1, ema_decay=0.995,
                amp=False, calculate_fid=False, results_folder=results, save_and_sample_every=2, num_samples=1,
                compile=False)
    trainer = ft.Trainer(diffusion, folder, **line)
    state = trainer.train()
    assert int(state.step) == 4
    files = sorted(os.listdir(results))
    assert {"sample-2.png", "sample-4.png", "model.safetensors", "ema.safetensors", "checkpoints"} <= set(files), files
    assert not [f for f in files if f.endswith(".pt")]
    with open(os.path.join(results, "sample-4.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert any(not torch.equal(v, before[k]) for k, v in diffusion.state_dict().items())
    capfd.readouterr()
    again = ft.Trainer(diffusion, folder, **line)
    again.train()
    assert "already at step 4 of 4: nothing to train" in capfd.readouterr().out
    assert again.run_step is again.step  # (eager: compile=False) and it was never called: no sample grid redrawn
    assert sorted(os.listdir(results)) == files
