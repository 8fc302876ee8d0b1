"""The Trainer's memory line stays off the training thread after the first step: it is made from the capture the
background compile traced (kept for it even once compiled), never from a new trace, and the graph walk behind it
runs on a thread of its own; the run waits for it at the end, so the line is never lost."""
from __future__ import annotations

import threading
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


def _train(tmp_path, steps, **kw):
    torch.manual_seed(0)
    x = torch.randn(64, 4)
    data = torch.utils.data.TensorDataset(x, x[:, :1] * 0.5)
    config = ft.TrainConfig(train_batch_size=8, train_num_steps=steps, save_and_sample_every=steps,
                            results_folder=str(tmp_path), log_every=5, trackers=("jsonl",), **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = ft.Trainer(Model(), data, config)
        trainer.train()
    return trainer


def test_no_trace_or_walk_for_the_memory_line_on_the_training_thread(tmp_path, capsys, monkeypatch):
    """20 steps with the defaults (compile on, in the background): every trace on the training thread is the
    background compile's own (one per graph it compiles: Progress says it traced), none is the line's; the graph
    walk runs only on the line's thread; the line is printed once, with the step's peak."""
    import functrain.compiler.capture as capture
    import functrain.compiler.estimate as estimate

    capture.preload()
    capture.wait_for_imports()
    traces, walks = [], []
    real_trace, real_walk = capture._trace, estimate.estimate_graph
    monkeypatch.setattr(capture, "_trace", lambda *a, **k: traces.append(threading.current_thread().name)
                        or real_trace(*a, **k))
    monkeypatch.setattr(estimate, "estimate_graph", lambda *a, **k: walks.append(threading.current_thread().name)
                        or real_walk(*a, **k))
    trainer = _train(tmp_path, 20)
    out = capsys.readouterr().out.splitlines()
    lines = [line for line in out if line.startswith("memory per rank on cpu: state ")]
    assert len(lines) == 1, out
    progress = trainer.run_step.progress
    assert progress.traced, progress  # (the background compile traced the step: the line is from that trace)
    assert "step peak +" in lines[0], lines[0]
    main = threading.main_thread().name
    assert traces.count(main) == 1, traces  # the background compile's trace, and no other
    assert walks == ["functrain-memory-line"], walks


class Breaks(Model):
    def forward(self, x, y):
        loss = torch.nn.functional.mse_loss(self.fc(x), y)
        return loss * (1.0 if float(loss) < 1e9 else 0.0)  # a host read: the background trace fails


def test_a_failed_background_compile_is_said_in_the_memory_line(tmp_path, capsys):
    """The background trace fails (a graph break): the line gives the state's bytes and says the compile failed (not
    that the peak needs compile=True, which is on), like Progress and the summary."""
    import functrain.compiler.capture as capture

    capture.preload()
    capture.wait_for_imports()
    torch.manual_seed(0)
    x = torch.randn(64, 4)
    data = torch.utils.data.TensorDataset(x, x[:, :1] * 0.5)
    config = ft.TrainConfig(train_batch_size=8, train_num_steps=4, save_and_sample_every=4, log_every=4,
                            results_folder=str(tmp_path), trackers=("jsonl",))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = ft.Trainer(Breaks(), data, config)
        trainer.train()
    out = capsys.readouterr().out.splitlines()
    lines = [line for line in out if line.startswith("memory per rank on cpu: state ")]
    assert trainer.run_step.progress.phase == "failed"
    assert len(lines) == 1 and lines[0].endswith("(the step's peak unknown: the background compile failed, the steps "
                                                 "run eagerly)"), lines
    assert any("the background compile failed" in line for line in out), out
