"""The built-in step transforms."""
from .accumulate import accumulate
from .clip import clip, clip_value
from .ema import EmaState, ema
from .finite import skip_nonfinite
from .flip import random_flip
from .precision import LossScaleState, Policy, mixed_precision
from .population import Population, PopulationError, member, population

__all__ = ["accumulate", "clip", "clip_value", "ema", "EmaState", "skip_nonfinite", "random_flip",
           "mixed_precision", "Policy", "LossScaleState", "population", "Population", "member", "PopulationError"]
