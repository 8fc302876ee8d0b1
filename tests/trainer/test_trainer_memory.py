"""The Trainer's memory line: rank 0 prints ft.memory's estimate once, before the first step (compiled: state and
step peak from the capture the first step compiles; eager: the state's bytes)."""
from __future__ import annotations

import warnings

import pytest
import torch

import functrain as ft

pytest.importorskip("safetensors")


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 1)

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.fc(x), y)


def _train(tmp_path, compile, **kw):
    torch.manual_seed(0)
    x = torch.randn(64, 4)
    data = torch.utils.data.TensorDataset(x, x[:, :1] * 0.5)
    config = ft.TrainConfig(train_batch_size=8, train_num_steps=3, save_and_sample_every=3, compile=compile,
                            results_folder=str(tmp_path), log_every=1, trackers=("jsonl",), **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = ft.Trainer(Model(), data, config)
        trainer.train()
    return trainer


# A background compile of 3 tiny steps may finish after the run (a cold cache takes seconds): the compiled cases pin
# when the compiled code runs, blocking from the first step, or background with the switch fixed at step 2 (the run
# waits there for the compile), so "the capture ft.memory traced is the one compiled" is checked on both paths.
_MODES = {"blocking": dict(compile=True, compile_background=False),
          "background": dict(compile=True, compile_switch_at=2),
          "eager": dict(compile=False)}


@pytest.mark.parametrize("mode", list(_MODES))
def test_trainer_prints_the_memory_line_once_before_the_first_step(tmp_path, capsys, monkeypatch, mode):
    import functrain.compiler.runtime as runtime

    traces = []
    real = runtime.trace
    monkeypatch.setattr(runtime, "trace", lambda *a, **k: traces.append(1) or real(*a, **k))
    compile = _MODES[mode]["compile"]
    trainer = _train(tmp_path, **_MODES[mode])
    out = capsys.readouterr().out.splitlines()
    lines = [i for i, line in enumerate(out) if line.startswith("memory per rank on cpu: state ")]
    assert len(lines) == 1, out
    line = out[lines[0]]
    assert "params 20 B" in line and "optimizer" in line, line  # Linear(4, 1): 5 float32 params
    if compile:
        assert "step peak +" in line and "of " in line, line
        assert trainer.run_step.compiles == 1 and len(traces) == 1  # the capture ft.memory traced is compiled
    else:
        assert "estimated for a compiled step" in line, line
    finished = [i for i, line in enumerate(out) if "finished step 3/3" in line]
    assert finished and lines[0] < finished[0]
