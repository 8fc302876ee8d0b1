"""Quick to start (issue 29): a run imports only what it uses.

``import functrain`` imports no compiler (Dynamo, inductor), no plotting (matplotlib), no tracker package and no
image library; an eager Trainer (``compile=False``) on 2 real processes over gloo builds and trains its first steps
without Dynamo or inductor (torch's eager functional all-reduce imported both at its first call: seconds of the
first step), and draws nothing before its first plot. Each check runs in fresh processes (``sys.modules`` of a
pytest process says nothing). The tracker packages alone: tests/trainer/test_trackers_api.py.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from functrain.distributed import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COMPILER = ("torch._dynamo", "torch._inductor")
HEAVY = COMPILER + ("matplotlib", "tensorboard", "torch.utils.tensorboard", "wandb", "mlflow", "PIL", "sympy")


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}


def test_import_functrain_imports_no_compiler_plotting_or_tracker():
    code = (f"import sys, json, functrain as ft; "
            f"print(json.dumps(sorted(m for m in sys.modules if m in {HEAVY!r} or m.startswith('torch._inductor.'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=_env())
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [], out.stdout


def test_an_eager_two_process_trainer_never_imports_the_compiler(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(f"""
        import json, os, sys
        import torch
        import functrain as ft

        def heavy():
            return sorted(m for m in {HEAVY!r} if m in sys.modules)

        class Model(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = torch.nn.Linear(4, 1)

            def forward(self, x, y):
                return torch.nn.functional.mse_loss(self.lin(x), y)

        g = torch.Generator().manual_seed(0)
        data = torch.utils.data.TensorDataset(torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g))
        config = ft.TrainConfig(train_batch_size=16, train_num_steps=4, compile=False, log_every=2,
                                save_and_sample_every=1000, results_folder={str(tmp_path / "results")!r})
        trainer = ft.Trainer(Model(), data, config)
        built = heavy()
        trainer.train()
        print("RESULT", json.dumps({{"rank": os.environ["RANK"], "built": built, "trained": heavy()}}), flush=True)
    """))
    cmd = [sys.executable, "-m", "functrain.launch", "--nproc", "2", "--master-port", str(free_port()), str(script)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=_env(), cwd=str(tmp_path))
    assert out.returncode == 0, (out.stdout[-3000:], out.stderr[-3000:])
    results = [json.loads(line.split("RESULT", 1)[1]) for line in out.stdout.splitlines() if "RESULT" in line]
    assert sorted(r["rank"] for r in results) == ["0", "1"], out.stdout[-3000:]
    for r in results:
        assert r["built"] == [], r  # building an eager Trainer: no compiler, no plotting, no tracker
        # after training: no compiler (its end draws the metrics plot: matplotlib, which imports Pillow, is there)
        assert set(r["trained"]) <= {"matplotlib", "PIL"}, r
