"""The Trainer's loop: a step's one tracker record goes out before its checkpoint, a stop step's too (its log in the
checkpoint's history), and a run of skipped updates' too. In-process, eager, one process."""
import json
import os
import warnings

import pytest
import torch

import functrain as ft

pytest.importorskip("safetensors")


class Linear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 1)

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.fc(x), y)


def _data(n=64, nan=False):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g)
    if nan:
        x[:, 2] = float("nan")
    return torch.utils.data.TensorDataset(x, y)


def _config(folder, **kw):
    base = dict(train_batch_size=8, train_num_steps=20, save_and_sample_every=1, results_folder=str(folder),
                compile=False, log_every=100, trackers=("jsonl",))
    return ft.TrainConfig(**{**base, **kw})


def _logged(folder):
    path = os.path.join(folder, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f]


class LogBeforeSave(ft.Callback):
    """At each save: which steps metrics.jsonl holds (with a loss) already."""

    def __init__(self, folder):
        self.folder, self.seen = folder, {}

    def on_save(self, step, path):
        self.seen[step] = [r["step"] for r in _logged(self.folder) if "loss" in r]


def test_a_stop_step_is_logged_before_its_checkpoint_which_holds_its_log(tmp_path):
    """should_stop answers at the evaluation of step 4, so the run stops at step 5: not a log step (log_every 100)
    but a save step. Its record (a loss) must reach metrics.jsonl before its checkpoint is written (after a kill
    between the two the resume would start after step 5 and never log it), and the checkpoint's history holds it."""
    watch = LogBeforeSave(tmp_path)
    torch.manual_seed(0)
    trainer = ft.Trainer(Linear(), _data(), _config(tmp_path, eval_every=4), eval_dataset=_data(16),
                         callbacks=[watch], should_stop=lambda step, m: "eval_loss" in m)
    state = trainer.train()
    assert int(state.step) == 5
    log = _logged(tmp_path)
    assert [r["step"] for r in log] == [4, 5] and "eval_loss" in log[0] and "loss" in log[1], log
    assert watch.seen[5] == [5], watch.seen  # the stop step's record came first
    history = ft.load_extra(ft.CheckpointManager(tmp_path / "checkpoints").path(5))["history"]
    from functrain.trainer.plots import MetricHistory

    assert [s for s, _ in MetricHistory.from_json(history).as_dict()["loss"]] == [5]


def test_a_run_of_skipped_updates_logs_its_last_step_before_saving_it(tmp_path):
    watch = LogBeforeSave(tmp_path)
    config = _config(tmp_path, max_consecutive_nonfinite=5, log_every=1, save_and_sample_every=1000)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the skipped updates are reported: not the point here)
        with pytest.raises(FloatingPointError, match=r"5 updates in a row up to step 5"):
            ft.Trainer(Linear(), _data(nan=True), config, callbacks=[watch]).train()
    assert watch.seen == {5: [1, 2, 3, 4, 5]}, watch.seen
    assert [r["step"] for r in _logged(tmp_path)] == [1, 2, 3, 4, 5]
