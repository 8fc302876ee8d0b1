"""Metric trackers: JSONL always; TensorBoard, W&B and MLflow when installed; or your own object.

In your own loop, ``ft.trackers(names, folder, config=...)`` (:func:`trackers`) opens them as one
:class:`Trackers`: ``log(metrics, step)`` and ``close()`` (or ``with``), on the main process only; the
Trainer opens its own the same way (:func:`make_trackers`). docs/trackers.md says what each writes where
(each package's environment variables win). One tracker is an object with ``log(step: int, metrics:
dict[str, float])`` and optionally ``close()`` and ``where() -> str`` (a line for the summary).

Failures never stop training: an exception when a tracker is created, in ``log`` or in ``close`` is
reported once as a :class:`TrackerWarning` naming it and the error, and that tracker is switched off.

The config is logged once: W&B's run config, MLflow's params, TensorBoard's ``config`` text and
HParams record (when the run starts, not again on resume); ``metrics.jsonl`` holds metrics only.

Resume (``resume_step > 0``): W&B and MLflow keep their run id in ``<folder>/trackers.json`` and
reopen the same run (``wandb.init(id=..., resume="allow")``), so the history is one run with
continuous steps. The file also keeps the last step each logged: steps between the checkpoint and a
kill were logged already and functrain's resume reproduces them bit-exactly, so they are not logged
again (a warning says so). ``metrics.jsonl`` drops its records past the resume step and appends;
TensorBoard purges its events past it. A fresh run (``resume_step == 0``) starts new runs.
"""
from __future__ import annotations

import json
import numbers
import os
import time
import warnings
from typing import Any, Iterable, Mapping

import torch

from ..checkpoint.bounded import loads_json
from ..checkpoint.safe_io import LinkRefused, check_dir, open_append, open_read, replace_file

__all__ = ["Tracker", "TrackerWarning", "JsonlTracker", "TensorBoardTracker", "WandbTracker", "MlflowTracker",
           "TRACKERS", "check_trackers", "make_trackers", "Trackers", "trackers"]

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

    Appends, so a resumed run continues the same file; lines for steps after the resume point are
    dropped first, so the file never repeats a step (the kept lines go into a new file renamed over the
    old one). A symbolic link at ``metrics.jsonl`` is refused (:class:`functrain.checkpoint.LinkRefused`).
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
        return f"metrics: {os.path.abspath(self.path)}"  # (absolute, as the summary's other paths)


_LINE_MAX = 1 << 20  # one record is a few hundred bytes


class TensorBoardTracker(Tracker):
    """Scalars to TensorBoard event files under ``folder/tensorboard``.

    On resume, events after ``resume_step`` left by a killed run are purged
    (``SummaryWriter(purge_step=...)``), so the curves do not fold back. A fresh run records
    ``config`` as a text table (tag ``config``) and as the HParams plugin's session.
    """

    def __init__(self, folder: str, resume_step: int = 0, config: dict | None = None):
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        self.logdir = os.path.join(folder, "tensorboard")
        check_dir(self.logdir, "TensorBoard's event files")
        self.writer = SummaryWriter(self.logdir, purge_step=resume_step + 1 if resume_step > 0 else None)
        if config and resume_step == 0:
            from torch.utils.tensorboard.summary import hparams

            values = {str(k): v if isinstance(v, (bool, int, float, str)) else str(v) for k, v in config.items()}
            for summary in hparams(values, {}):  # the HParams plugin's experiment, session start and end
                self.writer.file_writer.add_summary(summary)
            rows = "".join("| " + k + " | " + str(v).replace("|", "\\|") + " |\n" for k, v in values.items())
            self.writer.add_text("config", "| name | value |\n|---|---|\n" + rows, 0)
            self.writer.flush()

    def log(self, step: int, metrics: dict) -> None:
        for k, v in metrics.items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()

    def where(self) -> str:
        return f"TensorBoard: tensorboard --logdir {os.path.abspath(self.logdir)}"


def _wait_for_a_new_run_folder(root: str, run_id: str) -> None:
    """Wait (< 1 s) if a session of ``run_id`` started in this very second: wandb names a session's folder
    ``{offline-,}run-<YYYYmmdd_HHMMSS>-<id>``, and a resumed session started within the same second as the
    previous one would reuse that folder and replace its records. Only a quick restart pays the wait."""
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
        else:
            self.client.update_run(run.info.run_id, status="RUNNING")
        self.run_id = run.info.run_id
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
    """The Trainer's trackers (it calls this on rank 0): those of a :class:`Trackers` opened on this process.

    ``folder`` is the results folder, ``config`` the run's hyper-parameters, ``resume_step`` the step
    training resumes from (0: a fresh run). Each returned tracker is guarded and has
    ``log(step, metrics)``, ``close()`` and ``where()`` (a line for the summary, or ``None``).
    """
    return Trackers(names, folder, config=config, resume_step=resume_step, main=True).trackers


def _open(items: tuple, folder: str, config: dict | None, resume_step: int) -> list[_Guarded]:
    out: list[_Guarded] = []
    for item in items:
        label = _label(item)
        try:
            if item == "jsonl":
                tracker: Any = JsonlTracker(folder, resume_step)
            elif item == "tensorboard":
                tracker = TensorBoardTracker(folder, resume_step, config)
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
                          TrackerWarning, stacklevel=4)
            continue
        out.append(_Guarded(tracker, label))
    return out


# -- the public object: trackers in your own loop -----------------------------------------------
def _is_main() -> bool:
    """Rank 0 of the initialised process group; without one, ``RANK`` (a launcher's) is 0 or unset."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    rank = os.environ.get("RANK", "").strip()
    return not rank.isdigit() or int(rank) == 0


def _step(step: Any, name: str) -> int:
    if isinstance(step, torch.Tensor) and step.numel() == 1 and not step.is_floating_point():
        step = int(step)
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
        raise ValueError(f"{name} must be an int >= 0; got {step!r}")
    return int(step)


def _check_metrics(metrics: Any, step: Any) -> None:
    if not isinstance(metrics, Mapping):
        swapped = " (the order is log(metrics, step))" if isinstance(step, Mapping) else ""
        raise TypeError(f"Trackers.log: metrics must be a dict {{name: number}}; got {type(metrics).__name__}{swapped}")
    for k, v in metrics.items():
        if not isinstance(k, str):
            raise TypeError(f"Trackers.log: metric names are strings; got {k!r}")
        if not (isinstance(v, torch.Tensor) and v.numel() == 1 or isinstance(v, numbers.Real)):
            raise TypeError(f"Trackers.log: metric {k!r} is a {type(v).__name__}; a metric is a number or a "
                            f"one-element tensor")


def _number(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.item()  # (a device tensor: one sync, on the main process only)
    return int(value) if isinstance(value, numbers.Integral) else float(value)


class Trackers:
    """The trackers of a run in your own loop: ``log(metrics, step)``, ``close()``, or ``with``.

    Made by :func:`trackers` (``ft.trackers``). The main process (rank 0 of an initialised process
    group; without one, the process whose ``RANK`` is 0 or unset) opens the trackers in ``folder``
    as the Trainer does, logs ``config`` once, and with ``resume_step`` (the step of the checkpoint
    you resumed) continues the same runs (see the module). Every other process gets an object with
    no trackers, whose ``log`` and ``close`` check their arguments and do nothing.

    Args:
        names: names (``"jsonl"``, ``"tensorboard"``, ``"wandb"``, ``"mlflow"``) and objects with
            ``log(step, metrics)`` (default ``("jsonl",)``).
        folder: where their files go (default ``"results"``).
        config: the hyper-parameters, a dict with str keys (default ``None``: none).
        resume_step: the step this run resumes from, an int >= 0 (default 0: a fresh run).
        main: whether this process logs (default ``None``: decided as above).

    Attributes:
        trackers: the open (guarded) trackers; empty on a process that does not log.
        main, folder, config, resume_step: as above.

    Raises:
        ValueError, TypeError: an unknown name, an object without ``log``, a bad ``config`` or ``resume_step``.

    Example::

        >>> import json, os, tempfile, functrain as ft
        >>> folder = tempfile.mkdtemp()
        >>> with ft.trackers(["jsonl"], folder, config={"lr": 0.1}) as run:
        ...     for step in (1, 2):
        ...         run.log({"loss": 1.0 / step}, step=step)
        >>> [json.loads(line) for line in open(os.path.join(folder, "metrics.jsonl"))]
        [{'step': 1, 'loss': 1.0}, {'step': 2, 'loss': 0.5}]
    """

    def __init__(self, names: Any = ("jsonl",), folder: str | os.PathLike = "results", *,
                 config: Mapping | None = None, resume_step: int = 0, main: bool | None = None):
        items = check_trackers(names)
        bad = [k for k in config if not isinstance(k, str)] if isinstance(config, Mapping) else [None]
        if config is not None and bad:
            raise TypeError(f"config must be a dict of hyper-parameters with str keys (or None); got "
                            f"{type(config).__name__}{'' if bad == [None] else f' with key {bad[0]!r}'}")
        if main is not None and not isinstance(main, bool):
            raise TypeError(f"main must be True, False or None; got {main!r}")
        self.folder = os.fspath(folder)
        self.config = None if config is None else dict(config)
        self.resume_step = _step(resume_step, "resume_step")
        self.main = _is_main() if main is None else main
        self.trackers: list[_Guarded] = _open(items, self.folder, self.config, self.resume_step) if self.main else []
        self._closed = False

    def __repr__(self) -> str:
        return f"Trackers({[t.label for t in self.trackers]}, {self.folder!r}, main={self.main})"

    def log(self, metrics: Mapping, step: int) -> None:
        """Log ``metrics`` (``{name: number or one-element tensor}``) at ``step`` (an int >= 0).

        The order is ``accelerator.log(values, step)``'s. Tensors are read to the host on the main
        process only. A bad argument raises on every process (TypeError, ValueError), as does a log
        after ``close()``.
        """
        _check_metrics(metrics, step)
        step = _step(step, "step")
        if self._closed:
            raise ValueError(f"Trackers.log at step {step} after close()")
        if self.trackers:
            record = {k: _number(v) for k, v in metrics.items()}
            for t in self.trackers:
                t.log(step, record)

    def close(self) -> None:
        """Finish every tracker's run (W&B, MLflow) and close its files; again: nothing happens."""
        if not self._closed:
            self._closed = True
            for t in self.trackers:
                t.close()

    def __enter__(self) -> "Trackers":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def trackers(names: Any = ("jsonl",), folder: str | os.PathLike = "results", *, config: Mapping | None = None,
             resume_step: int = 0) -> Trackers:
    """Open trackers for your own loop (``ft.trackers``): a :class:`Trackers`, which says what the arguments are."""
    return Trackers(names, folder, config=config, resume_step=resume_step)
