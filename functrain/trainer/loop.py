"""``ft.Trainer``: the loop around the step, built from the public API only.

A config of hyper-parameters in, and out: checkpoints that resume bit-exactly,
EMA sample grids, metrics (JSONL, TensorBoard, W&B, MLflow) and a loss curve.
"""
from __future__ import annotations

import os
import signal
import time
import warnings
from typing import Any, Callable

import torch

from .. import distributed
from ..checkpoint import CheckpointManager, load_extra
from ..compile import compile as compile_step
from ..distributed import data_parallel, shard
from ..driver import _to_host, to_device
from ..module import functionalize
from ..optim import adamw
from ..state import TrainState
from ..step import Step, train_step
from ..transforms import accumulate, clip, ema, mixed_precision
from .config import STRUCTURAL, TrainConfig
from .images import image_grid, loss_curve, write_png
from .trackers import make_trackers

__all__ = ["Trainer"]


def _module_loss(apply_fn: Callable) -> Callable:
    def loss_fn(params, buffers, batch):
        if isinstance(batch, dict):
            return apply_fn(params, buffers, **batch)
        if isinstance(batch, (tuple, list)):
            return apply_fn(params, buffers, *batch)
        return apply_fn(params, buffers, batch)

    return loss_fn


class Trainer:
    """Train ``model`` (a module whose ``forward(*batch)`` returns the loss) or ``loss_fn`` on ``dataset``.

    The step is ``train_step(loss, adamw(train_lr, adam_betas))`` with
    ``clip(max_grad_norm)``, ``ema(ema_decay, every=ema_update_every)``,
    ``accumulate(gradient_accumulate_every)``, ``mixed_precision(...)`` and, when
    launched on several processes, ``data_parallel()``; compiled unless
    ``config.compile`` is false. ``train()`` runs to ``train_num_steps`` optimizer
    updates; every ``save_and_sample_every`` updates it writes a checkpoint
    (state + data position + config) under ``results_folder/checkpoints`` and,
    with ``sample_fn(ema_params, num_samples) -> images in [0, 1]``, a
    ``sample-{step}.png`` grid. Running it again resumes from the newest
    checkpoint, bit-exactly. SIGTERM finishes the current step, saves and returns.

    Example::

        trainer = ft.Trainer(model, dataset, ft.TrainConfig(train_num_steps=1000), sample_fn=sample)
        state = trainer.train()
    """

    def __init__(self, model_or_loss: Any, dataset: Any, config: TrainConfig,
                 sample_fn: Callable[[Any, int], torch.Tensor] | None = None, *, params: Any = None,
                 buffers: Any = None):
        if not isinstance(config, TrainConfig):
            raise TypeError(f"Trainer needs a functrain.TrainConfig; got {type(config).__name__}")
        self.config = config
        self.info = distributed.init()
        self.world = distributed.world_size()
        self.rank = distributed.rank()
        self.device = distributed.device()
        if isinstance(model_or_loss, torch.nn.Module):
            model = model_or_loss.to(self.device)
            apply_fn, params, buffers = functionalize(model)
            loss = _module_loss(apply_fn)
        elif callable(model_or_loss):
            if params is None:
                raise TypeError("Trainer(loss_fn, ...) needs params= (and buffers=): with a module they come from it")
            loss = model_or_loss
        else:
            raise TypeError(f"Trainer trains an nn.Module or a loss_fn(params, buffers, batch); "
                            f"got {type(model_or_loss).__name__}")
        self.params, self.buffers = params, buffers
        self.sample_fn = sample_fn
        self.step = self._build_step(loss)
        self.run_step = compile_step(self.step) if config.compile else self.step
        self.loader = shard(dataset, batch_size=config.train_batch_size * config.gradient_accumulate_every,
                            shuffle=True, seed=config.seed, drop_last=True, device=self.device)
        if len(self.loader) == 0:
            raise ValueError(f"the dataset has too few samples for one batch of "
                             f"{config.train_batch_size * config.gradient_accumulate_every} per process")
        self.folder = config.results_folder
        self.checkpoints = CheckpointManager(os.path.join(self.folder, "checkpoints"), keep=config.keep_checkpoints)
        self.losses: list[tuple[int, float]] = []
        self._stop = False  # set by SIGTERM; acted on once every rank agrees

    def _build_step(self, loss: Callable) -> Step:
        c = self.config
        step = train_step(loss, adamw(c.train_lr, betas=c.adam_betas, weight_decay=c.weight_decay))
        step = ema(c.ema_decay, every=c.ema_update_every)(clip(c.max_grad_norm)(step))
        if c.gradient_accumulate_every > 1:
            step = accumulate(c.gradient_accumulate_every)(step)
        if c.mixed_precision != "no":
            step = mixed_precision(c.mixed_precision)(step)
        if self.world > 1:
            step = data_parallel()(step)
        return step

    # -- state ---------------------------------------------------------------------------------
    def initial_state(self) -> TrainState:
        """The state a fresh run starts from (identical on every process)."""
        return self.step.init(self.params, self.buffers, seed=self.config.seed)

    def restore(self) -> TrainState:
        """The newest checkpoint's state (and data position), or the initial state."""
        state = self.initial_state()
        path = self.checkpoints.latest()
        if path is None:
            return state
        self._check_config(path, self._saved_config(path))  # before loading: a clear error, not a shape mismatch
        restored = self.checkpoints.load_latest(template=state)
        state, extra = restored.state, restored.extra
        if restored.path != path:  # the newest was damaged and an older one was loaded
            saved = extra.get("config")
            self._check_config(restored.path, TrainConfig.from_dict(saved) if saved is not None else None)
        self.loader.load_state_dict(extra["data"])
        self.losses = [tuple(x) for x in extra.get("losses", [])]
        if self.rank == 0:
            print(f"resumed from {restored.path} at step {restored.step}", flush=True)
        return state

    def _check_config(self, path: str, saved: TrainConfig | None) -> None:
        """Report config values changed since ``path`` was saved; refuse changes of the state's structure."""
        if saved is None:
            return
        changed = saved.diff(self.config)
        breaking = {k: v for k, v in changed.items() if k in STRUCTURAL}
        if breaking:
            raise ValueError(f"cannot resume {path}: {breaking} (saved, now) changes the training state's "
                             f"structure; use a new results_folder")
        if changed and self.rank == 0:
            warnings.warn(f"resuming {path} with changed config (saved, now): {changed}", stacklevel=3)

    def _saved_config(self, path: str) -> TrainConfig | None:
        saved = (load_extra(path) or {}).get("config")
        return TrainConfig.from_dict(saved) if saved is not None else None

    def save(self, state: TrainState) -> None:
        """Write a checkpoint (rank 0; the state is the same on every rank) and the sample grid."""
        step = int(state.step)  # a sync, but only when saving
        if self.rank == 0:
            extra = {"data": self.loader.state_dict(), "losses": self.losses, "config": self.config.to_dict()}
            self.checkpoints.save(step, state, extra=extra)
            if self.sample_fn is not None:
                images = self.sample_fn(state.ema, self.config.num_samples)
                grid = image_grid(images.detach().float().cpu().numpy(), scale=4)
                write_png(os.path.join(self.folder, f"sample-{step}.png"), grid)
        if self.world > 1:
            torch.distributed.barrier()

    # -- the loop ------------------------------------------------------------------------------
    def train(self) -> TrainState:
        """Run (or resume) to ``train_num_steps`` updates and return the final state."""
        c = self.config
        os.makedirs(self.folder, exist_ok=True)
        state = self.restore()
        if self.rank == 0:
            c.save(os.path.join(self.folder, "config.json"))
        trackers = make_trackers(c.trackers, self.folder, c.to_dict(), int(state.step)) if self.rank == 0 else []
        previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        n = start = int(state.step)  # the only read of the device counter: n mirrors it on the host
        bar = self._progress(n)
        t0 = time.perf_counter()
        stop = False
        try:
            while n < c.train_num_steps and not stop:
                for batch in self.loader:
                    state, metrics = self.run_step(state, to_device(batch, self.device))
                    n += 1
                    if bar is not None:
                        bar.update(1)
                    if n % c.log_every == 0 or n == c.train_num_steps:
                        host = _to_host(metrics)
                        host["steps_per_s"] = (n - start) / max(time.perf_counter() - t0, 1e-9)
                        self.losses.append((n, host["loss"]))
                        for t in trackers:
                            t.log(n, host)
                        if bar is not None:
                            bar.set_postfix(loss=f"{host['loss']:.4f}", steps_per_s=f"{host['steps_per_s']:.1f}")
                    if self.world == 1 or n % c.log_every == 0:  # ranks agree on stopping at log steps
                        stop = self._agree(self._stop)
                    if n % c.save_and_sample_every == 0 or n == c.train_num_steps or stop:
                        self.save(state)
                    if n >= c.train_num_steps or stop:
                        break  # (at the end of a pass the loader moves to the next epoch by itself)
            if self.rank == 0:
                write_png(os.path.join(self.folder, "loss.png"), loss_curve([v for _, v in self.losses]))
        finally:
            signal.signal(signal.SIGTERM, previous)
            if bar is not None:
                bar.close()
            for t in trackers:
                t.close()
        return state

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        self._stop = True  # finish the current step, save, return

    def _agree(self, flag: bool) -> bool:
        """Whether any rank wants to stop (every rank must stop at the same step)."""
        if self.world == 1:
            return flag
        t = torch.tensor([1.0 if flag else 0.0], device=self.device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return bool(t.item())

    def _progress(self, initial: int) -> Any:
        if self.rank != 0:
            return None
        try:
            from tqdm.auto import tqdm
        except ImportError:
            return None
        return tqdm(total=self.config.train_num_steps, initial=initial, dynamic_ncols=True)

