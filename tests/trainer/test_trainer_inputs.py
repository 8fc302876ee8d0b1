"""What ft.Trainer is given, as a denoising-diffusion-pytorch user gives it: a folder of images (or a string that
is not one), the batch size (per process, or global with split_batches), a module that is trained afterwards (and
its EMA as a module), the same config on every rank (2 processes, ft.launch with a timeout)."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import functrain as ft
import functrain.testing as ftt
from functrain import tree as T

pytest.importorskip("safetensors")


class Denoise(torch.nn.Module):
    """A diffusion-like module: forward(images) -> loss, with image_size and channels as GaussianDiffusion has."""

    def __init__(self, size=6, channels=1, noise=True):
        super().__init__()
        self.image_size, self.channels, self.noise = (size, size), channels, noise
        self.net = torch.nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, img):
        noise = torch.randn_like(img) if self.noise else img.flip(-1)  # (noise=False: a deterministic loss)
        return torch.nn.functional.mse_loss(self.net(img + noise), noise)


def _folder(path, n=24, size=6, seed=0):
    from PIL import Image

    rng = np.random.default_rng(seed)
    path.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        Image.fromarray(rng.integers(0, 256, (size, size + 2), dtype=np.uint8)).save(path / f"{i:03d}.png")
    return path


def _config(folder, **kw):
    base = dict(train_batch_size=4, train_num_steps=6, save_and_sample_every=6, results_folder=str(folder),
                compile=False, log_every=2, ema_update_every=1, ema_decay=0.9, ema_update_after_step=2,
                trackers=(), train_lr=1e-2)
    return ft.TrainConfig(**{**base, **kw})


# --------------------------------------------------------------------------------------- a folder of images
def test_a_folder_trains_as_the_packages_trainer_reads_it(tmp_path):
    """A path is an ImageFolder of the model's image_size (L for 1 channel) with flips in the step: it trains, and
    the loader gives (4, 1, 6, 6) batches of the folder's center-cropped images."""
    pytest.importorskip("PIL")
    images = _folder(tmp_path / "images")
    torch.manual_seed(0)
    model = Denoise()
    trainer = ft.Trainer(model, str(images), _config(tmp_path / "run"))
    data = trainer.loader.source.dataset if hasattr(trainer.loader, "source") else None
    assert "random_flip" in [t.name for t in trainer.step.transforms]
    batch = next(iter(trainer.loader))
    assert tuple(batch.shape) == (4, 1, 6, 6) and float(batch.min()) >= 0 and float(batch.max()) <= 1
    before = T.tree_map(torch.clone, dict(model.named_parameters()))
    state = trainer.train()
    assert int(state.step) == 6 and not T.tree_equal(state.params, before)
    assert data is None or isinstance(data, ft.data.ImageFolder)
    rgb = ft.Trainer(Denoise(channels=3), images, _config(tmp_path / "rgb"))  # a PathLike; 3 channels: RGB
    assert tuple(next(iter(rgb.loader)).shape) == (4, 3, 6, 6)


def test_a_string_that_is_not_a_folder_of_images_is_refused_when_the_trainer_is_built(tmp_path):
    accepted = r"The dataset may be a map-style dataset \(len and getitem\), an iterable dataset, a torch DataLoader"
    with pytest.raises(ValueError, match=rf"Trainer\(dataset='.*nowhere'\): a path is read as a folder of images, "
                                         rf"and this one is not there. {accepted}"):
        ft.Trainer(Denoise(), str(tmp_path / "nowhere"), _config(tmp_path / "run"))
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(ValueError, match="and this one is a file"):
        ft.Trainer(Denoise(), str(tmp_path / "file.txt"), _config(tmp_path / "run"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"it has no .jpg, .jpeg, .png, .tiff files"):
        ft.Trainer(Denoise(), str(tmp_path / "empty"), _config(tmp_path / "run"))
    pytest.importorskip("PIL")
    plain = torch.nn.Linear(2, 1)  # no image_size: the trainer cannot know how to read the folder
    with pytest.raises(ValueError, match=r"the model has no image_size.*pass ft.data.ImageFolder\('.*images', image"):
        ft.Trainer(plain, str(_folder(tmp_path / "images")), _config(tmp_path / "run"))
    assert not os.path.exists(tmp_path / "run")


def test_the_datasets_flip_and_a_ready_step_or_a_second_flip(tmp_path):
    pytest.importorskip("PIL")
    data = ft.data.ImageFolder(_folder(tmp_path / "images"), 6)
    model = Denoise()
    apply_fn, params, buffers = ft.functionalize(model)
    step = ft.train_step(lambda p, b, x: apply_fn(p, b, x), ft.optim.sgd(0.1))
    with pytest.raises(ValueError, match=r"the dataset augments inside the step \(random_flip\(p=0.5, dim=-1\)\).*"
                                         r"Trainer\(step=...\) uses its step as is"):
        ft.Trainer(model, data, _config(tmp_path / "run"), step=step)
    with pytest.raises(ValueError, match=r"has random_flip\(p=1, dim=-1\) and the dataset adds"):
        ft.Trainer(model, data, _config(tmp_path / "run"), transforms=[ft.random_flip(1.0)])
    no_flip = ft.data.ImageFolder(tmp_path / "images", 6, augment_horizontal_flip=False)
    assert "random_flip" not in [t.name for t in ft.Trainer(model, no_flip, _config(tmp_path / "r")).step.transforms]


# --------------------------------------------------------------------------------------- the module afterwards
def _data(n=32):
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(torch.rand(n, 1, 6, 6, generator=g))


def test_the_module_is_trained_in_place_and_ema_module_holds_the_ema(tmp_path):
    """After train() the module's own Parameter objects hold the final params (references the user kept see them);
    ema_module() is a separate copy (eval mode, no grad) holding state.ema; the module itself is not touched by it."""
    torch.manual_seed(0)
    model = Denoise()
    weight = model.net.weight  # a reference kept by the user
    initial = weight.detach().clone()
    trainer = ft.Trainer(model, _data(), _config(tmp_path))
    with pytest.raises(ValueError, match=r"no EMA yet: call train\(\) first"):
        trainer.ema_module()
    state = trainer.train()
    assert model.net.weight is weight and not torch.equal(weight, initial)
    assert torch.equal(trainer.initial_state().params["net.weight"], initial)  # the start is still the start
    assert T.tree_equal({k: v.detach() for k, v in model.named_parameters()}, state.params)
    ema = trainer.ema_module()
    assert ema is not model and not ema.training and not any(p.requires_grad for p in ema.parameters())
    assert T.tree_equal({k: v for k, v in ema.named_parameters()}, state.ema)
    assert not T.tree_equal(state.ema, state.params)  # (the EMA blended after 2 copies: it differs)
    assert T.tree_equal({k: v.detach() for k, v in model.named_parameters()}, state.params)  # still the params
    given = T.tree_map(torch.zeros_like, state.ema)
    assert float(trainer.ema_module(given).net.weight.abs().sum()) == 0.0  # what a sample_fn passes
    assert trainer.ema_module() is trainer.ema_module()  # one copy, refilled
    with pytest.raises(TypeError, match="needs a Trainer built from an nn.Module"):
        ft.Trainer(lambda p, b, x: (p["w"] * x[0]).sum(), _data(), _config(tmp_path / "fn"),
                   params={"w": torch.ones(6)}).ema_module()


def test_a_sample_fn_can_sample_from_the_ema_module_without_touching_the_model(tmp_path):
    torch.manual_seed(0)
    model = Denoise()
    seen = []

    def sample_fn(ema_params, n):
        m = trainer.ema_module(ema_params)
        seen.append(m.net.weight.detach().clone())
        return torch.rand(n, 1, 6, 6)

    trainer = ft.Trainer(model, _data(), _config(tmp_path, num_samples=4, save_and_sample_every=3), sample_fn=sample_fn)
    state = trainer.train()
    assert len(seen) == 2 and torch.equal(seen[-1], state.ema["net.weight"])
    assert torch.equal(model.net.weight.detach(), state.params["net.weight"])  # the params, not the last EMA


# --------------------------------------------------------------------------------------- batch size, 2 processes
def _two_process_worker(folder):
    """On each of 2 ranks: (1) a config whose results folder and seed differ per rank, (2) a global batch that does
    not divide by the processes, (3) split_batches=True training. Returns the two messages and the final params."""
    import torch.distributed as dist

    rank = dist.get_rank()
    out = {}
    try:
        ft.Trainer(Denoise(), _data(), _config(os.path.join(folder, f"tmp-rank{rank}"), seed=rank))
    except ValueError as e:
        out["disagree"] = str(e)
    try:
        ft.Trainer(Denoise(), _data(), _config(os.path.join(folder, "odd"), split_batches=True, train_batch_size=5,
                                               gradient_accumulate_every=2))
    except ValueError as e:
        out["indivisible"] = str(e)
    torch.manual_seed(0)
    config = _config(os.path.join(folder, "split"), split_batches=True, train_batch_size=8,
                     gradient_accumulate_every=2, compile=False)
    trainer = ft.Trainer(Denoise(noise=False), _data(), config)
    out["rows"] = tuple(next(iter(trainer.loader))[0].shape)
    out["params"] = {k: v.numpy().copy() for k, v in trainer.train().params.items()}  # (tensors would go by fd)
    return out


def test_on_two_processes_the_config_must_agree_and_split_batches_is_global(tmp_path):
    """Ranks with different results folders and seeds fail together, naming both fields and the ranks; with
    split_batches=True a train_batch_size that does not divide by 2 is refused with the numbers, and one that does
    trains each rank on half of it: the same params as one process with the whole batch (ft.shard's global order
    does not depend on the world size, and the mean of two half-batch means is the batch mean)."""
    results = ft.launch(_two_process_worker, nprocs=2, args=(str(tmp_path),), timeout=300)
    for rank, out in enumerate(results):
        msg = out["disagree"]
        assert msg.startswith("TrainConfig differs between the 2 ranks: results_folder: ranks [0], ranks [1] hold 2 "
                              f"different values (this rank, {rank}, has '{tmp_path}/tmp-rank{rank}')"), msg
        assert f"seed: ranks [0], ranks [1] hold 2 different values (this rank, {rank}, has {rank})" in msg
        assert "train_batch_size" not in msg
        assert ("split_batches=True) makes train_batch_size global: an update takes train_batch_size * "
                "gradient_accumulate_every = 5 * 2 = 10 samples, which must divide by processes * "
                "gradient_accumulate_every = 2 * 2 = 4") in out["indivisible"]
        assert "Use a multiple of 2 (e.g. 4 or 6)" in out["indivisible"]
        assert out["rows"] == (8, 1, 6, 6)  # 4 rows per micro-step x accumulate 2 on each rank
    params = [{k: torch.from_numpy(v) for k, v in r["params"].items()} for r in results]
    assert T.tree_equal(params[0], params[1])
    torch.manual_seed(0)
    one = ft.Trainer(Denoise(noise=False), _data(), _config(tmp_path / "one", train_batch_size=8,
                                                            gradient_accumulate_every=2))
    assert tuple(next(iter(one.loader))[0].shape) == (16, 1, 6, 6)
    ref = one.train().params
    # fp32, 6 AdamW updates of O(1e-2): the all-reduced sum of two half-batch means rounds differently from one
    # mean over the batch by a few ulps; 1e-5 is far below one update, which a wrong batch rule would be off by
    ftt.assert_same_state(params[0], ref, rtol=1e-5, atol=1e-6, what="2 processes, split_batches")
    assert not T.tree_equal(ref, one.initial_state().params)
