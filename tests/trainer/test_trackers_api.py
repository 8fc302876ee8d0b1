"""ft.trackers: the Trainer's trackers in your own loop, against the real packages.

W&B offline (records read back from its .wandb files), MLflow on a sqlite store in the folder (read back with
MlflowClient), TensorBoard (the event file read back with tensorboard's EventAccumulator), JSONL. The config is
logged once; metrics go out from the main process only (2 real processes over gloo: rank 1 writes nothing);
resuming continues the same runs with the steps after the resume point only.
"""
from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

import functrain as ft
from functrain.trainer.trackers import TrackerWarning, Trackers, make_trackers
from test_trackers import _mlflow_history, _mlflow_runs, _wandb_history, _wandb_records

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ALL = ["jsonl", "tensorboard", "wandb", "mlflow"]
CONFIG = {"lr": 0.1, "batch": 8, "betas": (0.9, 0.99), "name": "a|b"}
_ENV = ("WANDB_MODE", "WANDB_DIR", "WANDB_PROJECT", "WANDB_RUN_ID", "WANDB_RESUME", "MLFLOW_TRACKING_URI",
        "MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID", "MLFLOW_ALLOW_FILE_STORE", "RANK")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for var in _ENV:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")


def _needs_all():
    for package in ("wandb", "mlflow", "tensorboard"):
        pytest.importorskip(package)


def _jsonl_steps(folder):
    return [json.loads(line)["step"] for line in open(os.path.join(folder, "metrics.jsonl"))]


def _tensorboard(folder):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(os.path.join(folder, "tensorboard"), size_guidance={"tensors": 0, "scalars": 0})
    acc.Reload()
    return acc


def _tensorboard_config(acc):
    """(the config text table, the HParams plugin's session-start hparams {name: value})."""
    from tensorboard.plugins.hparams import plugin_data_pb2

    text = [t.tensor_proto.string_val[0].decode() for t in acc.Tensors("config/text_summary")]
    content = acc.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    start = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info
    values = {k: (v.string_value if v.HasField("string_value") else v.number_value) for k, v in start.hparams.items()}
    return text, values


def _wandb_config(folder, run_id):
    """Every config key W&B recorded for ``run_id`` (its offline .wandb files), with its JSON value."""
    found = {}
    for path in glob.glob(os.path.join(folder, "wandb", f"offline-run-*-{run_id}", f"run-{run_id}.wandb")):
        for rec in _wandb_records(path):
            kind = rec.WhichOneof("record_type")
            items = rec.config.update if kind == "config" else rec.run.config.update if kind == "run" else ()
            for item in items:
                found[item.key] = json.loads(item.value_json)
    return found


def test_ft_trackers_opens_the_four_trackers_logs_the_config_once_and_each_step(tmp_path):
    _needs_all()
    folder = str(tmp_path / "run")
    with ft.trackers(ALL, folder, config=CONFIG) as run:
        assert isinstance(run, Trackers) and run.main
        assert [t.label for t in run.trackers] == ALL
        for step in range(1, 6):  # a device-style value (a 0-dim tensor) and a host float
            run.log({"loss": torch.tensor(1.0 / step, dtype=torch.float64), "lr": 0.1}, step=step)
    run.close()  # again: nothing happens
    # JSONL: each step once, metrics only
    assert _jsonl_steps(folder) == [1, 2, 3, 4, 5]
    # TensorBoard: the scalars, and the config once as a text table and as the HParams record
    acc = _tensorboard(folder)
    assert [e.step for e in acc.Scalars("loss")] == [1, 2, 3, 4, 5]
    (text,), hparams = _tensorboard_config(acc)
    assert "| lr | 0.1 |" in text and "| betas | (0.9, 0.99) |" in text and "| name | a\\|b |" in text, text
    assert hparams == {"lr": pytest.approx(0.1), "batch": 8.0, "betas": "(0.9, 0.99)", "name": "a|b"}
    # W&B: one run, the config, each step once
    runs = json.load(open(os.path.join(folder, "trackers.json")))
    run_id = runs["wandb"]["run_id"]
    files, run_ids, steps = _wandb_history(folder, run_id)
    assert len(files) == 1 and run_ids == {run_id}
    assert steps == [(s, pytest.approx(1.0 / s)) for s in range(1, 6)]
    config = _wandb_config(folder, run_id)
    assert config["lr"] in (0.1, {"value": 0.1}) and config["batch"] in (8, {"value": 8}), config
    # MLflow: one run, the config as params, each step once
    uri = "sqlite:///" + os.path.join(folder, "mlflow.db")
    (mrun,) = _mlflow_runs(uri)
    assert mrun.data.params == {"lr": "0.1", "batch": "8", "betas": "(0.9, 0.99)", "name": "a|b"}
    assert _mlflow_history(uri, mrun.info.run_id) == [(s, pytest.approx(1.0 / s)) for s in range(1, 6)]
    assert mrun.info.status == "FINISHED"


def test_resume_continues_the_same_runs_with_the_steps_after_the_resume_point(tmp_path):
    """Steps 1..5 logged, the checkpoint at 3, resumed: steps 4..7 again. One W&B run and one MLflow run with
    each step once (4, 5 already there: not logged twice), metrics.jsonl appended (its 4, 5 dropped first, then
    4..7), TensorBoard's events past 3 purged; the config is not written to TensorBoard a second time."""
    _needs_all()
    folder = str(tmp_path / "run")
    with ft.trackers(ALL, folder, config=CONFIG) as run:
        for step in range(1, 6):
            run.log({"loss": 1.0 / step}, step)
    first = json.load(open(os.path.join(folder, "trackers.json")))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ft.trackers(ALL, folder, config=CONFIG, resume_step=3) as run:
            for step in range(4, 8):
                run.log({"loss": 1.0 / step}, step)
    again = [str(w.message) for w in caught if issubclass(w.category, TrackerWarning)]
    assert any("'wandb'" in m and "steps 4..5 are not logged again" in m for m in again), again
    assert any("'mlflow'" in m and "steps 4..5 are not logged again" in m for m in again), again
    second = json.load(open(os.path.join(folder, "trackers.json")))
    assert second["wandb"]["run_id"] == first["wandb"]["run_id"]
    assert second["mlflow"]["run_id"] == first["mlflow"]["run_id"]
    assert _jsonl_steps(folder) == list(range(1, 8))
    acc = _tensorboard(folder)
    assert [e.step for e in acc.Scalars("loss")] == list(range(1, 8))
    assert len(acc.Tensors("config/text_summary")) == 1
    run_id = first["wandb"]["run_id"]
    files, run_ids, steps = _wandb_history(folder, run_id)
    assert len(files) == 2 and run_ids == {run_id}  # one offline folder per session, one run
    assert [s for s, _ in steps] == list(range(1, 8))
    uri = "sqlite:///" + os.path.join(folder, "mlflow.db")
    (mrun,) = _mlflow_runs(uri)
    assert [s for s, _ in _mlflow_history(uri, mrun.info.run_id)] == list(range(1, 8))


def test_the_trainers_trackers_are_opened_through_the_public_object(tmp_path, monkeypatch):
    """make_trackers (the Trainer's path) opens a Trackers: its TensorBoard holds the config too."""
    pytest.importorskip("tensorboard")
    opened = []
    real = Trackers.__init__

    def spy(self, *args, **kwargs):
        real(self, *args, **kwargs)
        opened.append(self)

    monkeypatch.setattr(Trackers, "__init__", spy)
    trackers = make_trackers(["jsonl", "tensorboard"], str(tmp_path), {"lr": 0.5}, resume_step=0)
    assert len(opened) == 1 and opened[0].trackers is trackers and opened[0].main
    for t in trackers:
        t.log(1, {"loss": 1.0})
        t.close()
    (text,), hparams = _tensorboard_config(_tensorboard(str(tmp_path)))
    assert "| lr | 0.5 |" in text and hparams == {"lr": 0.5}


def test_bad_arguments_are_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="unknown tracker 'comet'.*'jsonl', 'tensorboard', 'wandb', 'mlflow'"):
        ft.trackers(["jsonl", "comet"], str(tmp_path))
    with pytest.raises(TypeError, match="config must be a dict.*got list"):
        ft.trackers("jsonl", str(tmp_path), config=[("lr", 0.1)])
    with pytest.raises(TypeError, match="str keys.*with key 3"):
        ft.trackers("jsonl", str(tmp_path), config={3: "x"})
    with pytest.raises(ValueError, match="resume_step must be an int >= 0; got -1"):
        ft.trackers("jsonl", str(tmp_path), resume_step=-1)
    run = ft.trackers("jsonl", str(tmp_path))
    with pytest.raises(TypeError, match=r"got int \(the order is log\(metrics, step\)\)"):
        run.log(3, {"loss": 1.0})
    with pytest.raises(TypeError, match="metric 'loss' is a list"):
        run.log({"loss": [1.0]}, 1)
    with pytest.raises(ValueError, match="step must be an int >= 0; got 1.5"):
        run.log({"loss": 1.0}, 1.5)
    run.close()
    with pytest.raises(ValueError, match="after close"):
        run.log({"loss": 1.0}, 2)
    assert not os.path.getsize(tmp_path / "metrics.jsonl")  # nothing bad was written


def test_a_process_whose_rank_is_not_0_logs_nothing(tmp_path, monkeypatch):
    """Without a process group, a launcher's RANK decides: RANK=1 gets an object that checks and does nothing."""
    monkeypatch.setenv("RANK", "1")
    with ft.trackers(["jsonl", "tensorboard"], str(tmp_path / "r"), config={"lr": 0.1}) as run:
        assert not run.main and run.trackers == []
        run.log({"loss": 1.0}, 1)
        with pytest.raises(TypeError, match="order"):
            run.log(1, {"loss": 1.0})
    assert not (tmp_path / "r").exists()


WORKER = textwrap.dedent("""
    import datetime, json, os, sys
    import torch, torch.distributed as dist
    import functrain as ft

    folder = sys.argv[1]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    with ft.trackers(["jsonl", "tensorboard", "wandb", "mlflow"], folder, config={"lr": 0.1, "world": 2}) as run:
        report = {"rank": rank, "main": run.main, "n": len(run.trackers)}
        for step in range(1, 5):
            dist.barrier()  # both ranks log each step at the same moment
            run.log({"loss": torch.tensor(1.0 / step), "rank": rank}, step=step)
    dist.barrier()
    print("REPORT " + json.dumps(report), flush=True)
    dist.destroy_process_group()
""")


def test_on_two_processes_only_rank_0_writes(tmp_path):
    """2 ranks over gloo both open the four trackers on one folder and log each step: rank 1's object has no
    trackers; the folder holds one run of each, with each step once, all from rank 0."""
    _needs_all()
    from functrain.distributed import free_port

    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    folder = str(tmp_path / "run")
    port = free_port()
    procs = []
    for rank in (0, 1):
        env = {k: v for k, v in os.environ.items() if k not in _ENV}
        env.update(OMP_NUM_THREADS="1", PYTHONPATH=ROOT, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, str(script), folder], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=300)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    reports = []
    for out in outs:
        lines = [ln for ln in out.splitlines() if ln.startswith("REPORT ")]
        reports.append(json.loads(lines[-1][7:]) if lines else None)
    assert reports[0] is not None and reports[1] is not None, outs[0][-3000:] + outs[1][-3000:]
    assert reports[0] == {"rank": 0, "main": True, "n": 4}
    assert reports[1] == {"rank": 1, "main": False, "n": 0}
    records = [json.loads(line) for line in open(os.path.join(folder, "metrics.jsonl"))]
    assert [r["step"] for r in records] == [1, 2, 3, 4] and {r["rank"] for r in records} == {0}
    assert len(glob.glob(os.path.join(folder, "tensorboard", "events.out.tfevents.*"))) == 1
    acc = _tensorboard(folder)
    assert [e.step for e in acc.Scalars("loss")] == [1, 2, 3, 4] and {e.value for e in acc.Scalars("rank")} == {0}
    assert len(glob.glob(os.path.join(folder, "wandb", "offline-run-*"))) == 1
    run_id = json.load(open(os.path.join(folder, "trackers.json")))["wandb"]["run_id"]
    _, run_ids, steps = _wandb_history(folder, run_id)
    assert run_ids == {run_id} and [s for s, _ in steps] == [1, 2, 3, 4]
    uri = "sqlite:///" + os.path.join(folder, "mlflow.db")
    (mrun,) = _mlflow_runs(uri)
    assert mrun.data.params == {"lr": "0.1", "world": "2"}
    assert [s for s, _ in _mlflow_history(uri, mrun.info.run_id, "rank")] == [1, 2, 3, 4]
    assert {v for _, v in _mlflow_history(uri, mrun.info.run_id, "rank")} == {0.0}


def test_import_functrain_imports_no_tracker_package():
    """ft.trackers is exported; no tracker package (nor torch's tensorboard writer) is imported until a tracker
    opens."""
    code = ("import sys, functrain as ft; assert callable(ft.trackers) and 'trackers' in ft.__all__; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('wandb', 'mlflow', 'tensorboard') "
            "or m.startswith('torch.utils.tensorboard')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout
