"""The examples run end to end on a short schedule (subprocesses with timeouts)."""
import importlib.util
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, "FUNCTRAIN_DIST_TIMEOUT": "60"}


def _run(args, timeout=420):
    out = subprocess.run([sys.executable, *args], cwd=ROOT, env=ENV, capture_output=True, text=True,
                         timeout=timeout)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


def test_digits_classifier_learns():
    pytest.importorskip("sklearn")
    out = _run(["examples/digits.py", "--steps", "300"])
    acc = float(re.search(r"test accuracy ([0-9.]+)", out).group(1))
    assert acc > 0.9, out[-1000:]


def test_diffusion_trainer_on_two_processes_resumes(tmp_path):
    pytest.importorskip("sklearn")
    results = tmp_path / "diffusion"
    args = ["-m", "functrain.launch", "--nproc", "2", "examples/diffusion.py", "--results", str(results),
            "--save-every", "20", "--batch-size", "32"]
    out = _run(args + ["--steps", "40"])
    plot = "metrics.png" if importlib.util.find_spec("matplotlib") else "metrics.svg"
    for name in ("sample-20.png", "sample-40.png", plot, "metrics.jsonl", "config.json", "model.safetensors",
                 "ema.safetensors"):
        assert (results / name).exists(), name
    assert sorted(os.listdir(results / "checkpoints")) == ["step_00000020", "step_00000040"]
    assert "finished step 40/40" in out and str(results / "ema.safetensors") in out  # the end-of-run summary
    log = [json.loads(line) for line in open(results / "metrics.jsonl")]
    evals = [r for r in log if "eval_loss" in r]
    assert [r["step"] for r in evals] == [20, 40] and all(r["eval_samples"] == 197 for r in evals)
    assert all(np.isfinite(r["eval_loss"]) and np.isfinite(r["eval_loss_ema"]) for r in evals)
    lr = {r["step"]: r["lr"] for r in log}
    assert lr[20] > lr[40] > 0  # warmup (4 updates) then a cosine decay to min_lr
    out = _run(args + ["--steps", "60"])  # run again, longer: it resumes
    assert "resumed from" in out and "at step 40" in out
    # the schedule continues to the new horizon (and the longer run's warm-up), said in the resume line
    assert "lr.warmup_cosine.total_steps 40 -> 60" in out and "lr.warmup_cosine.warmup_steps 4 -> 6" in out, out
    assert (results / "sample-60.png").exists()
    # the resume line says that the lr goes back up (a 60-step cosine at step 40), and a finished job's hint names
    # the script's flag, not the config field it sets
    assert "lr schedule: warmup_cosine over train_num_steps 60 (was 40): the next update's lr is " in out, out[-2000:]
    out = _run(args + ["--steps", "60"])
    assert f"{results} is at step 60 of --steps 60: nothing to train. To train on, run again with a larger --steps " \
           "(e.g. --steps 120)" in out and "train_num_steps" not in out, out[-2000:]


def test_language_model_with_token_normalisation():
    out = _run(["examples/lm.py", "--steps", "40", "--self-written"])
    final = float(re.search(r"final loss ([0-9.]+)", out).group(1))
    assert final < 2.5, out[-1500:]  # uniform over 31 tokens would be ln 31 = 3.43


@pytest.mark.parametrize("steps", [1, 5])
def test_language_model_transformers_gpt2_any_steps(steps):
    """The GPT-2 path (a transformers model built from a config) runs for any --steps, with no warnings about
    token ids outside its vocabulary (a run shorter than the warmup used to fail)."""
    pytest.importorskip("transformers")
    out = subprocess.run([sys.executable, "-W", "always", "examples/lm.py", "--steps", str(steps), "--no-compile"],
                         cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "transformers GPT-2: final loss" in out.stdout
    assert "token_id" not in out.stderr, out.stderr[-2000:]


def test_the_diffusion_examples_digits_are_scikit_learns_without_importing_it():
    """examples/diffusion.py reads the digits from the file scikit-learn ships (its import is ~1 s of each rank's
    start-up): the same images as ``load_digits().images``, bitwise, and scikit-learn not imported."""
    pytest.importorskip("sklearn")
    code = ("import sys, numpy as np; sys.path.insert(0, 'examples'); import diffusion; "
            "x = diffusion.digits_images(); imported = 'sklearn' in sys.modules; "
            "from sklearn.datasets import load_digits; y = load_digits().images; "
            "print(imported, x.dtype == y.dtype, x.shape == y.shape and bool(np.array_equal(x, y)))")
    assert _run(["-c", code], timeout=120).split() == ["False", "True", "True"]
