"""``ft.Trainer``: the loop around the step, built from the public API only.

A config of hyper-parameters in, and out: checkpoints that resume bit-exactly,
EMA sample grids, metrics (JSONL, TensorBoard, W&B, MLflow) and a loss curve.
"""
from __future__ import annotations

import datetime
import math
import os
import signal
import time
import warnings
from typing import Any, Callable

import torch

from .. import distributed
from .. import tree as T
from ..checkpoint import CheckpointError, CheckpointManager, FolderLock, FolderLocked, StructureMismatch, load_extra
from ..compile import compile as compile_step
from ..distributed import data_parallel, shard
from ..driver import _to_host, to_device
from ..module import functionalize
from ..optim import adamw
from ..state import TrainState
from ..step import Step, train_step
from ..transforms import accumulate, clip, ema, mixed_precision, skip_nonfinite
from .config import TrainConfig
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
    ``accumulate(gradient_accumulate_every)``, ``mixed_precision(...)``,
    ``skip_nonfinite()`` (unless fp16, whose loss scale skips, or
    ``skip_nonfinite=False``) and, when launched on several processes,
    ``data_parallel()``; compiled unless ``config.compile`` is false. ``train()``
    runs to ``train_num_steps`` optimizer updates; every ``save_and_sample_every``
    updates it writes a checkpoint (state + data position + config) under
    ``results_folder/checkpoints`` and, with ``sample_fn(ema_params, num_samples)
    -> images in [0, 1]``, a ``sample-{step}.png`` grid. Running it again resumes
    from the newest checkpoint, bit-exactly.

    Under faults:

    * **Non-finite updates** are skipped (params, optimizer state and EMA stay
      as they were); at log steps a warning gives the step and the count, and
      ``max_consecutive_nonfinite`` skipped updates in a row save and stop with
      ``FloatingPointError``. A checkpoint whose params or EMA are not finite is
      marked so, and rotation never removes the newest finite one.
    * **SIGTERM** finishes the current step, saves and returns. On several
      processes the ranks agree on stopping every ``AGREE_SECONDS`` (5 s) of
      measured step time (one 2-number all-reduce), so they stop within about
      5 s plus one step of the signal, then rank 0 saves: this must fit in the
      launcher's grace period before SIGKILL (torchrun: 30 s).
    * **One run per results folder**: rank 0 holds :class:`~functrain.checkpoint.FolderLock`
      on it for the whole of ``train()``; a second run fails at once naming the
      folder and the holder's pid and host. A killed holder's lock is released by
      the OS and taken over.
    * **Slow saves and samples** are waited for on a gloo group of their own with
      ``save_timeout`` seconds (not the collective timeout).
    * **Resume** skips damaged checkpoints with a warning naming each and why,
      and refuses a checkpoint whose state structure differs from this run's
      (naming the paths and the config changes) before reading any tensor.

    Example::

        trainer = ft.Trainer(model, dataset, ft.TrainConfig(train_num_steps=1000), sample_fn=sample)
        state = trainer.train()
    """

    AGREE_SECONDS = 5.0  # the ranks agree on stopping at least this often (in measured step time)

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
        self.skipped_updates = 0  # non-finite updates skipped by this process's train() calls (read at log steps)
        self._stop = False  # set by SIGTERM; acted on once every rank agrees
        self._save_group: Any = None

    def _build_step(self, loss: Callable) -> Step:
        c = self.config
        step = train_step(loss, adamw(c.train_lr, betas=c.adam_betas, weight_decay=c.weight_decay))
        step = ema(c.ema_decay, every=c.ema_update_every)(clip(c.max_grad_norm)(step))
        if c.gradient_accumulate_every > 1:
            step = accumulate(c.gradient_accumulate_every)(step)
        if c.mixed_precision != "no":
            step = mixed_precision(c.mixed_precision)(step)
        if c.skip_nonfinite and c.mixed_precision != "fp16":  # fp16's loss scaling skips non-finite steps itself
            step = skip_nonfinite()(step)
        if self.world > 1:
            step = data_parallel()(step)
        return step

    # -- state ---------------------------------------------------------------------------------
    def initial_state(self) -> TrainState:
        """The state a fresh run starts from (identical on every process)."""
        return self.step.init(self.params, self.buffers, seed=self.config.seed)

    def restore(self) -> TrainState:
        """The newest good checkpoint's state (and data position), or the initial state.

        Damaged checkpoints are skipped with a warning naming each; a checkpoint whose state structure
        differs from this run's raises ``ValueError`` before any tensor is read.
        """
        state = self.initial_state()
        with warnings.catch_warnings():
            if self.rank != 0:  # every rank reads the same files: warn once
                warnings.simplefilter("ignore")
            try:
                restored = self.checkpoints.load_latest(template=state)
            except StructureMismatch as e:
                raise ValueError(self._mismatch_message(e)) from None
        if restored is None:
            return state
        extra = restored.extra if isinstance(restored.extra, dict) else {}
        saved = extra.get("config")
        if saved is not None:
            changed = TrainConfig.from_dict(saved).diff(self.config)
            if changed and self.rank == 0:
                warnings.warn(f"resuming {restored.path} with changed config (saved, now): {changed}", stacklevel=2)
        if "data" not in extra:
            raise CheckpointError(f"{restored.path}: its extra.json has no data position; it was not written by "
                                  f"ft.Trainer")
        state = restored.state
        self.loader.load_state_dict(extra["data"])
        self.losses = [tuple(x) for x in extra.get("losses", [])]
        if self.rank == 0:
            print(f"resumed from {restored.path} at step {restored.step}", flush=True)
        return state

    def _mismatch_message(self, e: StructureMismatch) -> str:
        where = "; ".join(f"{p!r}: {w}" for p, w in e.differences)
        try:
            saved = (load_extra(e.path) or {}).get("config")
            changed = TrainConfig.from_dict(saved).diff(self.config) if saved is not None else None
        except (CheckpointError, ValueError, TypeError, AttributeError):
            changed = None
        cause = (f"; config changes since it was saved (saved, now): {changed}" if changed else
                 "; its config is the same or unknown: the model or the trainer changed")
        return (f"cannot resume {e.path}: the training state's structure differs from this run's at {where}"
                f"{cause}. Use a new results_folder, or the config it was saved with")

    def _finite(self, state: TrainState) -> bool:
        leaves = [t for t in T.tree_leaves((state.params, state.ema)) if torch.is_tensor(t)]
        if not leaves:
            return True
        return bool(torch.stack([torch.isfinite(t).all() for t in leaves]).all())

    def save(self, state: TrainState) -> None:
        """Write a checkpoint (rank 0; the state is the same on every rank) and the sample grid.

        The other ranks wait for it on a gloo group bounded by ``config.save_timeout``, so a slow save or
        ``sample_fn`` never trips the collective timeout.
        """
        step = int(state.step)  # a sync, but only when saving
        if self.rank == 0:
            extra = {"data": self.loader.state_dict(), "losses": self.losses, "config": self.config.to_dict()}
            finite = self._finite(state)
            path = self.checkpoints.save(step, state, extra=extra, finite=finite)
            if not finite:
                good = self.checkpoints.newest_finite()
                kept = f"rotation keeps {self.checkpoints.path(good)}, the newest finite one" if good is not None \
                    else "there is no finite checkpoint"
                warnings.warn(f"checkpoint {path} (step {step}) holds non-finite parameters or EMA; {kept}",
                              RuntimeWarning, stacklevel=2)
            if self.sample_fn is not None:
                images = self.sample_fn(state.ema, self.config.num_samples)
                grid = image_grid(images.detach().float().cpu().numpy(), scale=4)
                write_png(os.path.join(self.folder, f"sample-{step}.png"), grid)
        if self.world > 1:
            group = self._save_group
            if group is None:
                group = self._save_group = torch.distributed.new_group(
                    backend="gloo", timeout=datetime.timedelta(seconds=self.config.save_timeout))
            torch.distributed.barrier(group=group)

    # -- the loop ------------------------------------------------------------------------------
    def train(self) -> TrainState:
        """Run (or resume) to ``train_num_steps`` updates and return the final state."""
        c = self.config
        os.makedirs(self.folder, exist_ok=True)
        lock = self._lock_folder()
        trackers: list = []
        previous = None
        bar = None
        try:
            if self.world > 1 and self._save_group is None:  # every rank creates it, in the same order
                self._save_group = torch.distributed.new_group(
                    backend="gloo", timeout=datetime.timedelta(seconds=c.save_timeout))
            state = self.restore()
            if self.rank == 0:
                c.save(os.path.join(self.folder, "config.json"))
            trackers = make_trackers(c.trackers, self.folder, c.to_dict(), int(state.step)) if self.rank == 0 else []
            previous = signal.signal(signal.SIGTERM, self._on_sigterm)
            n = start = int(state.step)  # the only read of the device counter: n mirrors it on the host
            bar = self._progress(n)
            t0 = time.perf_counter()
            stop = False
            agree_at, agree_n, agree_t = n + 1, n, time.monotonic()
            skipped: list[torch.Tensor] = []  # each update's `skipped` flag (device tensors), read at log steps
            run_nonfinite = 0  # skipped updates in a row, as of the last read
            tracked: bool | None = None
            while n < c.train_num_steps and not stop:
                for batch in self.loader:
                    state, metrics = self.run_step(state, to_device(batch, self.device))
                    n += 1
                    if bar is not None:
                        bar.update(1)
                    if tracked is None:
                        tracked = "skipped" in metrics
                    if tracked:
                        skipped.append(metrics["skipped"])
                    log = n % c.log_every == 0 or n == c.train_num_steps
                    if tracked and (log or len(skipped) >= c.max_consecutive_nonfinite):
                        run_nonfinite = self._count_skipped(n, skipped, run_nonfinite, state)
                    if log:
                        host = _to_host(metrics)
                        host["steps_per_s"] = (n - start) / max(time.perf_counter() - t0, 1e-9)
                        host["skipped_updates"] = self.skipped_updates
                        self.losses.append((n, host["loss"]))
                        for t in trackers:
                            t.log(n, host)
                        if bar is not None:
                            bar.set_postfix(loss=f"{host['loss']:.4f}", steps_per_s=f"{host['steps_per_s']:.1f}")
                        if not tracked and not math.isfinite(host["loss"]) and self.rank == 0:
                            warnings.warn(f"step {n}: the loss is {host['loss']} and skip_nonfinite is off: the "
                                          f"parameters may now be non-finite", RuntimeWarning, stacklevel=2)
                    if self.world == 1:
                        stop = self._stop
                    elif n >= agree_at:  # the same steps on every rank: derived from all-reduced numbers only
                        now = time.monotonic()
                        stop, per_step = self._agree(self._stop, (now - agree_t) / max(n - agree_n, 1))
                        agree_at = n + max(1, min(int(self.AGREE_SECONDS / max(per_step, 1e-6)), 1 << 20))
                        agree_n, agree_t = n, now
                    if n % c.save_and_sample_every == 0 or n == c.train_num_steps or stop:
                        self.save(state)
                    if n >= c.train_num_steps or stop:
                        break  # (at the end of a pass the loader moves to the next epoch by itself)
            if self.rank == 0:
                write_png(os.path.join(self.folder, "loss.png"), loss_curve([v for _, v in self.losses]))
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
            if bar is not None:
                bar.close()
            for t in trackers:
                t.close()
            if lock is not None:
                lock.release()
        return state

    def _count_skipped(self, n: int, flags: list[torch.Tensor], run: int, state: TrainState) -> int:
        """Read the pending `skipped` flags (one host sync), warn, and stop after too many in a row."""
        values = torch.stack(flags).tolist()
        flags.clear()
        k = int(sum(values))
        if k == 0:
            return 0
        self.skipped_updates += k
        for v in values:
            run = run + 1 if v else 0
        limit = self.config.max_consecutive_nonfinite
        if self.rank == 0:
            why = "fp16 loss-scale overflow or " if self.config.mixed_precision == "fp16" else ""
            warnings.warn(f"step {n}: {k} of the last {len(values)} updates skipped ({why}non-finite loss or "
                          f"gradient), {self.skipped_updates} in this run; {run} in a row now (the run stops at "
                          f"{limit})", RuntimeWarning, stacklevel=3)
        if run >= limit:
            self.save(state)  # the state is the last finite one: keep the progress made since the last save
            raise FloatingPointError(
                f"{run} updates in a row up to step {n} had a non-finite loss or gradient and were skipped "
                f"(TrainConfig.max_consecutive_nonfinite={limit}): the data or the hyper-parameters produce "
                f"inf/NaN. The state (params and EMA unchanged since the last finite update) is saved in "
                f"{self.checkpoints.path(n)}")
        return run

    def _lock_folder(self) -> FolderLock | None:
        """Rank 0 locks the results folder for the run; every rank fails together if another run holds it."""
        lock, error = None, None
        if self.rank == 0:
            try:
                lock = FolderLock(self.folder).acquire()
            except FolderLocked as e:
                error = e
        if self.world > 1:
            t = torch.tensor([0.0 if error is None else 1.0], device=self.device)
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
            if t.item() and error is None and self.rank != 0:
                raise RuntimeError(f"{os.path.abspath(self.folder)} is in use by another run (rank 0 could not lock "
                                   f"it; see its error)")
        if error is not None:
            raise error
        return lock

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        self._stop = True  # finish the current step, save, return

    def _agree(self, flag: bool, seconds_per_step: float) -> tuple[bool, float]:
        """Whether any rank wants to stop, and the slowest rank's seconds per step (one all-reduce)."""
        t = torch.tensor([1.0 if flag else 0.0, seconds_per_step], dtype=torch.float64, device=self.device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        stop, per_step = t.tolist()
        return stop > 0, per_step

    def _progress(self, initial: int) -> Any:
        if self.rank != 0:
            return None
        try:
            from tqdm.auto import tqdm
        except ImportError:
            return None
        return tqdm(total=self.config.train_num_steps, initial=initial, dynamic_ncols=True)
