"""The compile policy forced from the API as well as from FUNCTRAIN_COMPILE_POLICY: ft.compile(policy=...) and
TrainConfig(compile_policy=...); Trainer.precompile() compiles ahead (issue 29)."""
from __future__ import annotations

import pytest
import torch

import functrain as ft


def _step():
    return ft.train_step(lambda p, b, x: (p["w"] * x).pow(2).sum(), ft.optim.sgd(0.1))


@pytest.mark.parametrize("policy", ["auto", "always", "never"])
def test_compile_takes_the_policy_over_the_setting(monkeypatch, policy):
    monkeypatch.setenv("FUNCTRAIN_COMPILE_POLICY", "always" if policy != "always" else "never")
    assert ft.compile(_step(), backend="aot_eager", policy=policy).settings.policy == policy
    assert ft.compile(_step(), backend="aot_eager").settings.policy != policy  # without it: the setting


def test_a_bad_policy_is_named():
    with pytest.raises(ValueError, match=r"policy must be one of 'auto', 'always', 'never' or None.*got 'sometimes'"):
        ft.compile(_step(), policy="sometimes")
    with pytest.raises(ValueError, match=r"compile_policy.*'sometimes'"):
        ft.TrainConfig(compile_policy="sometimes")


class Linear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 1)

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.fc(x), y)


def _data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 4, generator=g)
    return torch.utils.data.TensorDataset(x, x[:, :1])


def test_a_trainer_never_compiling_trains_eagerly_and_precompile_is_a_method(tmp_path, monkeypatch):
    monkeypatch.setenv("FUNCTRAIN_COMPILE_POLICY", "always")  # (the suite's): the config's word wins
    config = ft.TrainConfig(train_batch_size=8, train_num_steps=4, results_folder=str(tmp_path / "never"),
                            trackers=(), compile_policy="never", log_every=1)
    trainer = ft.Trainer(Linear(), _data(), config)
    assert trainer.compiled.settings.policy == "never"
    trainer.train()
    assert trainer.run_step.rates.calls["compiled"] == 0 and trainer.compiled.compiles == 0
    config = ft.TrainConfig(train_batch_size=8, train_num_steps=4, results_folder=str(tmp_path / "ahead"),
                            trackers=())
    trainer = ft.Trainer(Linear(), _data(), config)
    seconds = trainer.precompile()
    assert seconds > 0 and trainer.compiled.compiles == 1
    eager = ft.Trainer(Linear(), _data(), ft.TrainConfig(train_batch_size=8, train_num_steps=4, trackers=(),
                                                         results_folder=str(tmp_path / "eager"), compile=False))
    with pytest.raises(ValueError, match="not compiled"):
        eager.precompile()
