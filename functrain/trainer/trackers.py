"""Metric trackers: JSONL always; TensorBoard, W&B and MLflow when installed; or your own object.

The protocol is two methods (:class:`Tracker`)::

    log(step: int, metrics: dict[str, float]) -> None   # host floats, called on rank 0 only
    close() -> None                                     # optional; called once at the end of training

Any object with a callable ``log`` is a tracker: pass it in the list of trackers
next to the built-in names (``"jsonl"``, ``"tensorboard"``, ``"wandb"``,
``"mlflow"``). Two optional methods are used when present: ``where() -> str``
(a line for the end-of-run summary: where the records are) and nothing else.

Failures never stop training. :func:`make_trackers` wraps every tracker so that an
exception when it is created, in ``log`` or in ``close`` is reported once as a
:class:`TrackerWarning` naming the tracker and the error, and that tracker is
switched off for the rest of the run; the other trackers and the training go on.

Resume. W&B and MLflow keep their run id in ``<results>/trackers.json``; a run that
resumes from a checkpoint (``resume_step > 0``) reopens the same W&B run
(``wandb.init(id=..., resume="allow")``) and the same MLflow run, so its history is
one run with continuous steps. The file also keeps the last step each tracker
logged: after a kill, the steps between the checkpoint and the kill were already
logged, and functrain's resume reproduces them bit-exactly, so they are not logged
a second time (a warning says so). A fresh run (``resume_step == 0``) starts new
tracker runs.

Where the records go (each package's own environment variables win):

* W&B: ``mode`` from ``WANDB_MODE`` (default ``"offline"``: ``wandb sync`` uploads
  later), ``dir`` from ``WANDB_DIR`` (default the results folder), ``project`` from
  ``WANDB_PROJECT`` (default ``"functrain"``); other ``WANDB_*`` settings as wandb reads them.
* MLflow: the tracking URI from ``MLFLOW_TRACKING_URI`` (default
  ``sqlite:///<results>/mlflow.db``, which current MLflow versions accept; the old
  ``./mlruns`` file store is refused by MLflow 3 unless ``MLFLOW_ALLOW_FILE_STORE=true``),
  the experiment from ``MLFLOW_EXPERIMENT_NAME`` / ``MLFLOW_EXPERIMENT_ID`` (default
  ``"functrain"``). functrain uses an ``MlflowClient`` of its own: it never changes
  mlflow's global tracking URI or active run.

Example::

    class Printer:
        def log(self, step, metrics):
            print(step, metrics)

    trackers = make_trackers(["jsonl", "mlflow", Printer()], "results", config={"lr": 1e-3})
    for t in trackers:
        t.log(10, {"loss": 0.5})
    for t in trackers:
        t.close()
"""
from __future__ import annotations

import json
import os
import time
import warnings
from typing import Any, Iterable

from ..checkpoint.bounded import loads_json
from ..checkpoint.safe_io import LinkRefused, check_dir, open_append, open_read, replace_file

__all__ = ["Tracker", "TrackerWarning", "JsonlTracker", "TensorBoardTracker", "WandbTracker", "MlflowTracker",
           "TRACKERS", "check_trackers", "make_trackers"]

TRACKERS = ("jsonl", "tensorboard", "wandb", "mlflow")
RUNS_FILE = "trackers.json"


class TrackerWarning(UserWarning):
    """A tracker failed and was switched off; training goes on."""


class Tracker:
    """Receives host-side metrics: ``log(step, {name: float})`` and ``close()`` (see the module docstring)."""

    def log(self, step: int, metrics: dict) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def close(self) -> None:
        pass


# -- the run ids kept in the results folder -----------------------------------------------------
class _RunsFile:
    """``<folder>/trackers.json``: ``{tracker name: {"run_id": ..., "last_step": ..., ...}}``.

    Each tracker reads and rewrites only its own entry (read-modify-write, then an atomic
    rename), so two trackers sharing the file never undo each other's entries.
    """

    def __init__(self, folder: str):
        self.path = os.path.join(folder, RUNS_FILE)

    def read(self) -> dict:
        try:
            with open_read(self.path, "the trackers' run ids") as f:
                raw = f.read(_RUNS_MAX_BYTES + 1)
            if len(raw) > _RUNS_MAX_BYTES:
                raise ValueError(f"more than {_RUNS_MAX_BYTES} bytes")
            data = loads_json(raw, self.path)
        except FileNotFoundError:
            return {}
        except LinkRefused:
            raise
        except (OSError, ValueError) as e:
            warnings.warn(f"{self.path} is unreadable ({e}); tracker runs start afresh", TrackerWarning, stacklevel=3)
            return {}
        return data if isinstance(data, dict) else {}

    def get(self, name: str) -> dict:
        entry = self.read().get(name)
        return entry if isinstance(entry, dict) else {}

    def update(self, name: str, **values: Any) -> None:
        data = self.read()
        entry = data.get(name) if isinstance(data.get(name), dict) else {}
        entry.update(values)
        data[name] = entry
        # no fsync: losing the last update costs at most one re-logged step
        replace_file(self.path, json.dumps(data, indent=1).encode("utf-8"), what="the trackers' run ids")


_RUNS_MAX_BYTES = 1 << 20  # a few run ids and steps


class _Resumable(Tracker):
    """A tracker whose run lives elsewhere (W&B, MLflow): reopened on resume, each step logged once."""

    name = ""

    def __init__(self, folder: str, resume_step: int):
        os.makedirs(folder, exist_ok=True)
        self._runs = _RunsFile(folder)
        previous = self._runs.get(self.name) if resume_step > 0 else {}
        self.resumed_id: str | None = previous.get("run_id")
        last = previous.get("last_step")
        self.last_step = int(last) if isinstance(last, int) and self.resumed_id else 0
        if self.last_step > resume_step:
            warnings.warn(f"tracker {self.name!r}: run {self.resumed_id} already has steps up to {self.last_step}; "
                          f"resuming at step {resume_step}, steps {resume_step + 1}..{self.last_step} are not logged "
                          f"again (a functrain resume reproduces them bit-exactly)", TrackerWarning, stacklevel=4)

    def _opened(self, run_id: str, **info: Any) -> None:
        if run_id != self.resumed_id:
            self.last_step = 0  # a new run: nothing logged in it yet
        self._runs.update(self.name, run_id=run_id, last_step=self.last_step, **info)

    def log(self, step: int, metrics: dict) -> None:
        if step <= self.last_step:
            return
        self._log(step, metrics)
        self.last_step = step
        self._runs.update(self.name, last_step=step)

    def _log(self, step: int, metrics: dict) -> None:  # pragma: no cover - interface
        raise NotImplementedError


# -- the built-in trackers ----------------------------------------------------------------------
class JsonlTracker(Tracker):
    """One JSON object per line in ``folder/metrics.jsonl``: ``{"step": n, "loss": ..., ...}``.

    Appends, so a resumed run continues the same file; lines for steps after the
    resume point are dropped first, so the file never repeats a step (the kept
    lines go into a new file renamed over the old one: it is never rewritten in
    place). A symbolic link at ``metrics.jsonl`` is refused
    (:class:`functrain.checkpoint.LinkRefused`): nothing is written through it.
    """

    def __init__(self, folder: str, resume_step: int = 0):
        os.makedirs(folder, exist_ok=True)
        self.path = os.path.join(folder, "metrics.jsonl")
        what = "the metrics log"
        try:
            f = open_read(self.path, what)
        except FileNotFoundError:
            f = None
        if f is not None:
            kept = []
            with f:
                for raw in f:
                    line = raw.decode("utf-8", "replace")
                    try:
                        record = json.loads(line) if len(line) < _LINE_MAX else None
                        step = record.get("step", 0) if isinstance(record, dict) else None
                    except (json.JSONDecodeError, RecursionError):
                        break  # a torn last line from a killed run
                    if step is None:
                        break  # not one of our records: the rest is not ours to keep
                    if isinstance(step, (int, float)) and step <= resume_step:
                        kept.append(line if line.endswith("\n") else line + "\n")
            replace_file(self.path, "".join(kept).encode("utf-8"), what=what)
        self._file = open_append(self.path, what)

    def log(self, step: int, metrics: dict) -> None:
        self._file.write(json.dumps({"step": step, **metrics}) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def where(self) -> str:
        return f"metrics: {self.path}"


_LINE_MAX = 1 << 20  # one record is a few hundred bytes


class TensorBoardTracker(Tracker):
    """Scalars to TensorBoard event files under ``folder/tensorboard``.

    On resume, events after ``resume_step`` left by a killed run are purged
    (``SummaryWriter(purge_step=...)``), so the curves do not fold back.
    """

    def __init__(self, folder: str, resume_step: int = 0):
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        self.logdir = os.path.join(folder, "tensorboard")
        check_dir(self.logdir, "TensorBoard's event files")
        self.writer = SummaryWriter(self.logdir, purge_step=resume_step + 1 if resume_step > 0 else None)

    def log(self, step: int, metrics: dict) -> None:
        for k, v in metrics.items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()

    def where(self) -> str:
        return f"TensorBoard: tensorboard --logdir {self.logdir}"


def _wait_for_a_new_run_folder(root: str, run_id: str) -> None:
    """Wait (< 1 s) if a session of ``run_id`` started in this very second.

    wandb names a session's folder ``{offline-,}run-<YYYYmmdd_HHMMSS>-<id>``; a resumed session
    started within the same second as the previous one would reuse that folder and replace its
    records. Only a quick restart pays the wait.
    """
    import datetime
    import glob

    for _ in range(3):
        now = datetime.datetime.now()
        stamp = now.strftime("%Y%m%d_%H%M%S")
        if not glob.glob(os.path.join(root, "wandb", f"*run-{stamp}-{run_id}")):
            return
        time.sleep(1.0 - now.microsecond / 1e6 + 0.01)


class WandbTracker(_Resumable):
    """A Weights & Biases run: offline under the results folder unless ``WANDB_MODE``/``WANDB_DIR`` say otherwise.

    A resumed training run reopens the same W&B run (``id`` from ``trackers.json``,
    ``resume="allow"``). The run is created with ``reinit="create_new"``: a W&B run
    you opened yourself stays untouched (log into it with your own tracker object).
    """

    name = "wandb"

    def __init__(self, folder: str, config: dict | None = None, resume_step: int = 0):
        import wandb

        super().__init__(folder, resume_step)
        # Passed explicitly, read now: wandb reads its env variables once per process (at its first setup).
        kwargs: dict[str, Any] = {"mode": os.environ.get("WANDB_MODE") or "offline",
                                  "dir": os.environ.get("WANDB_DIR") or os.path.abspath(folder),
                                  "project": os.environ.get("WANDB_PROJECT") or "functrain"}
        if self.resumed_id:
            kwargs.update(id=self.resumed_id, resume="allow")
            _wait_for_a_new_run_folder(kwargs["dir"], self.resumed_id)
        self.run = wandb.init(config=dict(config or {}), reinit="create_new", allow_val_change=True, **kwargs)
        self.mode = kwargs["mode"]
        self._opened(self.run.id)

    def _log(self, step: int, metrics: dict) -> None:
        self.run.log(dict(metrics), step=step)

    def close(self) -> None:
        self.run.finish()

    def where(self) -> str:
        run_dir = os.path.dirname(str(getattr(self.run, "dir", "") or "")) or "?"
        if self.mode != "offline":
            return f"W&B run {self.run.id} ({self.mode}): {run_dir}"
        # a resumed run has one offline folder per session, all with the same id: sync them all
        return f"W&B run {self.run.id} (offline): wandb sync {os.path.dirname(run_dir)}/offline-run-*-{self.run.id}"


class MlflowTracker(_Resumable):
    """An MLflow run, through a client of its own (mlflow's global URI and active run are left alone).

    The store is ``MLFLOW_TRACKING_URI`` or ``sqlite:///<results>/mlflow.db``; the
    experiment ``MLFLOW_EXPERIMENT_ID``, ``MLFLOW_EXPERIMENT_NAME`` or ``"functrain"``.
    A resumed training run reopens the same MLflow run. Params are the config;
    MLflow params cannot change, so on resume a changed value keeps its first value
    (a warning names it; the results folder's ``config.json`` has the new one).
    """

    name = "mlflow"

    def __init__(self, folder: str, config: dict | None = None, resume_step: int = 0):
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        super().__init__(folder, resume_step)
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        default_store = not uri
        if default_store:
            uri = "sqlite:///" + os.path.abspath(os.path.join(folder, "mlflow.db"))
        self.tracking_uri = uri
        self.client = MlflowClient(tracking_uri=uri)
        run = None
        if self.resumed_id:
            try:
                run = self.client.get_run(self.resumed_id)
            except Exception as e:  # not in this store (MLFLOW_TRACKING_URI changed?): say so, start a new run
                warnings.warn(f"tracker 'mlflow': run {self.resumed_id} not found in {uri} ({type(e).__name__}); "
                              f"starting a new run", TrackerWarning, stacklevel=3)
        if run is None:
            experiment_id = self._experiment(folder if default_store else None)
            run = self.client.create_run(experiment_id, run_name=os.path.basename(os.path.abspath(folder)),
                                         tags={"mlflow.source.name": "functrain"})
            self.run_id = run.info.run_id
        else:
            self.run_id = run.info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
        params = {k: str(v)[:6000] for k, v in (config or {}).items()}  # MLflow's limit on a param value
        old = run.data.params
        changed = sorted(k for k in params if k in old and old[k] != params[k])
        if changed:
            warnings.warn(f"tracker 'mlflow': params {changed} changed since run {self.run_id} started; MLflow keeps "
                          f"the first values (the results folder's config.json has the new ones)",
                          TrackerWarning, stacklevel=3)
        new = [Param(k, v) for k, v in params.items() if k not in old]
        for i in range(0, len(new), 100):  # log_batch takes at most 100 params a call
            self.client.log_batch(self.run_id, params=new[i:i + 100])
        self._opened(self.run_id, tracking_uri=uri)

    def _experiment(self, folder: str | None) -> str:
        if os.environ.get("MLFLOW_EXPERIMENT_ID"):
            return os.environ["MLFLOW_EXPERIMENT_ID"]
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or "functrain"
        found = self.client.get_experiment_by_name(name)
        if found is not None:
            return found.experiment_id
        # With the default store the artifacts go beside it, not into ./mlruns of whatever the working directory is.
        location = None if folder is None else "file://" + os.path.abspath(os.path.join(folder, "mlartifacts"))
        return self.client.create_experiment(name, artifact_location=location)

    def _log(self, step: int, metrics: dict) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), now, step) for k, v in metrics.items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id, "FINISHED")

    def where(self) -> str:
        return f"MLflow run {self.run_id}: {self.tracking_uri} (view: mlflow ui --backend-store-uri {self.tracking_uri})"


# -- building and guarding ----------------------------------------------------------------------
def _is_tracker_object(obj: Any) -> bool:
    return not isinstance(obj, str) and callable(getattr(obj, "log", None))


def _label(obj: Any) -> str:
    return obj if isinstance(obj, str) else type(obj).__name__


def check_trackers(names: Any) -> tuple:
    """Validate a tracker list before training: built-in names or objects with ``log(step, metrics)``.

    Returns the list as a tuple (a single name or object becomes a 1-tuple). Raises
    ``ValueError`` for an unknown name, listing the known ones, and ``TypeError`` for
    an object without a ``log`` method, stating the protocol.

    Example::

        >>> check_trackers("jsonl")
        ('jsonl',)
        >>> check_trackers(["jsonl", "comet"])
        Traceback (most recent call last):
        ...
        ValueError: unknown tracker 'comet'; the known trackers are 'jsonl', 'tensorboard', 'wandb', 'mlflow', or pass an object with log(step, metrics) and close()
    """
    items = (names,) if isinstance(names, str) or _is_tracker_object(names) else names
    try:
        items = tuple(items)
    except TypeError:
        raise TypeError(f"trackers must be a list of names ({', '.join(map(repr, TRACKERS))}) or tracker objects; "
                        f"got {type(names).__name__}") from None
    for item in items:
        if isinstance(item, str):
            if item not in TRACKERS:
                raise ValueError(f"unknown tracker {item!r}; the known trackers are {', '.join(map(repr, TRACKERS))}, "
                                 f"or pass an object with log(step, metrics) and close()")
        elif not _is_tracker_object(item):
            raise TypeError(f"a tracker must be one of {', '.join(map(repr, TRACKERS))} or an object with "
                            f"log(step: int, metrics: dict) (and optionally close()); got {type(item).__name__}")
    return items


class _Guarded(Tracker):
    """Wraps one tracker: the first exception warns (naming it) and switches it off; training goes on."""

    def __init__(self, tracker: Any, label: str):
        self.tracker, self.label, self.failed = tracker, label, False
        self.error: str | None = None  # the failure that switched it off, for the summary

    def _fail(self, what: str, e: BaseException) -> None:
        self.failed = True
        self.error = f"{type(e).__name__} in {what}"
        warnings.warn(f"tracker {self.label!r} failed in {what} and is switched off for the rest of this run: "
                      f"{type(e).__name__}: {e}", TrackerWarning, stacklevel=3)
        close = getattr(self.tracker, "close", None)
        if what != "close()" and callable(close):
            try:  # release what it holds (files, a wandb process); already reported, so stay quiet
                close()
            except Exception:
                pass

    def log(self, step: int, metrics: dict) -> None:
        if self.failed:
            return
        try:
            self.tracker.log(step, metrics)
        except Exception as e:
            self._fail("log()", e)

    def close(self) -> None:
        if self.failed:
            return
        close = getattr(self.tracker, "close", None)
        self.failed = True  # close once
        if callable(close):
            try:
                close()
            except Exception as e:
                self._fail("close()", e)

    def where(self) -> str | None:
        if self.error is not None:
            return f"tracker {self.label!r}: switched off after {self.error} (see the warning)"
        where = getattr(self.tracker, "where", None)
        if not callable(where):
            return None
        try:
            return str(where())
        except Exception:
            return None


def make_trackers(names: Iterable[Any], folder: str, config: dict | None = None,
                  resume_step: int = 0) -> list[Tracker]:
    """Create the trackers in ``names`` (built-in names or your objects), each guarded against failure.

    ``folder`` is the results folder, ``config`` the run's hyper-parameters (logged by
    W&B and MLflow), ``resume_step`` the step training resumes from (0 for a fresh
    run). A name that is not known raises ``ValueError`` at once; a tracker that
    cannot be created (package missing, store refused, ...) is skipped with one
    :class:`TrackerWarning` (but a symbolic link where a tracker writes its file raises
    :class:`functrain.checkpoint.LinkRefused`); a tracker that fails later is switched off with one warning.
    Every returned tracker has ``log``, ``close`` and ``where()`` (a line for the
    summary, or ``None``).

    Example::

        trackers = make_trackers(("jsonl", "wandb"), "results", {"lr": 1e-3}, resume_step=0)
    """
    items = check_trackers(names)
    out: list[Tracker] = []
    for item in items:
        label = _label(item)
        try:
            if item == "jsonl":
                tracker: Any = JsonlTracker(folder, resume_step)
            elif item == "tensorboard":
                tracker = TensorBoardTracker(folder, resume_step)
            elif item == "wandb":
                tracker = WandbTracker(folder, config, resume_step)
            elif item == "mlflow":
                tracker = MlflowTracker(folder, config, resume_step)
            else:
                tracker = item
        except LinkRefused:  # a link planted in the results folder: an error, not a tracker to skip
            for t in out:
                t.close()
            raise
        except Exception as e:
            extra = {"wandb": "trackers", "mlflow": "trackers", "tensorboard": "tensorboard"}.get(label)
            hint = f" (pip install 'functrain[{extra}]')" if isinstance(e, ImportError) and extra else ""
            warnings.warn(f"tracker {label!r} could not start and is skipped: {type(e).__name__}: {e}{hint}",
                          TrackerWarning, stacklevel=2)
            continue
        out.append(_Guarded(tracker, label))
    return out
