"""A resumed run with other numbers (issue 40): a longer ``train_num_steps``, another lr or warm-up, another EMA
decay. The checkpoint's state trains on with the configuration's hyper-parameters (``copy_hyper``): the lr
schedule continues from the checkpoint's step along the new horizon, as the resume line says, and every number
the state holds is the new configuration's."""
import json

import torch

import functrain as ft
from functrain.optim import schedules

PEAK, WARMUP, FINAL = 1e-2, 2, 1e-3


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 1)

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.lin(x), y)


def _trainer(folder, steps, ema_decay=0.9):
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(32, 3), torch.randn(32, 1))
    config = ft.TrainConfig(train_batch_size=4, train_lr=PEAK, train_num_steps=steps, lr_schedule="warmup_cosine",
                            warmup_steps=WARMUP, min_lr=FINAL, ema_decay=ema_decay, ema_update_after_step=0,
                            ema_update_every=1, results_folder=str(folder), compile=False, log_every=1,
                            save_and_sample_every=4, seed=0)
    return ft.Trainer(Model(), data, config)


def test_a_resume_with_a_longer_run_continues_the_schedule_to_the_new_horizon(tmp_path, capsys):
    _trainer(tmp_path, 4).train()
    capsys.readouterr()
    longer = _trainer(tmp_path, 8, ema_decay=0.5)
    state = longer.train()
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("resumed from"))
    assert "at step 4; the lr schedule and hyper-parameters continue from step 4 with this run's values" in line, out
    assert "lr.warmup_cosine.total_steps 4 -> 8" in line and "ema.decay 0.9 -> 0.5" in line, line
    # every number of the final state is the longer run's configuration's, everything else trained on from the file
    fresh = longer.initial_state()
    assert ft.tree.tree_equal(ft.get_hyper(state), ft.get_hyper(fresh))
    # the lr the steps used: the 4-step schedule for steps 1-4, then the 8-step one from step 5 on (not restarted)
    lrs = {r["step"]: r["lr"] for r in map(json.loads, open(tmp_path / "metrics.jsonl")) if "lr" in r}
    short = schedules.warmup_cosine(PEAK, WARMUP, total_steps=4, final=FINAL)
    long = schedules.warmup_cosine(PEAK, WARMUP, total_steps=8, final=FINAL)
    assert sorted(lrs) == list(range(1, 9)), lrs
    for step in range(1, 9):
        want = float((short if step <= 4 else long)(step - 1))
        assert abs(lrs[step] - want) <= 1e-9 * PEAK, (step, lrs[step], want)
    assert float(short(5)) != float(long(5))  # (the two horizons do differ where the resumed steps ran)


def test_a_resume_with_the_same_numbers_says_nothing_of_them(tmp_path, capsys):
    _trainer(tmp_path, 4).train()
    capsys.readouterr()
    trainer = _trainer(tmp_path, 4)
    trainer.restore()
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("resumed from"))
    assert line.endswith("at step 4"), line
