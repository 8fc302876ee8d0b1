"""Compile once, reuse everywhere (issue 40): a Trainer's step precompiled with one run length, lr and warm-up serves
a later process's run with other ones (and its resume with more steps) without compiling: the numbers are inputs of
the graph, not constants. The precompile builds a package (``TrainConfig(compile_package=True)``) and a warm
entry; each later run loads it before any trace and runs compiled from its first step, importing neither Dynamo,
inductor nor sympy. Real processes on one fresh functrain and inductor cache folder; each compiled run equals a fresh
eager run with its numbers, to rounding."""
import json
import os
import subprocess
import sys

import torch

import functrain as ft

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CHILD = r"""
import json, sys
import torch
import functrain as ft
mode, steps, lr, warmup, folder = sys.argv[1:]


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 8), torch.nn.Linear(8, 1)

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.b(torch.tanh(self.a(x))), y)


torch.manual_seed(0)
data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
config = ft.TrainConfig(train_batch_size=8, train_lr=float(lr), train_num_steps=int(steps), lr_schedule="warmup_cosine",
                        warmup_steps=int(warmup), min_lr=1e-4, ema_decay=0.9, ema_update_after_step=0,
                        ema_update_every=1, results_folder=folder, compile=mode != "eager",
                        compile_switch_at=0 if mode == "run" else None, log_every=1, save_and_sample_every=1000,
                        compile_package=True,
                        seed=0, trackers=("jsonl",))
trainer = ft.Trainer(Model(), data, config)
if mode == "pre":
    trainer.precompile()
    state = None
else:
    state = trainer.train()
imported = sorted(m for m in ("torch._dynamo", "torch._inductor", "sympy") if m in sys.modules)
print("RESULT " + json.dumps({"imported": imported}))
if state is not None:
    torch.save({"params": state.params, "ema": state.ema, "hyper": ft.get_hyper(state)}, folder + "/final.pt")
"""


def _child(tmp_path, mode, steps, lr, warmup, folder):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHINDUCTOR_", "FUNCTRAIN_CACHE"))}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=ROOT, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"),
               FUNCTRAIN_CACHE_DIR=str(tmp_path / "memo"))
    proc = subprocess.run([sys.executable, "-c", CHILD, mode, str(steps), str(lr), str(warmup), str(folder)], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):]), proc.stdout


def _entries(tmp_path):
    return sorted(os.listdir(tmp_path / "memo" / "packages"))


def _close(a, b):
    return ft.tree.tree_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_a_precompiled_step_serves_other_lengths_lrs_warmups_and_a_longer_resume(tmp_path):
    pre, _ = _child(tmp_path, "pre", 400, 1e-3, 40, tmp_path / "pre")
    # the one compile: the package and its warm entry
    compiled = _entries(tmp_path)
    assert [p.rsplit(".", 1)[1] for p in compiled if not p.startswith("warm-")] == ["json", "pt2"], compiled
    assert len([p for p in compiled if p.startswith("warm-")]) == 1, compiled
    # another length, lr and warm-up: the package from step 1, no trace, nothing compiled, = eager with its numbers
    run, out = _child(tmp_path, "run", 6, 3e-2, 2, tmp_path / "run")
    assert run["imported"] == [], (run, out[-2000:])
    assert "compiled from step 1, no step ran eagerly: its code was loaded from a package before any trace" in out, \
        out[-2000:]
    log = [json.loads(x) for x in open(tmp_path / "run" / "metrics.jsonl")]
    assert [r.get("compile_source") for r in log if "compile_s" in r] == ["warm"], log
    assert _entries(tmp_path) == compiled
    eager, _ = _child(tmp_path, "eager", 6, 3e-2, 2, tmp_path / "eager")
    got, want = torch.load(tmp_path / "run" / "final.pt"), torch.load(tmp_path / "eager" / "final.pt")
    assert float(got["hyper"]["lr"]["warmup_cosine"]["total_steps"]) == 6
    assert ft.tree.tree_equal(got["hyper"], want["hyper"])
    assert _close(got["params"], want["params"]) and _close(got["ema"], want["ema"])
    # the job continued with more steps: the package again, the schedule on the new horizon (the resume line says so)
    more, out = _child(tmp_path, "run", 10, 3e-2, 2, tmp_path / "run")
    assert more["imported"] == [], (more, out[-2000:])
    assert "lr.warmup_cosine.total_steps 6 -> 10" in out, out[-2000:]
    assert _entries(tmp_path) == compiled
    _child(tmp_path, "eager", 10, 3e-2, 2, tmp_path / "eager")
    got, want = torch.load(tmp_path / "run" / "final.pt"), torch.load(tmp_path / "eager" / "final.pt")
    assert _close(got["params"], want["params"]) and _close(got["ema"], want["ema"])


def _launch(tmp_path, mode, steps, lr, warmup, folder):
    """The child on 2 gloo ranks under functrain's launcher (data parallel): each rank's RESULT line."""
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHINDUCTOR_", "FUNCTRAIN_CACHE"))}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=ROOT, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"),
               FUNCTRAIN_CACHE_DIR=str(tmp_path / "memo"))
    proc = subprocess.run([sys.executable, "-m", "functrain.launch", "--nproc", "2", str(script), mode, str(steps),
                           str(lr), str(warmup), str(folder)], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = [json.loads(x.split("RESULT ", 1)[1]) for x in proc.stdout.splitlines() if "RESULT " in x]
    assert len(results) == 2, proc.stdout[-3000:]
    return results, proc.stdout + proc.stderr


def test_a_precompiled_data_parallel_step_serves_a_later_run_on_two_ranks(tmp_path):
    """The same on 2 ranks: the step's graph holds the gradients' all-reduce, and its package runs in the GIL-free
    runner (tests/compiler/test_package_collectives.py proves why it must); the later run is compiled from step 1
    on both ranks, imports no compiler, and equals a 2-rank eager run."""
    _launch(tmp_path, "pre", 400, 1e-3, 40, tmp_path / "pre")
    compiled = _entries(tmp_path)
    assert len([p for p in compiled if p.endswith(".pt2")]) == 1, compiled
    assert len([p for p in compiled if p.startswith("warm-")]) == 1, compiled
    runs, out = _launch(tmp_path, "run", 6, 3e-2, 2, tmp_path / "run")
    assert [r["imported"] for r in runs] == [[], []], (runs, out[-2000:])
    assert "compiled from step 1, no step ran eagerly: its code was loaded from a package before any trace" in out, \
        out[-2000:]
    log = [json.loads(x) for x in open(tmp_path / "run" / "metrics.jsonl")]
    assert [r.get("compile_source") for r in log if "compile_s" in r] == ["warm"], log
    assert _entries(tmp_path) == compiled
    _launch(tmp_path, "eager", 6, 3e-2, 2, tmp_path / "eager")
    got, want = torch.load(tmp_path / "run" / "final.pt"), torch.load(tmp_path / "eager" / "final.pt")
    assert _close(got["params"], want["params"]) and _close(got["ema"], want["ema"])
