"""Trainer.train(profile=): the steps asked for recorded into a Chrome trace with each step's range and the stages
of the (eager) step, a table printed, and the run's state the same as an unprofiled run's."""
import json

import torch

import functrain as ft
from functrain import tree as T
from functrain.compiler.profiling import Profile
from functrain.core.step import STAGES


class Linear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 1)

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.fc(x), y)


def _trainer(results):
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g))
    config = ft.TrainConfig(train_batch_size=8, train_num_steps=4, save_and_sample_every=4, results_folder=results,
                            compile=False, log_every=2, trackers=("jsonl",))
    torch.manual_seed(0)
    return ft.Trainer(Linear(), data, config)


def test_train_profiles_the_steps_asked_for(tmp_path, capsys):
    path = tmp_path / "trace.json"
    got = _trainer(str(tmp_path / "a")).train(profile=Profile(path, steps=2, skip=1))
    out = capsys.readouterr().out
    names = {e.get("name") for e in json.loads(path.read_text())["traceEvents"]}
    assert sorted(n for n in names if n and n.startswith("functrain/step ")) == [
        "functrain/step 2 (eager)", "functrain/step 3 (eager)"]
    assert {f"functrain/stage/{s}" for s in STAGES} <= names
    assert f"profile of steps 2-3 (trace: {path})" in out and "  grad " in out
    plain = _trainer(str(tmp_path / "b")).train()
    assert T.tree_equal(got, plain)
