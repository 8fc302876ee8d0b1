"""The trainer layer: :class:`Trainer` (the loop around a step, on :func:`functrain.run`), :class:`TrainConfig`,
:class:`Callback` (user hooks), the evaluation, trackers and images."""
from .config import TrainConfig
from .hooks import Callback
from .loop import Trainer

__all__ = ["Trainer", "TrainConfig", "Callback"]
