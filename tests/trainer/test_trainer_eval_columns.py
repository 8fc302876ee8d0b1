"""ft.Trainer(eval_dataset=...) with in-memory columns (docs/trainer.md accepts them, as ft.shard does): a tuple or
dict of tensors / numpy arrays counts its rows, not its items, and every row is evaluated once."""
import json
import os

import numpy as np
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


def _columns(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return x, x[:, :1] * 0.7 - 0.2 + 0.1 * torch.randn(n, 1, generator=g)


def _per_sample_mse(params, x, y):
    pred = x @ params["fc.weight"].T + params["fc.bias"]
    return ((pred - y) ** 2).mean(1).double().mean().item()


@pytest.mark.parametrize("kind", ["tuple", "dict", "numpy tuple"])
def test_an_eval_set_of_columns_counts_its_rows(tmp_path, kind):
    """13 rows in eval batches of 4: a tuple (x, y) was refused as "2 samples", a dict {"x", "y"} as 2 too."""
    x, y = _columns(13, seed=1)
    held_out = {"tuple": (x, y), "dict": {"x": x, "y": y}, "numpy tuple": (x.numpy(), y.numpy())}[kind]
    config = ft.TrainConfig(train_batch_size=8, train_num_steps=4, save_and_sample_every=4, eval_batch_size=4,
                            results_folder=str(tmp_path), compile=False, log_every=1, trackers=("jsonl",),
                            train_lr=1e-2, ema_update_every=1, ema_decay=0.9, ema_update_after_step=0,
                            ema_power=None)
    torch.manual_seed(0)
    train = ft.Trainer(Linear(), _columns(64, seed=0), config, eval_dataset=held_out)
    state = train.train()
    evals = [json.loads(line) for line in open(os.path.join(tmp_path, "metrics.jsonl"))]
    last = [r for r in evals if "eval_loss" in r][-1]
    assert last["step"] == 4 and last["eval_samples"] == 13
    assert last["eval_loss"] == pytest.approx(_per_sample_mse(state.params, x, y), rel=1e-6)
    assert last["eval_loss_ema"] == pytest.approx(_per_sample_mse(state.ema, x, y), rel=1e-6)


def test_an_eval_set_of_columns_smaller_than_a_batch_is_refused_with_its_rows(tmp_path):
    x, y = _columns(3, seed=1)
    config = ft.TrainConfig(train_batch_size=8, train_num_steps=4, eval_batch_size=4, results_folder=str(tmp_path),
                            compile=False, trackers=())
    for held_out in ((x, y), {"x": x, "y": y}):
        with pytest.raises(ValueError, match=r"the eval dataset has 3 samples, fewer than one batch of 4"):
            ft.Trainer(Linear(), _columns(64, seed=0), config, eval_dataset=held_out)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=2)  # 2 batches, 3 rows
    with pytest.raises(ValueError, match=r"the eval dataset has 3 samples, fewer than one batch of 4"):
        ft.Trainer(Linear(), _columns(64, seed=0), config, eval_dataset=loader)
