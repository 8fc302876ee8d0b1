"""Trackers against the real packages: W&B (offline, records read back from its .wandb files) and MLflow
(sqlite store, read back with MlflowClient); resume continues one run; failures warn once and training goes on."""
from __future__ import annotations

import glob
import json
import os
import struct
import time
import warnings

import pytest

from functrain.trainer.trackers import TRACKERS, TrackerWarning, check_trackers, make_trackers


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for var in ("WANDB_MODE", "WANDB_DIR", "WANDB_PROJECT", "WANDB_RUN_ID", "WANDB_RESUME", "MLFLOW_TRACKING_URI",
                "MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID", "MLFLOW_ALLOW_FILE_STORE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")  # keep pytest's capture of stdout/stderr
    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")


def _session(names, folder, steps, resume_step=0, close=True, config=None):
    """One training session: open the trackers, log ``steps``, close them (unless simulating a kill)."""
    trackers = make_trackers(names, str(folder), config or {"lr": 0.1, "batch": 8}, resume_step=resume_step)
    for s in steps:
        for t in trackers:
            t.log(s, {"loss": 1.0 / s, "lr": 0.1})
    if close:
        for t in trackers:
            t.close()
    return trackers


def _tracker_warnings(record):
    return [w for w in record if issubclass(w.category, TrackerWarning)]


# -- names, protocol, user objects, failures -----------------------------------------------------
def test_unknown_tracker_name_lists_the_known_ones(tmp_path):
    with pytest.raises(ValueError, match="unknown tracker 'comet'.*'jsonl', 'tensorboard', 'wandb', 'mlflow'"):
        check_trackers(["jsonl", "comet"])
    with pytest.raises(ValueError, match="comet"):
        make_trackers(["comet"], str(tmp_path))
    with pytest.raises(TypeError, match=r"log\(step: int, metrics: dict\).*got int"):
        check_trackers(["jsonl", 3])
    assert check_trackers("jsonl") == ("jsonl",)
    assert set(TRACKERS) == {"jsonl", "tensorboard", "wandb", "mlflow"}


class Recorder:
    def __init__(self):
        self.logged, self.closed = [], 0

    def log(self, step, metrics):
        self.logged.append((step, dict(metrics)))

    def close(self):
        self.closed += 1


def test_user_tracker_object_receives_every_log(tmp_path):
    rec = Recorder()
    check_trackers([rec, "jsonl"])
    _session([rec, "jsonl"], tmp_path, range(1, 4))
    assert rec.logged == [(s, {"loss": 1.0 / s, "lr": 0.1}) for s in (1, 2, 3)]
    assert rec.closed == 1
    lines = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    assert [x["step"] for x in lines] == [1, 2, 3]


class Flaky:
    """Fails on its second log."""

    def __init__(self):
        self.calls = 0

    def log(self, step, metrics):
        self.calls += 1
        if self.calls == 2:
            raise RuntimeError("disk full")


class NoClose:
    def __init__(self):
        self.steps = []

    def log(self, step, metrics):
        self.steps.append(step)


def test_failing_tracker_warns_once_and_the_others_go_on(tmp_path):
    flaky, rec, plain = Flaky(), Recorder(), NoClose()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trackers = _session([flaky, rec, plain], tmp_path, range(1, 6))
    found = _tracker_warnings(record)
    assert "switched off after RuntimeError in log()" in trackers[0].where()
    assert len(found) == 1, [str(w.message) for w in found]
    assert "'Flaky'" in str(found[0].message) and "RuntimeError: disk full" in str(found[0].message)
    assert flaky.calls == 2  # switched off after the failure
    assert [s for s, _ in rec.logged] == [1, 2, 3, 4, 5] and rec.closed == 1
    assert plain.steps == [1, 2, 3, 4, 5]  # close() is optional


def test_mlflow_refused_store_warns_once_and_training_goes_on(tmp_path, monkeypatch):
    # MLflow 3 refuses the file store unless MLFLOW_ALLOW_FILE_STORE=true: the old default crashed the Trainer.
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "file://" + str(tmp_path / "mlruns"))
    rec = Recorder()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trackers = _session(["mlflow", rec], tmp_path, range(1, 4))
    found = _tracker_warnings(record)
    assert len(found) == 1 and "'mlflow' could not start" in str(found[0].message)
    assert len(trackers) == 1 and [s for s, _ in rec.logged] == [1, 2, 3]


def test_mlflow_failure_while_logging_warns_once(tmp_path):
    pytest.importorskip("mlflow")
    trackers = make_trackers(["mlflow"], str(tmp_path), {})
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for s in range(1, 4):
            trackers[0].log(s, {"bad key!": 1.0})  # MLflow refuses the name: a real failure in log()
        trackers[0].close()
    found = _tracker_warnings(record)
    assert len(found) == 1 and "'mlflow' failed in log()" in str(found[0].message)


# -- MLflow ---------------------------------------------------------------------------------------
def _mlflow_history(uri, run_id, key="loss"):
    from mlflow.tracking import MlflowClient

    return [(m.step, m.value) for m in sorted(MlflowClient(uri).get_metric_history(run_id, key), key=lambda m: m.step)]


def _mlflow_runs(uri, experiment="functrain"):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment)
    return [] if exp is None else client.search_runs([exp.experiment_id])


def test_mlflow_resume_continues_one_run(tmp_path):
    mlflow = pytest.importorskip("mlflow")
    before = mlflow.get_tracking_uri()
    _session(["mlflow"], tmp_path, range(1, 6))
    with pytest.warns(TrackerWarning, match=r"params \['lr'\] changed since run"):
        _session(["mlflow"], tmp_path, range(6, 11), resume_step=5, config={"lr": 0.2, "batch": 8})
    uri = "sqlite:///" + str(tmp_path / "mlflow.db")  # the default store: in the results folder
    runs = _mlflow_runs(uri)
    assert len(runs) == 1
    run = runs[0]
    assert run.info.status == "FINISHED"
    assert _mlflow_history(uri, run.info.run_id) == [(s, 1.0 / s) for s in range(1, 11)]
    assert run.data.params == {"lr": "0.1", "batch": "8"}  # params are immutable in MLflow: the first values
    assert json.load(open(tmp_path / "trackers.json"))["mlflow"]["run_id"] == run.info.run_id
    assert mlflow.get_tracking_uri() == before  # mlflow's global state is left alone


def test_mlflow_resume_after_kill_logs_each_step_once(tmp_path):
    pytest.importorskip("mlflow")
    _session(["mlflow"], tmp_path, range(1, 9), close=False)  # killed at step 8, last checkpoint at 5
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _session(["mlflow"], tmp_path, range(6, 11), resume_step=5)
    assert any("steps 6..8 are not logged again" in str(w.message) for w in _tracker_warnings(record))
    uri = "sqlite:///" + str(tmp_path / "mlflow.db")
    (run,) = _mlflow_runs(uri)
    assert _mlflow_history(uri, run.info.run_id) == [(s, 1.0 / s) for s in range(1, 11)]


def test_mlflow_honours_its_env_and_a_fresh_run_is_a_new_run(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    uri = "sqlite:///" + str(tmp_path / "elsewhere.db")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "mine")
    results = tmp_path / "results"
    _session(["mlflow"], results, range(1, 4))
    _session(["mlflow"], results, range(1, 3), resume_step=0)  # no checkpoint: a fresh run
    assert not (results / "mlflow.db").exists()
    runs = _mlflow_runs(uri, "mine")
    assert len(runs) == 2
    assert sorted(len(_mlflow_history(uri, r.info.run_id)) for r in runs) == [2, 3]


# -- W&B (offline) --------------------------------------------------------------------------------
def _wandb_records(path):
    """Every record of a W&B transaction log (``run-<id>.wandb``), decoded with wandb's own protobuf classes.

    The file is a 7-byte header (``:W&B``, magic 0xBEE1, version 0) then LevelDB-log blocks of 32 KiB: each
    chunk is crc32 (4 bytes), length (2), type (1: full, 2: first, 3: middle, 4: last) and the payload.
    """
    from wandb.proto import wandb_internal_pb2 as pb

    data = open(path, "rb").read()
    assert data[:4] == b":W&B" and struct.unpack("<HB", data[4:7]) == (0xBEE1, 0), data[:7]
    pos, block, records, pending = 7, 32768, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a chunk header is padding
            pos += left
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if crc == 0 and length == 0 and kind == 0:
            break
        payload = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        pending += payload
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(pending)
            records.append(rec)
            pending = b""
    return records


def _wandb_history(folder, run_id):
    """``[(step, loss)]`` over all offline sessions of ``run_id`` under ``folder`` (as ``wandb sync`` uploads them)."""
    files = sorted(glob.glob(os.path.join(folder, "wandb", f"offline-run-*-{run_id}", f"run-{run_id}.wandb")))
    steps, run_ids = [], set()
    for path in files:
        # run.finish() returns before wandb-core has written everything: wait for the run's exit record.
        deadline = time.monotonic() + 30
        while not any(r.WhichOneof("record_type") == "exit" for r in _wandb_records(path)):
            assert time.monotonic() < deadline, f"{path} has no exit record after 30 s"
            time.sleep(0.1)
        for rec in _wandb_records(path):
            kind = rec.WhichOneof("record_type")
            if kind == "run":
                run_ids.add(rec.run.run_id)
            elif kind == "history":
                items = {i.key or ".".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
                assert items["_step"] == rec.history.step.num
                steps.append((rec.history.step.num, items["loss"]))
    return files, run_ids, steps


def test_wandb_offline_resume_continues_one_run(tmp_path):
    pytest.importorskip("wandb")
    _session(["wandb"], tmp_path, range(1, 6))
    run_id = json.load(open(tmp_path / "trackers.json"))["wandb"]["run_id"]
    _session(["wandb"], tmp_path, range(6, 11), resume_step=5)
    assert json.load(open(tmp_path / "trackers.json"))["wandb"]["run_id"] == run_id
    files, run_ids, steps = _wandb_history(str(tmp_path), run_id)
    assert len(files) == 2, os.listdir(tmp_path / "wandb")  # one offline folder per session, both for this run id
    assert run_ids == {run_id}
    assert steps == [(s, pytest.approx(1.0 / s)) for s in range(1, 11)]


def test_wandb_resume_after_kill_logs_each_step_once(tmp_path):
    pytest.importorskip("wandb")
    # Steps 1..8 logged, the last checkpoint at 5. (The session is closed so that its records are flushed, as a
    # killed process leaves them on disk; what matters is resuming at 5 after 8 was logged.)
    _session(["wandb"], tmp_path, range(1, 9))
    run_id = json.load(open(tmp_path / "trackers.json"))["wandb"]["run_id"]
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _session(["wandb"], tmp_path, range(6, 11), resume_step=5)
    assert any("steps 6..8 are not logged again" in str(w.message) for w in _tracker_warnings(record))
    _, run_ids, steps = _wandb_history(str(tmp_path), run_id)
    assert run_ids == {run_id}
    assert [s for s, _ in steps] == list(range(1, 11))


def test_wandb_honours_wandb_mode_and_dir(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "disabled")
    results = tmp_path / "results"
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _session(["wandb"], results, range(1, 3))
    assert not _tracker_warnings(record), [str(w.message) for w in record]
    assert not glob.glob(str(results / "wandb" / "*run-*"))  # disabled: no run folder anywhere here
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wb"))
    (tracker,) = _session(["wandb"], results, range(1, 3))
    assert glob.glob(str(tmp_path / "wb" / "wandb" / "offline-run-*"))
    assert "wandb sync" in tracker.where() and str(tmp_path / "wb") in tracker.where()


# -- TensorBoard ----------------------------------------------------------------------------------
def test_tensorboard_resume_after_kill_purges_the_rewound_steps(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _session(["tensorboard"], tmp_path, range(1, 9))  # logged to 8, last checkpoint at 5
    _session(["tensorboard"], tmp_path, range(6, 11), resume_step=5)
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    events = acc.Scalars("loss")
    assert [e.step for e in events] == list(range(1, 11))
    assert [e.value for e in events] == pytest.approx([1.0 / s for s in range(1, 11)])


def test_the_test_extra_installs_mlflows_client_not_its_server():
    """``[test]`` pulled the full ``mlflow`` (its server and UI: Flask, FastAPI, SQLAlchemy's migrations, gunicorn,
    docker, graphene, huey): 160 packages resolved for the extra, 139 with the client. The tracker needs the client
    and the sqlite store: mlflow-skinny, SQLAlchemy and alembic, against which the MLflow tests above run (checked
    with only mlflow-skinny's files importable as ``mlflow`` and the full package's own dependencies hidden)."""
    import re

    tomllib = pytest.importorskip("tomllib")  # (Python >= 3.11)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    names = {re.split(r"[<>=!~\[ ;]", req, maxsplit=1)[0].lower() for req in extras["test"]}
    assert "mlflow" not in names and {"mlflow-skinny", "sqlalchemy", "alembic"} <= names, sorted(names)
    assert "mlflow" in {re.split(r"[<>=!~\[ ;]", r, maxsplit=1)[0] for r in extras["mlflow"]}  # (users: the UI too)
