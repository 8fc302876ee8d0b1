"""Metric trackers: JSONL always; TensorBoard, W&B (offline) and MLflow (local files) when installed."""
from __future__ import annotations

import json
import os
from typing import Any

__all__ = ["Tracker", "JsonlTracker", "make_trackers"]


class Tracker:
    """Receives host-side metrics: ``log(step, {name: float})``, ``close()``."""

    def log(self, step: int, metrics: dict) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def close(self) -> None:
        pass


class JsonlTracker(Tracker):
    """One JSON object per line in ``folder/metrics.jsonl``: ``{"step": n, "loss": ..., ...}``.

    Appends, so a resumed run continues the same file; lines for steps at or
    after the resume point are dropped first, so the file never repeats a step.
    """

    def __init__(self, folder: str, resume_step: int = 0):
        os.makedirs(folder, exist_ok=True)
        self.path = os.path.join(folder, "metrics.jsonl")
        if os.path.exists(self.path):
            kept = []
            with open(self.path, encoding="utf-8") as f:
                for line in f:
                    try:
                        if json.loads(line).get("step", 0) <= resume_step:
                            kept.append(line if line.endswith("\n") else line + "\n")
                    except json.JSONDecodeError:
                        break  # a torn last line from a killed run
            with open(self.path, "w", encoding="utf-8") as f:
                f.writelines(kept)
        self._file = open(self.path, "a", encoding="utf-8")

    def log(self, step: int, metrics: dict) -> None:
        self._file.write(json.dumps({"step": step, **metrics}) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class TensorBoardTracker(Tracker):
    """Scalars to TensorBoard event files under ``folder/tensorboard``."""

    def __init__(self, folder: str):
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        self.writer = SummaryWriter(os.path.join(folder, "tensorboard"))

    def log(self, step: int, metrics: dict) -> None:
        for k, v in metrics.items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbTracker(Tracker):
    """Weights & Biases in offline mode (``wandb sync`` uploads later)."""

    def __init__(self, folder: str, config: dict):
        import wandb

        self.run = wandb.init(mode="offline", dir=folder, config=config, reinit=True)

    def log(self, step: int, metrics: dict) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowTracker(Tracker):
    """MLflow with a local file store under ``folder/mlruns``."""

    def __init__(self, folder: str, config: dict):
        import mlflow

        self.mlflow = mlflow
        mlflow.set_tracking_uri("file://" + os.path.abspath(os.path.join(folder, "mlruns")))
        self.run = mlflow.start_run()
        mlflow.log_params({k: str(v) for k, v in config.items()})

    def log(self, step: int, metrics: dict) -> None:
        self.mlflow.log_metrics(metrics, step=step)

    def close(self) -> None:
        self.mlflow.end_run()


def make_trackers(names: Any, folder: str, config: dict, resume_step: int = 0) -> list[Tracker]:
    """The trackers named in ``names``; an optional one whose package is missing is skipped with a warning."""
    import warnings

    out: list[Tracker] = []
    for name in names:
        try:
            if name == "jsonl":
                out.append(JsonlTracker(folder, resume_step))
            elif name == "tensorboard":
                out.append(TensorBoardTracker(folder))
            elif name == "wandb":
                out.append(WandbTracker(folder, config))
            elif name == "mlflow":
                out.append(MlflowTracker(folder, config))
            else:
                raise ValueError(f"unknown tracker {name!r}; choose from jsonl, tensorboard, wandb, mlflow")
        except ImportError as e:
            warnings.warn(f"tracker {name!r} skipped: {e}", stacklevel=2)
    return out
