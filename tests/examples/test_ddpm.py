"""denoising-diffusion-pytorch, the real package (skipped where it is not installed: it needs torchvision, see
.ci/run's second venv): a user of its Trainer switches to ft.Trainer and meets no surprise.

* ft.ema with the trainer's defaults is ema-pytorch's EMA as the package builds it (one update ahead);
* ImageFolder reads a folder as the package's Dataset does (bitwise);
* examples/ddpm.py trains GaussianDiffusion(Unet) with ft.Trainer from a folder, compiled; its EMA's held-out loss
  after 200 updates is within 1.2x of the package's own Trainer's (recorded by bench/ddpm.py in
  bench/ddpm_reference.json, on the same data and hyper-parameters); the module is trained afterwards;
* Unet(self_condition=True): compiled, one graph per side of p_losses' random() coin, picked from the state's key
  (equal to the eager step); under ft.Trainer's defaults no failed compile;
* on 2 processes the batch-size and config-agreement errors fire.
"""
from __future__ import annotations

import importlib.util
import json
import os
import sys

import numpy as np
import pytest
import torch

import functrain as ft
import functrain.testing as ftt
from functrain import tree as T

pytest.importorskip("denoising_diffusion_pytorch")
ema_pytorch = pytest.importorskip("ema_pytorch")
pytest.importorskip("sklearn")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _example():
    spec = importlib.util.spec_from_file_location("ddpm_example", os.path.join(ROOT, "examples", "ddpm.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def ex():
    return _example()


@pytest.fixture(scope="module")
def digits(tmp_path_factory, ex):
    return ex.digits_folder(str(tmp_path_factory.mktemp("digits")))


# ------------------------------------------------------------------------------------------ the EMA
@pytest.mark.parametrize("every,after,power", [(10, 100, 2 / 3), (1, 0, 1.0), (3, 6, 0.75)])
def test_ft_ema_is_ema_pytorch_one_update_ahead(every, after, power):
    """The same params sequence p_0 (init), p_1, ... through ft.ema(0.995, every, start_step=after, power) and through
    ema-pytorch's EMA(beta=0.995, update_every=every, update_after_step=after, power) (update() after each optimizer
    step, as the package's Trainer calls it): ft's EMA after update k equals ema-pytorch's after its call k + 1 fed
    p_{j-1} at call j, for every k >= after (a multiple of every). rtol 1e-6: ema-pytorch rounds the decay to
    float32, ft computes it in float64 (eagerly) before the same fp32 lerp."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    _, params, _ = ft.functionalize(model)
    loss = lambda p, b, x: ((x @ p["weight"].T + p["bias"]) ** 2).mean()  # noqa: E731
    step = ft.ema(0.995, every=every, start_step=after, power=power)(ft.train_step(loss, ft.optim.adamw(1e-1)))
    state = step.init(T.tree_map(torch.clone, params))
    seen, ours = [T.tree_map(torch.clone, state.params)], []
    gen = torch.Generator().manual_seed(1)
    for _ in range(after + 12 * every):
        state, _ = step(state, torch.randn(4, 3, generator=gen))
        seen.append(state.params)
        ours.append(state.ema)
    theirs = ema_pytorch.EMA(model, beta=0.995, update_every=every, update_after_step=after, power=power,
                             inv_gamma=1.0, include_online_model=False)
    reference = []
    for j in range(1, len(seen) + 1):  # call j sees p_{j-1}
        ft.to_module(model, seen[j - 1])
        theirs.update()
        reference.append({k: v.detach().clone() for k, v in theirs.ema_model.named_parameters()})
    blends = 0
    for k in range(max(after, 1), len(ours) + 1):
        ftt.assert_same_state(ours[k - 1], reference[k], rtol=1e-6, atol=1e-7, what=f"EMA after update {k}")
        blends += k > after and k % every == 0
    assert blends >= 10


def test_the_trainers_default_ema_is_the_packages():
    """TrainConfig's defaults give ema-pytorch's EMA as denoising-diffusion-pytorch's Trainer makes it (its
    update_after_step, inv_gamma, power, min_value defaults), and the package's own Trainer arguments."""
    import inspect

    from denoising_diffusion_pytorch import Trainer
    from functrain.trainer.build import config_ema

    pkg = {k: v.default for k, v in inspect.signature(Trainer.__init__).parameters.items()}
    ema = {k: v.default for k, v in inspect.signature(ema_pytorch.EMA.__init__).parameters.items()}
    c = ft.TrainConfig()
    for name in ("train_batch_size", "gradient_accumulate_every", "train_lr", "train_num_steps", "ema_update_every",
                 "ema_decay", "adam_betas", "save_and_sample_every", "num_samples", "max_grad_norm"):
        assert getattr(c, name) == pkg[name], name
    e = config_ema(c)
    assert (e.start_step, e.inv_gamma, e.power, e.min_decay) == (ema["update_after_step"], ema["inv_gamma"],
                                                                  ema["power"], ema["min_value"])
    assert pkg["split_batches"] is True and c.split_batches is False  # the one default that differs, documented
    assert pkg["augment_horizontal_flip"] is True


# ------------------------------------------------------------------------------------------ the folder
def test_image_folder_reads_a_folder_as_the_packages_dataset(tmp_path):
    """Images of other sizes and modes (RGB, wide, tall) through ft.data.ImageFolder and the package's Dataset
    (torchvision's Resize, CenterCrop, ToTensor; no flip): bitwise the same tensors, in the same (sorted) order."""
    from PIL import Image
    from denoising_diffusion_pytorch.denoising_diffusion_pytorch import Dataset

    rng = np.random.default_rng(0)
    for i, (h, w) in enumerate([(20, 30), (33, 17), (16, 16), (9, 40), (64, 48)]):
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(tmp_path / f"{i}.png")
    for mode in ("L", "RGB"):
        ours = ft.data.ImageFolder(tmp_path, 16, augment_horizontal_flip=False, convert_image_to=mode)
        theirs = Dataset(str(tmp_path), 16, augment_horizontal_flip=False, convert_image_to=mode)
        order = sorted(range(len(theirs)), key=lambda i: str(theirs.paths[i]))
        assert [str(p) for p in ours.paths] == [str(theirs.paths[i]) for i in order]
        for i, j in enumerate(order):
            assert torch.equal(ours[i], theirs[j]), (mode, ours.paths[i])


# ------------------------------------------------------------------------------------------ the example
def _reference():
    with open(os.path.join(ROOT, "bench", "ddpm_reference.json")) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def trained(ex, digits, tmp_path_factory):
    """examples/ddpm.py's run from the folder: 200 updates of the issue's hyper-parameters. Eager: on a CPU the
    compile of this Unet costs more than it saves in 200 updates (compiled == eager by law, and
    test_the_example_compiles_to_one_graph compiles the same example at a smaller width)."""
    results = str(tmp_path_factory.mktemp("ddpm") / "run")
    data = os.path.dirname(digits[0])
    torch.manual_seed(0)
    trainer, diffusion, held = ex.train(200, results, data, save_and_sample_every=100, num_samples=4, compile=False)
    return trainer, diffusion, held, results


def test_the_example_trains_from_a_folder_and_its_ema_is_as_good_as_the_packages(ex, trained):
    """The EMA's held-out loss after 200 updates is within 1.2x of the package's own Trainer on the same data and
    hyper-parameters (bench/ddpm_reference.json, recorded by bench/ddpm.py --impl package); before the warm-up it
    was 3x worse (0.48 vs 0.15 in the issue). The params are as good too (1.2x), and both beat the untrained
    model. One graph: the compiled step was compiled once."""
    trainer, diffusion, held, results = trained
    ref = _reference()["package"]
    params, ema = ex.held_out_loss(diffusion, held), ex.held_out_loss(trainer.ema_module(), held)
    untrained = ex.held_out_loss(ex.diffusion_model(16), held)
    assert ema <= 1.2 * ref["ema"], (ema, ref)
    assert params <= 1.2 * ref["params"], (params, ref)
    assert ema < 0.6 * untrained and params < 0.6 * untrained, (params, ema, untrained)
    assert "random_flip" in [t.name for t in trainer.step.transforms]  # the package's augment_horizontal_flip
    assert os.path.exists(os.path.join(results, "sample-100.png")) and os.path.exists(os.path.join(results,
                                                                                                   "sample-200.png"))


def test_the_module_is_trained_after_train(trained):
    trainer, diffusion, _, _ = trained
    state = trainer.state
    assert T.tree_equal({k: v.detach() for k, v in diffusion.named_parameters()}, state.params)
    ema_model = trainer.ema_module()
    assert T.tree_equal({k: v for k, v in ema_model.named_parameters()}, state.ema)
    assert type(ema_model) is type(diffusion) and ema_model is not diffusion
    assert tuple(ema_model.sample(batch_size=2).shape) == (2, 1, 16, 16)  # the package's sampling, from the EMA


def test_the_packages_model_captures_as_one_graph(ex, digits):
    """The trainer's step for the package's GaussianDiffusion(Unet) (the config's clip, EMA warm-up, accumulate,
    skip_nonfinite, and the folder's flip) captured by ft.compile as one graph with no graph break, its random
    timesteps, noise and flips drawn inside it from the state's key: equal to the eager step over 4 updates, no
    recompile. The aot_eager backend (eager kernels, so the draws match bitwise): inductor's C++ compile of the
    Unet takes minutes on a CPU; the inductor path itself is tested in the main suite."""
    from functrain.trainer.build import build_step, model_loss

    folder, _ = digits
    diffusion = ex.diffusion_model(8, dim_mults=(1, 2))
    apply_fn, params, buffers = ft.functionalize(diffusion)
    config = ex.config_for(4, "unused", train_batch_size=8, ema_update_after_step=1, ema_update_every=1)
    data = ft.data.ImageFolder(folder, 16, convert_image_to="L")
    step, _ = build_step(model_loss(apply_fn), config, 1, transforms=data.augmentation())
    cstep = ft.compile(step, backend="aot_eager")
    loader = ft.shard(data, batch_size=16, shuffle=True, seed=0, drop_last=True)
    batches = [b for b, _ in zip(loader, range(4))]
    a = b = step.init(params, buffers, seed=0)
    for batch in batches:
        a, ma = step(a, batch)
        b, mb = cstep(b, batch)
    assert cstep.compiles == 1
    ftt.assert_same_state(b.params, a.params, rtol=1e-5, atol=1e-6, what="compiled vs eager params")
    ftt.assert_same_state(b.ema, a.ema, rtol=1e-5, atol=1e-6, what="compiled vs eager EMA")
    assert not T.tree_equal(a.ema, a.params)


def test_the_example_script_runs(digits, tmp_path):
    """The command line of the example, eagerly, a few updates (the compiled 200-update run is the fixture's)."""
    import subprocess

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    out = subprocess.run([sys.executable, "examples/ddpm.py", "--steps", "4", "--no-compile", "--results",
                          str(tmp_path / "run"), "--data", os.path.dirname(digits[0])], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "held-out loss after 4 updates: params" in out.stdout


# ------------------------------------------------------------------------------------------ self-conditioning
def _outcomes(state, coins):
    """The coins p_losses flips from ``state`` (Python's generator seeded from the step seed, on every rank)."""
    import random

    from functrain.core.rng import step_seed

    gen = random.Random(step_seed(*state.rng["key"].tolist()))
    return tuple(gen.random() < 0.5 for _ in range(coins))


def test_self_condition_compiles_and_equals_eager(ex, digits):
    """Unet(self_condition=True): p_losses flips `random() < 0.5` (from random import random). ft.compile captures
    one graph per side of the coin, picked at each call from the state's key: over 8 updates both sides come up,
    and the compiled step equals the eager one (aot_eager: eager kernels, to aot_autograd's rounding, as in
    test_the_packages_model_captures_as_one_graph; inductor's C++ compile of the Unet takes minutes on a CPU),
    params, EMA and loss; one graph per outcome, none recompiled."""
    from functrain.trainer.build import build_step, model_loss

    folder, _ = digits
    diffusion = ex.diffusion_model(8, self_condition=True, dim_mults=(1, 2))
    apply_fn, params, buffers = ft.functionalize(diffusion)
    config = ex.config_for(8, "unused", train_batch_size=8, gradient_accumulate_every=1, ema_update_after_step=1,
                           ema_update_every=1)
    data = ft.data.ImageFolder(folder, 16, convert_image_to="L")
    step, _ = build_step(model_loss(apply_fn), config, 1, transforms=data.augmentation())
    cstep = ft.compile(step, backend="aot_eager")
    loader = ft.shard(data, batch_size=8, shuffle=True, seed=0, drop_last=True)
    batches = [b for b, _ in zip(loader, range(8))]
    a = b = step.init(params, buffers, seed=2)
    seen = set()
    for batch in batches:
        seen.add(_outcomes(a, 1))
        a, ma = step(a, batch)
        b, mb = cstep(b, batch)
        # (the other side of the coin changes the Unet's input, and the loss far beyond this tolerance)
        torch.testing.assert_close(mb["loss"], ma["loss"], rtol=1e-5, atol=1e-6)
    assert seen == {(True,), (False,)}, seen
    ftt.assert_same_state(b.params, a.params, rtol=1e-5, atol=1e-6, what="compiled vs eager params")
    ftt.assert_same_state(b.ema, a.ema, rtol=1e-5, atol=1e-6, what="compiled vs eager EMA")
    assert cstep.compiles == 2


def test_self_condition_under_the_trainers_defaults_trains_without_a_failed_compile(ex, digits, tmp_path):
    """ft.Trainer with its defaults (compile on, in the background): the background trace records the coin instead
    of failing, so no "the background compile failed" warning and no HostRandomError; the run trains on (eagerly
    until the compiled Unet is ready, which on a CPU takes longer than these steps) and is reproducible."""
    import warnings

    folder, _ = digits
    results = []
    for run in range(2):
        config = ex.config_for(4, str(tmp_path / f"sc{run}"), train_batch_size=8, gradient_accumulate_every=1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer = ft.Trainer(ex.diffusion_model(8, self_condition=True, dim_mults=(1, 2)), folder, config)
            assert int(trainer.train().step) == 4
        assert not [w for w in caught if "compile failed" in str(w.message)], [str(w.message) for w in caught]
        progress = trainer.run_step.progress
        assert progress.phase != "failed" and progress.reason is None, progress
        results.append(trainer.state.params)
    assert T.tree_equal(results[0], results[1])


# ------------------------------------------------------------------------------------------ 2 processes
def _two_rank_worker(folder, results):
    import torch.distributed as dist

    ex = _example()
    rank = dist.get_rank()
    out = {}
    try:  # per-rank temporary results folders: the bug of the issue
        ft.Trainer(ex.diffusion_model(16), folder, ex.config_for(2, os.path.join(results, f"tmp{rank}")))
    except ValueError as e:
        out["agree"] = str(e)
    try:
        ft.Trainer(ex.diffusion_model(16), folder, ex.config_for(2, os.path.join(results, "odd"),
                                                                 train_batch_size=33))
    except ValueError as e:
        out["batch"] = str(e)
    return out


def test_on_two_processes_the_config_and_batch_errors_fire(digits, tmp_path):
    folder, _ = digits
    outs = ft.launch(_two_rank_worker, nprocs=2, args=(folder, str(tmp_path)), timeout=300)
    for rank, out in enumerate(outs):
        assert out["agree"].startswith("TrainConfig differs between the 2 ranks: results_folder: ranks [0], ranks [1] "
                                       f"hold 2 different values (this rank, {rank}, has "), out
        assert "train_batch_size * gradient_accumulate_every = 33 * 2 = 66 samples, which must divide by processes " \
               "* gradient_accumulate_every = 2 * 2 = 4" in out["batch"], out
