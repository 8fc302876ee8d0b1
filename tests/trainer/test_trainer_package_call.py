"""denoising-diffusion-pytorch's own Trainer line through ft.Trainer (issue 30), and what a run run again says
(issue 29): the package's keywords build the TrainConfig (or are refused naming why and where their job is done);
``save_best_and_latest_only`` / ``keep_best`` keep the checkpoint with the best held-out loss beside the newest; a
finished run run again says so and prints its summary without training; a resume with a changed config says so in
one plain line."""
from __future__ import annotations

import os
import warnings

import pytest
import torch

import functrain as ft

pytest.importorskip("safetensors")


class Linear(torch.nn.Module):
    def __init__(self, d=4):
        super().__init__()
        self.fc = torch.nn.Linear(d, 1)

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.fc(x), y)


def _data(n=64, d=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    return torch.utils.data.TensorDataset(x, x[:, :1] * 0.7 - 0.2 + 0.1 * torch.randn(n, 1, generator=g))


# ------------------------------------------------------------------------------------------ the package's keywords
def test_the_packages_keywords_build_the_config(tmp_path):
    """The package's line, keyword for keyword: the config is the TrainConfig of the shared names, amp ->
    mixed_precision, and the package's split_batches=True; calculate_fid=False (and its FID settings) accepted."""
    trainer = ft.Trainer(Linear(), _data(), train_batch_size=8, train_lr=8e-5, train_num_steps=7,
                         gradient_accumulate_every=2, ema_decay=0.99, amp=True, mixed_precision_type="bf16",
                         calculate_fid=False, num_fid_samples=100, results_folder=str(tmp_path), max_grad_norm=0.5,
                         adam_betas=(0.9, 0.95), ema_update_every=5, save_and_sample_every=7, num_samples=4,
                         compile=False)
    assert trainer.config == ft.TrainConfig(
        train_batch_size=8, train_lr=8e-5, train_num_steps=7, gradient_accumulate_every=2, ema_decay=0.99,
        mixed_precision="bf16", results_folder=str(tmp_path), max_grad_norm=0.5, adam_betas=(0.9, 0.95),
        ema_update_every=5, save_and_sample_every=7, num_samples=4, compile=False, split_batches=True)
    plain = ft.Trainer(Linear(), _data(), amp=False, results_folder=str(tmp_path / "b"))
    assert plain.config == ft.TrainConfig(results_folder=str(tmp_path / "b"), split_batches=True)


@pytest.mark.parametrize("keywords,match", [
    ({"calculate_fid": True}, r"cannot honour calculate_fid=True.*Inception-v3 weights.*download at run time.*"
                              r"calculate_fid=False.*ft\.TrainConfig\(\.\.\.\)"),
    ({"inception_block_idx": 768}, r"cannot honour inception_block_idx: settings of the package's FID"),
    ({"amp": True, "mixed_precision": "bf16"}, r"give one of the two"),
    ({"mixed_precision_type": "fp8", "amp": True}, r"mixed_precision_type='fp8' \(str\): one of \('no', 'bf16'"),
    ({"lr": 1e-3}, r"ft\.Trainer\(\.\.\.\) has no keyword .*'lr': use train_lr"),
    ({"train_batchsize": 8}, r"did you mean train_batch_size"),
    ({"augment_horizontal_flip": False}, r"reads a folder of images \(a path\).*ft\.data\.ImageFolder"),
    ({"train_batch_size": 0}, r"TrainConfig\.train_batch_size must be"),
])
def test_keywords_it_cannot_honour_are_refused_by_name(tmp_path, keywords, match):
    with pytest.raises(ValueError, match=match):
        ft.Trainer(Linear(), _data(), results_folder=str(tmp_path), **keywords)


def test_a_config_and_keywords_together_are_refused(tmp_path):
    config = ft.TrainConfig(results_folder=str(tmp_path))
    with pytest.raises(TypeError, match=r"got a TrainConfig and the keywords train_batch_size, train_lr: give one "
                                        r"or the other.*config\.replace"):
        ft.Trainer(Linear(), _data(), config, train_batch_size=8, train_lr=1e-3)


# ------------------------------------------------------------------------------------------ run again
def _run(folder, capfd, **kw):
    base = dict(train_batch_size=8, train_num_steps=4, save_and_sample_every=2, results_folder=str(folder),
                log_every=1, trackers=(), train_lr=1e-2)
    trainer = ft.Trainer(Linear(), _data(), ft.TrainConfig(**{**base, **kw}))
    state = trainer.train()
    out = capfd.readouterr()
    return trainer, state, out.out + out.err


def test_a_finished_run_run_again_says_so_and_trains_nothing(tmp_path, capfd):
    """The second run of a finished job: 'already at step 4 of 4' and its summary (the last loss), no progress bar,
    no step called (eager or compiled), no compile (the compiled step's own count), the data position untouched,
    the module holding the checkpoint's weights; the state is the checkpoint's."""
    first, done, _ = _run(tmp_path, capfd)
    trainer, state, text = _run(tmp_path, capfd)
    assert "already at step 4 of 4: nothing to train" in text, text
    assert f"finished step 4/4: loss {first.log.last['loss']:.6g}" in text, text
    assert "it/s" not in text and "steps/s" not in text, text  # no bar, no rate: nothing ran
    assert trainer.run_step.rates.calls == {"eager": 0, "compiled": 0}
    assert trainer.compiled is not None and trainer.compiled.compiles == 0
    assert trainer.loader.state_dict() == ft.load_extra(first.checkpoints.latest())["data"]  # as restored
    assert int(state.step) == 4 and ft.tree.tree_equal(state.params, done.params)
    assert torch.equal(trainer.module.fc.weight, state.params["fc.weight"])


def test_a_resume_with_a_changed_config_says_so_in_one_plain_line(tmp_path, capfd):
    """No UserWarning with a source path: one line naming each changed key, its saved and its new value."""
    _run(tmp_path, capfd, compile=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, state, text = _run(tmp_path, capfd, compile=False, train_num_steps=6, train_lr=2e-2)
    assert int(state.step) == 6
    assert not [w for w in caught if "config" in str(w.message)], [str(w.message) for w in caught]
    lines = [line for line in text.splitlines() if "changed config" in line]
    # one line for the changed config (with what the lr does now, issue 36 row 15), and the resume line names the
    # hyper-parameter the resumed state now trains with (issue 40: the config's numbers, not the checkpoint's)
    assert lines == ["resuming with a changed config: train_lr 0.01 -> 0.02, train_num_steps 4 -> 6; "
                     "lr: 0.02 (was 0.01 at step 4)"], text
    assert "continue from step 4 with this run's values (lr 0.01 -> 0.02)" in text, text


# ------------------------------------------------------------------------------------------ the best and the latest
def _away(n=32):
    """Held-out data of the opposite relation: training on _data() moves the params away from it, so the eval loss
    grows and the best checkpoint is an early one, not the newest."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(n, 4, generator=g)
    return torch.utils.data.TensorDataset(x, -x[:, :1] * 0.7 + 0.2)


def test_save_best_and_latest_only_keeps_the_best_eval_checkpoint_and_the_newest(tmp_path, capfd):
    """The package's save_best_and_latest_only=True: keep_best='eval_loss_ema', keep_checkpoints=1. After the run
    the folder holds the newest checkpoint and the one whose step's eval_loss_ema (from the run's own history) is the
    lowest; run on to more steps (a resume), the best is still ranked with the new saves."""
    kw = dict(train_batch_size=8, save_and_sample_every=2, results_folder=str(tmp_path), log_every=2, trackers=(),
              train_lr=5e-2, compile=False, ema_update_every=1, ema_update_after_step=0, ema_power=None,
              ema_decay=0.5, calculate_fid=False, save_best_and_latest_only=True)
    for steps in (6, 10):
        trainer = ft.Trainer(Linear(), _data(), train_num_steps=steps, eval_dataset=_away(), **kw)
        assert (trainer.config.keep_best, trainer.config.keep_checkpoints) == ("eval_loss_ema", 1)
        trainer.train()
        evals = dict(trainer.history.as_dict()["eval_loss_ema"])
        assert sorted(evals) == list(range(2, steps + 1, 2))  # every save evaluated
        best = min((v, s) for s, v in evals.items())[1]
        assert best != steps  # the test discriminates: the best is not the newest
        assert trainer.checkpoints.steps() == sorted({best, steps})
        assert trainer.checkpoints.best() == best
        assert f"best checkpoint (eval_loss_ema): {trainer.checkpoints.path(best)}" in capfd.readouterr().out


def test_keep_best_needs_an_eval_set_and_an_evaluation_at_each_save(tmp_path):
    with pytest.raises(ValueError, match=r"keep_best='eval_loss'.*no eval_dataset="):
        ft.Trainer(Linear(), _data(), ft.TrainConfig(keep_best="eval_loss", results_folder=str(tmp_path)))
    with pytest.raises(ValueError, match=r"every save must evaluate: eval_every=0 .* or a divisor of "
                                         r"save_and_sample_every=10; got eval_every=3"):
        ft.TrainConfig(keep_best="eval_loss", eval_every=3, save_and_sample_every=10)
    with pytest.raises(ValueError, match=r"keep_best must be one of \('eval_loss', 'eval_loss_ema', None\)"):
        ft.TrainConfig(keep_best="fid")
