"""The Trainer's memory line: rank 0 prints ft.memory's estimate once, before the first step (compiled: state and
step peak from the capture the first step compiles; eager: the state's bytes), or, for a background compile that
switches when ready, after the step whose call traced it (from that trace: the first step waits for nothing)."""
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


def _train(tmp_path, compile, steps=3, **kw):
    torch.manual_seed(0)
    x = torch.randn(64, 4)
    data = torch.utils.data.TensorDataset(x, x[:, :1] * 0.5)
    config = ft.TrainConfig(train_batch_size=8, train_num_steps=steps, save_and_sample_every=steps, compile=compile,
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


def test_a_background_compile_prints_the_line_from_its_own_trace_after_the_step_that_made_it(tmp_path, capsys,
                                                                                           monkeypatch):
    """The default background compile (switch when ready): nothing is traced for the line; the step whose call
    traced the graph for the worker is followed by the line, with the step peak of that very capture (one trace
    in the run). The compiler's imports are made first, so the first call traces before its eager step (so that
    code already in the caches would run from step 1: the compile policy's order, issue 29)."""
    import functrain.compiler.runtime as runtime
    from functrain.compiler.capture import preload, wait_for_imports

    preload()
    wait_for_imports()
    # an empty inductor cache: this module's other tests compiled the same graph, which would load at step 1
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    eager_steps, traces = [], []
    real, host_call = runtime.trace, ft.Step.host_call
    monkeypatch.setattr(ft.Step, "host_call", lambda *a, **k: eager_steps.append(1) or host_call(*a, **k))
    monkeypatch.setattr(runtime, "trace", lambda *a, **k: traces.append(len(eager_steps)) or real(*a, **k))
    trainer = _train(tmp_path, compile=True, compile_background=True, steps=6)
    out = capsys.readouterr().out.splitlines()
    lines = [i for i, line in enumerate(out) if line.startswith("memory per rank on cpu: state ")]
    assert len(lines) == 1, out
    assert "step peak +" in out[lines[0]] and "params 20 B" in out[lines[0]], out[lines[0]]
    assert traces == [0], traces  # one trace, the background compile's, in the first call before its eager step
    assert trainer.run_step.progress is not None and trainer.run_step.progress.eager_calls >= 1


def test_the_line_never_makes_a_step_wait_for_the_compilers_imports(tmp_path, capsys, monkeypatch):
    """While the compiler's modules are still being imported (a thread does it while the first steps run eagerly),
    the background compile does not trace yet, and neither may the memory line: it would make the training thread
    wait for the imports. Here the imports never finish during the run (a stand-in thread), so nothing is traced
    and, the run ending before the trace, no line is printed."""
    import threading

    import functrain.compiler.capture as capture
    import functrain.compiler.runtime as runtime

    done = threading.Event()
    importing = threading.Thread(target=done.wait, args=(60,), daemon=True)  # imports that are still running
    importing.start()
    monkeypatch.setattr(capture, "_preloading", importing)
    traces = []
    real = runtime.trace
    monkeypatch.setattr(runtime, "trace", lambda *a, **k: traces.append(1) or real(*a, **k))
    try:
        trainer = _train(tmp_path, compile=True, compile_background=True, steps=6)
    finally:
        done.set()
        importing.join(10)
    out = capsys.readouterr().out.splitlines()
    assert traces == [], "a step waited for the compiler's imports to trace the graph"
    assert not [line for line in out if line.startswith("memory per rank on cpu: state ")], out
    assert trainer.run_step.progress.eager_calls == 6 and not trainer.run_step.progress.traced
