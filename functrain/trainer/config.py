"""``TrainConfig``: the trainer's hyper-parameters, validated, saved beside checkpoints as YAML or JSON."""
from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field, fields
from typing import Any

__all__ = ["TrainConfig"]

_PRECISIONS = ("no", "bf16", "fp16")
# Changing one of these changes the shapes or structure of the training state:
# a checkpoint written under the old value cannot be resumed under the new one.
STRUCTURAL = ("mixed_precision",)


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"TrainConfig.{name} must be a positive int; got {value!r}")


def _positive_float(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or not math.isfinite(value):
        raise ValueError(f"TrainConfig.{name} must be a positive number; got {value!r}")


@dataclass(frozen=True)
class TrainConfig:
    """The hyper-parameters of :class:`functrain.Trainer`, checked when constructed.

    Field names follow the trainers users know (``train_batch_size``,
    ``gradient_accumulate_every``, ...). ``train_batch_size`` is the batch of one
    micro-step on one process; an optimizer update sees ``train_batch_size *
    gradient_accumulate_every * processes`` samples. ``num_samples`` must be a
    perfect square: samples are tiled into a ``sqrt(n) x sqrt(n)`` grid.

    Example::

        >>> from functrain import TrainConfig
        >>> cfg = TrainConfig(train_batch_size=32, train_num_steps=1000, num_samples=16)
        >>> cfg.replace(train_lr=3e-4).train_lr
        0.0003
        >>> TrainConfig(num_samples=10)
        Traceback (most recent call last):
        ...
        ValueError: TrainConfig.num_samples must be a perfect square (samples are tiled into a square grid); got 10
    """

    train_batch_size: int = 16
    gradient_accumulate_every: int = 1
    train_lr: float = 1e-4
    train_num_steps: int = 100_000
    adam_betas: tuple = (0.9, 0.99)
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    ema_update_every: int = 10
    ema_decay: float = 0.995
    save_and_sample_every: int = 1000
    num_samples: int = 25
    mixed_precision: str = "no"
    results_folder: str = "./results"
    seed: int = 0
    log_every: int = 10
    keep_checkpoints: int = 3
    compile: bool = True
    trackers: tuple = field(default=("jsonl",))

    def __post_init__(self) -> None:
        for name in ("train_batch_size", "gradient_accumulate_every", "train_num_steps", "ema_update_every",
                     "save_and_sample_every", "num_samples", "log_every", "keep_checkpoints"):
            _positive_int(name, getattr(self, name))
        for name in ("train_lr", "max_grad_norm"):
            _positive_float(name, getattr(self, name))
        if isinstance(self.weight_decay, bool) or not isinstance(self.weight_decay, (int, float)) \
                or self.weight_decay < 0:
            raise ValueError(f"TrainConfig.weight_decay must be a number >= 0; got {self.weight_decay!r}")
        root = math.isqrt(self.num_samples)
        if root * root != self.num_samples:
            raise ValueError(f"TrainConfig.num_samples must be a perfect square (samples are tiled into a square "
                             f"grid); got {self.num_samples}")
        if isinstance(self.ema_decay, bool) or not isinstance(self.ema_decay, (int, float)) \
                or not 0.0 < self.ema_decay < 1.0:
            raise ValueError(f"TrainConfig.ema_decay must be in (0, 1); got {self.ema_decay!r}")
        betas = tuple(self.adam_betas) if isinstance(self.adam_betas, (list, tuple)) else None
        if betas is None or len(betas) != 2 or not all(isinstance(b, (int, float)) and 0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"TrainConfig.adam_betas must be two numbers in [0, 1); got {self.adam_betas!r}")
        object.__setattr__(self, "adam_betas", tuple(float(b) for b in betas))
        if self.mixed_precision not in _PRECISIONS:
            raise ValueError(f"TrainConfig.mixed_precision must be one of {_PRECISIONS}; got {self.mixed_precision!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"TrainConfig.seed must be an int; got {self.seed!r}")
        if not isinstance(self.results_folder, (str, os.PathLike)):
            raise ValueError(f"TrainConfig.results_folder must be a path; got {self.results_folder!r}")
        object.__setattr__(self, "results_folder", os.fspath(self.results_folder))
        trackers = (self.trackers,) if isinstance(self.trackers, str) else tuple(self.trackers)
        known = ("jsonl", "tensorboard", "wandb", "mlflow")
        unknown = [t for t in trackers if t not in known]
        if unknown:
            raise ValueError(f"TrainConfig.trackers: unknown {unknown}; choose from {known}")
        object.__setattr__(self, "trackers", trackers)

    # -- conversions -------------------------------------------------------------------------
    def to_dict(self) -> dict:
        """Plain JSON/YAML-able values (tuples become lists)."""
        return {f.name: list(v) if isinstance(v := getattr(self, f.name), tuple) else v for f in fields(self)}

    @classmethod
    def from_dict(cls, data: dict) -> "TrainConfig":
        """Build from a dict; an unknown key raises ``ValueError`` naming it."""
        if not isinstance(data, dict):
            raise ValueError(f"TrainConfig.from_dict expects a mapping; got {type(data).__name__}")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"TrainConfig: unknown fields {unknown}; known: {sorted(names)}")
        values = dict(data)
        for key in ("adam_betas", "trackers"):
            if isinstance(values.get(key), list):
                values[key] = tuple(values[key])
        return cls(**values)

    def replace(self, **changes: Any) -> "TrainConfig":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def save(self, path: str | os.PathLike) -> None:
        """Write as YAML (``.yaml``/``.yml``, needs PyYAML) or JSON (anything else), atomically."""
        path = os.fspath(path)
        if path.endswith((".yaml", ".yml")):
            import yaml

            text = yaml.safe_dump(self.to_dict(), sort_keys=False)
        else:
            text = json.dumps(self.to_dict(), indent=2) + "\n"
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "TrainConfig":
        """Read a YAML or JSON file written by :meth:`save` (or by hand)."""
        path = os.fspath(path)
        with open(path, encoding="utf-8") as f:
            text = f.read()
        if path.endswith((".yaml", ".yml")):
            import yaml

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
        return cls.from_dict(data)

    def diff(self, other: "TrainConfig") -> dict:
        """``{field: (self's value, other's value)}`` for every field that differs."""
        a, b = self.to_dict(), other.to_dict()
        return {k: (a[k], b[k]) for k in a if a[k] != b[k]}
