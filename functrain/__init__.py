"""functrain: pure, composable, compiled training steps for PyTorch.

The whole training state is one pytree (:class:`TrainState`); a training step is
a pure function ``step(state, batch) -> (state, metrics)``; features are
transforms that wrap the step (:func:`accumulate`, :func:`mixed_precision`,
:func:`clip`, :func:`ema`, ...); :func:`compile` compiles the step whole.

Example::

    import torch, functrain as ft

    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    apply_fn, params, buffers = ft.functionalize(model)

    def loss_fn(params, buffers, batch):
        x, y = batch
        return torch.nn.functional.mse_loss(apply_fn(params, buffers, x), y)

    step = ft.clip(1.0)(ft.train_step(loss_fn, ft.optim.adamw(lr=1e-3)))
    state = step.init(params, buffers)
    cstep = ft.compile(step)
    state, metrics = cstep(state, (torch.randn(32, 8), torch.randn(32, 1)))
"""
from . import checkpoint, distributed, optim
from .core import tree
from .checkpoint import CheckpointError, CheckpointManager, Restored, export_state_dict, export_weights, load, load_extra, register_checkpoint_type, save
from .compiler import BackendError, CompiledStep, GraphBreakError, MemoryEstimate, compile, memory
from .data import ShardedLoader, gather_for_eval, shard
from .distributed import data_parallel, gather_state, launch, local_sgd
from . import data  # noqa: F401 - ``ft.data``: the data package
from .driver import Profile, run, to_device
from .core.module import functionalize, init_empty, to_module
from .core.remat import remat
from .core.rng import HostRandomError
from .core.flat import FlatParams, flat, unflat
from .core.state import TrainState
from .core.hyper import get_hyper, set_hyper
from .core.step import STAGES, Step, train_step
from .core.transform import StepContext, Transform
from .trainer import Callback, TrainConfig, Trainer
from .trainer.batch_fit import BatchFit, fit_batch
from .trainer.trackers import trackers
from .transforms import EmaState, LossScaleState, Policy, accumulate, clip, clip_value, ema, mixed_precision, random_flip, skip_nonfinite
from .transforms import Population, PopulationError, member, population

__version__ = "0.1.0"

__all__ = [
    "TrainState", "Step", "StepContext", "Transform", "STAGES", "train_step",
    "functionalize", "init_empty", "to_module", "remat", "flat", "unflat", "FlatParams", "compile", "CompiledStep", "GraphBreakError", "BackendError", "HostRandomError", "memory", "MemoryEstimate", "run", "to_device", "Profile",
    "accumulate", "clip", "clip_value", "ema", "EmaState", "skip_nonfinite", "random_flip", "mixed_precision", "Policy",
    "LossScaleState", "optim", "tree", "data_parallel", "local_sgd", "gather_state", "launch", "distributed", "TrainConfig", "shard", "ShardedLoader", "gather_for_eval", "data", "save", "load", "load_extra", "CheckpointManager",
    "CheckpointError", "Trainer", "Callback", "export_state_dict", "export_weights", "Restored", "register_checkpoint_type", "checkpoint", "trackers",
    "fit_batch", "BatchFit", "set_hyper", "get_hyper",
]
__all__ += ["population", "Population", "PopulationError", "member"]

__all__ += ["benchmark"]


def __getattr__(name: str):
    """``ft.benchmark`` (:func:`functrain.bench.benchmark`), resolved on first use: ``import functrain`` does not
    import :mod:`functrain.bench`."""
    if name == "benchmark":
        from .bench import benchmark
        return benchmark
    raise AttributeError(f"module 'functrain' has no attribute {name!r}")
