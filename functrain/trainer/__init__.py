"""The trainer layer: :class:`Trainer` (the loop around a step), :class:`TrainConfig`, trackers and images."""
from .config import TrainConfig
from .loop import Trainer

__all__ = ["Trainer", "TrainConfig"]
