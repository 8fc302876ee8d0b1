"""``ft.Trainer``: the loop around the step, built from the public API only.

A config of hyper-parameters in, and out: checkpoints that resume bit-exactly,
EMA sample grids, metrics (JSONL, TensorBoard, W&B, MLflow) and a loss curve.
"""
from __future__ import annotations

import datetime
import math
import os
import time
import warnings
from typing import Any, Callable

import torch

from .. import distributed
from ..core import tree as T
from ..checkpoint.export import export_weights
from ..checkpoint import CheckpointError, CheckpointManager, FolderLock, FolderLocked, StructureMismatch, load_extra
from ..checkpoint.per_rank import is_sharded
from ..compiler import Runner
from ..compiler.api import compile as compile_step
from ..data import shard
from ..distributed import PeerFailed, gather_state
from ..distributed.comm import check_same
from ..driver import run
from ..core.module import functionalize
from ..core.state import TrainState
from .config import TrainConfig
from .evaluator import Evaluator
from .hooks import Hooks
from .images import write_sample_grid
from .plots import MetricHistory, write_run_plot
from .summary import FirstBatch, MemoryLine, run_summary
from .build import build_step, checked_loss, model_loss
from .compiling import compile_log, compile_notes, watch_compile
from .run_state import RunState, StopSignals
from .inputs import batch_line, ema_copy, load_weights, process_batch, resolve_dataset, with_augmentation
from .trackers import check_trackers, make_trackers

__all__ = ["Trainer"]


class Trainer:
    """Train ``model`` (a module whose ``forward(*batch)`` returns the loss) or ``loss_fn`` on ``dataset``.

    The step is ``train_step(loss, adamw(lr, adam_betas, weight_decay))`` (the lr
    from ``train_lr`` and ``lr_schedule``) with ``clip(max_grad_norm)``,
    ``ema(ema_decay, every=ema_update_every)``,
    ``accumulate(gradient_accumulate_every)``, ``mixed_precision(...)``,
    ``skip_nonfinite()`` (unless fp16, whose loss scale skips, or
    ``skip_nonfinite=False``), then your ``transforms=`` and, when launched on
    several processes, ``data_parallel(shard=config.shard)`` (a sharded one on one
    process too, so that the checkpoints' layout does not depend on the world
    size); compiled unless ``config.compile`` is false. ``optimizer=`` replaces AdamW (any functrain optimizer; a
    ``torch.optim`` one is refused with how to port it); ``step=`` brings a ready
    step, used as is (plus ``data_parallel()`` on several processes). Every
    schedule must cover ``train_num_steps`` (``ft.optim.schedules.check_covers``).

    The model's ``forward`` (or ``loss_fn``) may return a scalar loss, ``(loss,
    aux)``, a dict with ``"loss"`` or an object with ``.loss`` (a Hugging Face
    ``ModelOutput``); other scalar entries become metrics. A batch that is a dict
    is passed as keyword arguments, a tuple as positional ones. ``dataset``: anything
    :func:`functrain.shard` takes, or a folder of images (a path: an :class:`~functrain.data.ImageFolder`
    of the model's ``image_size``, flipped inside the step, as denoising-diffusion-pytorch's
    ``Trainer(diffusion, folder)``). Batch sizes follow ``TrainConfig.split_batches`` (per process by
    default). After ``train()`` the module holds the final params and buffers (copied in place) and
    :meth:`ema_module` gives a copy holding the EMA.

    ``train()`` runs :func:`functrain.run` to ``train_num_steps`` optimizer
    updates (one loop, one progress bar) and acts through its hooks: every
    ``log_every`` updates metrics go to the trackers; every
    ``save_and_sample_every`` updates (and at the end) it writes a checkpoint
    (state + data position + config + metric history) under
    ``results_folder/checkpoints`` and, with ``sample_fn(ema_params,
    num_samples) -> images in [0, 1]``, a ``sample-{step}.png`` grid; with
    ``eval_dataset`` it evaluates (see :class:`~functrain.trainer.evaluator.Evaluator`)
    every ``eval_every`` updates (0: at each save) and at the end. Running it
    again resumes from the newest checkpoint, bit-exactly.

    With a sharded state (``config.shard`` ``"optimizer"`` or ``"params"``) every
    rank writes its shard of each checkpoint (no gather), and the whole params
    and EMA are gathered (``ft.gather_state``, every rank) only where whole
    tensors are needed: sample grids, evaluation and the exported weights, which
    rank 0 alone writes. ``train()`` returns the sharded state then.

    Outputs in ``results_folder`` (docs/trainer.md lists each): ``metrics.jsonl`` and your trackers, ``metrics.png``,
    ``sample-{step}.png`` grids, ``checkpoints/``, and at the end ``model.safetensors`` / ``ema.safetensors``
    (plain state dicts) and a summary printed by rank 0.

    Hooks for you (``on_log=``, ``on_eval=``, ``on_save=``, ``should_stop=``, or
    objects in ``callbacks=``; see :class:`~functrain.trainer.hooks.Callback`).
    The loop adds no host sync per step: metrics are read at log steps only.

    Under faults the Trainer keeps these promises (docs/faults.md says each in full): non-finite updates
    are skipped and counted, ``max_consecutive_nonfinite`` in a row save and stop; SIGTERM or Ctrl-C (or
    ``should_stop``) stops every rank at the same step, at most one step late (a vote every step, a CPU number
    on a gloo group: no device sync), and saves within the launcher's ``--term-timeout`` (a 2nd Ctrl-C: at once,
    saying what is lost: :class:`~functrain.trainer.run_state.StopSignals`); one run per
    results folder (:class:`~functrain.checkpoint.FolderLock`); saves waited for ``save_timeout`` seconds;
    resume skips damaged checkpoints naming each, and on several processes the ranks agree on one
    checkpoint whole on every rank, or all refuse; a symbolic link where the trainer writes is refused
    (:class:`~functrain.checkpoint.LinkRefused`).

    Example::

        config = ft.TrainConfig(train_num_steps=1000, lr_schedule="warmup_cosine", warmup_steps=50)
        trainer = ft.Trainer(model, dataset, config, sample_fn=sample, eval_dataset=held_out)
        state = trainer.train()

    Args:
        model_or_loss: a module whose ``forward(*batch)`` (or ``forward(**batch)``) returns the loss (or an object
            or dict holding it), or a ``loss_fn(params, buffers, batch)`` (then pass ``params``/``buffers``).
        dataset: a map-style dataset, a sequence, in-memory columns, a ``DataLoader``, or a folder of images.
        config: the :class:`TrainConfig`.
        sample_fn: ``sample_fn(ema_params, n) -> images`` for the sample grids (``None``: no samples).
        params, buffers: with a ``loss_fn``: the initial tensors.
        optimizer: a functrain optimizer instead of the config's AdamW.
        transforms: transforms added to the composed step.
        step: a ready step used as it is (its ``accumulate`` must match the config).
        eval_dataset: held-out data for ``eval_loss`` / ``eval_loss_ema``.
        callbacks, on_log, on_save, on_eval, should_stop: hooks (see :class:`Callback`).
        trackers: tracker objects with ``log(step, metrics)``, besides ``config.trackers``.

    As a doctest (eager, 3 updates, into a temporary folder)::

        >>> import contextlib, io, tempfile, torch, functrain as ft
        >>> class Regress(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.lin = torch.nn.Linear(2, 1)
        ...     def forward(self, x, y):
        ...         return torch.nn.functional.mse_loss(self.lin(x), y)
        >>> data = [(torch.randn(2), torch.randn(1)) for _ in range(16)]
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     config = ft.TrainConfig(train_batch_size=4, gradient_accumulate_every=1, train_num_steps=3,
        ...                             compile=False, results_folder=folder, save_and_sample_every=3,
        ...                             log_every=1, trackers=())
        ...     with contextlib.redirect_stdout(io.StringIO()):   # the run's summary
        ...         state = ft.Trainer(Regress(), data, config).train()
        >>> int(state.step)
        3
    """

    PLOT_SECONDS = 10.0  # the metrics plot is redrawn at a save if the last one is older than this

    def __init__(self, model_or_loss: Any, dataset: Any, config: TrainConfig,
                 sample_fn: Callable[[Any, int], torch.Tensor] | None = None, *, params: Any = None,
                 buffers: Any = None, optimizer: Any = None, transforms: Any = (), step: Any = None,
                 eval_dataset: Any = None, callbacks: list | tuple = (), on_log: Callable | None = None,
                 on_save: Callable | None = None, on_eval: Callable | None = None,
                 should_stop: Callable | None = None, trackers: list | tuple = ()):
        if not isinstance(config, TrainConfig):
            raise TypeError(f"Trainer needs a functrain.TrainConfig; got {type(config).__name__}")
        self.config = config
        self.hooks = Hooks(callbacks, on_log=on_log, on_save=on_save, on_eval=on_eval, should_stop=should_stop)
        if isinstance(trackers, str) or not isinstance(trackers, (list, tuple)):
            raise TypeError(f"Trainer(trackers=...) takes a list of tracker objects (log(step, metrics)) or names; "
                            f"got {type(trackers).__name__} (names can also go in TrainConfig.trackers)")
        self.tracker_items = check_trackers((*config.trackers, *trackers))
        if eval_dataset is None and config.eval_every:
            raise ValueError(f"TrainConfig.eval_every={config.eval_every} but the Trainer has no eval_dataset=")
        self.info = distributed.init()
        self.world = distributed.world_size()
        self.rank = distributed.rank()
        self.device = distributed.device()
        if self.world > 1:  # every rank must train the same run: one all-gather of a hash per field
            check_same(config.to_dict(), "TrainConfig")
        self.module: torch.nn.Module | None = None
        if isinstance(model_or_loss, torch.nn.Module):
            self.module = model = model_or_loss.to(self.device)
            apply_fn, params, buffers = functionalize(model)
            loss = model_loss(apply_fn)
        elif callable(model_or_loss):
            if params is None:
                raise TypeError("Trainer(loss_fn, ...) needs params= (and buffers=): with a module they come from it")
            loss = checked_loss(model_or_loss)
        else:
            raise TypeError(f"Trainer trains an nn.Module or a loss_fn(params, buffers, batch); "
                            f"got {type(model_or_loss).__name__}")
        self.params, self.buffers = params, buffers
        self.sample_fn = sample_fn
        dataset = resolve_dataset(dataset, model_or_loss)  # a folder of images, as the package's Trainer reads it
        transforms = with_augmentation(dataset, transforms, step)
        self.step, compiled = build_step(loss, config, self.world, optimizer=optimizer, transforms=transforms,
                                         step=step, module=self.module)
        if compiled is None and config.compile:
            compiled = compile_step(self.step, background=config.compile_background,
                                    switch_at=config.compile_switch_at)
        self.compiled = compiled  # the CompiledStep, or None; run_step: what ft.run runs (its runner, owned here)
        self.run_step = compiled.runner(donate=True, background=True) if compiled is not None else self.step
        per_process = process_batch(config, self.world)  # TrainConfig.split_batches: the one batch-size rule
        self.loader = shard(dataset, batch_size=per_process * config.gradient_accumulate_every,
                            shuffle=True, seed=config.seed, drop_last=True, device=self.device)
        self.loader.check_nonempty("train dataset", remedy=(
            f"the Trainer drops an incomplete last batch, so lower TrainConfig.train_batch_size (now "
            f"{config.train_batch_size}) or gradient_accumulate_every (now {config.gradient_accumulate_every}: a "
            f"rank's batch is their product), use fewer processes (now {self.world}) or add data"))
        self.evaluator: Evaluator | None = None
        if eval_dataset is not None:
            eval_batch = per_process if config.eval_batch_size is None else \
                process_batch(config, self.world, config.eval_batch_size, "eval_batch_size")
            self.evaluator = Evaluator(loss, eval_dataset, eval_batch, device=self.device, module=self.module,
                                       seed=config.seed)
        self.folder = config.results_folder
        self.checkpoints = CheckpointManager(os.path.join(self.folder, "checkpoints"), keep=config.keep_checkpoints)
        self.history = MetricHistory()  # every logged metric (and evaluation), kept in checkpoints
        self.plot_path: str | None = None
        self._plotted_at: float | None = None
        self.weights: dict = {}
        self.skipped_updates = 0  # non-finite updates skipped by this process's train() calls (read at log steps)
        self._stop = self._signalled = False  # stop: a signal or should_stop; signalled: SIGTERM/Ctrl-C, no export
        self._signals = StopSignals(self._on_sigterm, self.rank, self.checkpoints)
        self._save_group: Any = None
        self._stop_group: Any = None  # gloo: the per-step stop votes (CPU numbers, never a device sync)
        self._run: RunState | None = None
        self.state: TrainState | None = None  # what the last train() returned
        self._ema_module: torch.nn.Module | None = None
        if self.world > 1 and self.rank == 0:  # the batch rule, said once
            print(batch_line(config, self.world, per_process), flush=True)

    # -- state ---------------------------------------------------------------------------------
    def initial_state(self) -> TrainState:
        """The state a fresh run starts from (identical on every process)."""
        return self.step.init(self.params, self.buffers, seed=self.config.seed)

    def restore(self) -> TrainState:
        """The newest good checkpoint's state (and data position), or the initial state.

        Damaged checkpoints are skipped with a warning naming each; a checkpoint whose state structure
        differs from this run's raises ``ValueError`` before any tensor is read. On several processes every
        rank calls it together and all resume from the same checkpoint: the newest that is whole on every
        rank (each checks its own shard; ``CheckpointManager.load_latest(group=...)``, bounded by
        ``save_timeout``). If checkpoints exist and none is whole, every rank raises the same error.
        """
        state = self.initial_state()
        group = None
        if self.world > 1:  # the ranks agree on one checkpoint, within save_timeout (every rank creates it)
            if self._save_group is None:
                self._save_group = torch.distributed.new_group(
                    backend="gloo", timeout=datetime.timedelta(seconds=self.config.save_timeout))
            group = self._save_group
        with warnings.catch_warnings():
            if self.rank != 0:  # rank 0 names every skipped checkpoint (with the rank that found it damaged)
                warnings.simplefilter("ignore")
            try:
                restored = self.checkpoints.load_latest(template=state, group=group)
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
        if "history" in extra:
            self.history = MetricHistory.from_json(extra["history"]).truncate(restored.step)
        else:  # a checkpoint written before the history: its loss curve
            self.history = MetricHistory({"loss": extra.get("losses", [])}).truncate(restored.step)
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

    def save(self, state: TrainState, step: int | None = None) -> None:
        """Write a checkpoint and the sample grid (rank 0; every rank writes its shard of a sharded state).

        ``step`` is the host mirror of ``state.step`` (read from the state if not given). The other ranks
        wait for it on a gloo group bounded by ``config.save_timeout``, so a slow save or ``sample_fn``
        never trips the collective timeout.
        """
        step = int(state.step) if step is None else step  # a sync, but only when saving
        split = is_sharded(state)
        if self.rank == 0 or split:  # a sharded state: every rank writes its shard (a collective save)
            extra = {"data": self.loader.state_dict(), "history": self.history.to_json(),
                     "config": self.config.to_dict()}
            finite = self._finite(state)
            if split and self.world > 1:  # every shard finite: one flag for the whole state
                t = torch.tensor([1.0 if finite else 0.0], device=self.device)
                torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN)
                finite = bool(t.item())
            path = self.checkpoints.save(step, state, extra=extra, finite=finite)
            whole = gather_state(state) if split and self.sample_fn is not None else state  # (every rank)
        if self.rank == 0:
            if not finite:
                good = self.checkpoints.newest_finite()
                kept = f"rotation keeps {self.checkpoints.path(good)}, the newest finite one" if good is not None \
                    else "there is no finite checkpoint"
                warnings.warn(f"checkpoint {path} (step {step}) holds non-finite parameters or EMA; {kept}",
                              RuntimeWarning, stacklevel=2)
            if self.sample_fn is not None:
                images = self.sample_fn(whole.ema, self.config.num_samples)
                write_sample_grid(os.path.join(self.folder, f"sample-{step}.png"),
                                  images.detach().float().cpu().numpy(), step=step, scale=4)
            self._plot(force=step >= self.config.train_num_steps or self._stop or self._run is None)
            self.hooks.call("on_save", step, path)
        if self.world > 1:
            group = self._save_group
            if group is None:
                group = self._save_group = torch.distributed.new_group(
                    backend="gloo", timeout=datetime.timedelta(seconds=self.config.save_timeout))
            torch.distributed.barrier(group=group)
        if self._run is not None:
            self._run.saved_at = step

    def evaluate(self, state: TrainState, step: int | None = None) -> dict:
        """Evaluate ``state`` on the eval set (every process takes part), log it and call ``on_eval``."""
        if self.evaluator is None:
            raise ValueError("Trainer.evaluate needs Trainer(eval_dataset=...)")
        step = int(state.step) if step is None else step
        metrics = self.evaluator(gather_state(state) if is_sharded(state) else state)  # whole params and EMA
        self.history.add(step, metrics)
        r = self._run
        if r is not None:
            r.last.update(metrics)
            if r.unsent is not None and r.unsent[0] == step:  # one record per step: with the step's log
                r.unsent[1].update(metrics)
            else:
                r.emit(step, metrics)
        self.hooks.call("on_eval", step, metrics)
        if self.hooks.stop(step, metrics):
            self._stop = True
        return metrics

    # -- the loop ------------------------------------------------------------------------------
    def train(self) -> TrainState:
        """Run (or resume) to ``train_num_steps`` updates and return the final state."""
        c = self.config
        self._stop = self._signalled = False  # (a stopped trainer may be run again: it resumes)
        os.makedirs(self.folder, exist_ok=True)
        lock = self._lock_folder()
        run_state = None
        done = False
        try:
            if self.world > 1 and self._save_group is None:  # every rank creates them, in the same order
                self._save_group = torch.distributed.new_group(
                    backend="gloo", timeout=datetime.timedelta(seconds=c.save_timeout))
            if self.world > 1 and self._stop_group is None:
                self._stop_group = torch.distributed.new_group(backend="gloo",
                                                               timeout=distributed.default_timeout())
            state = self.restore()
            if self.rank == 0:
                c.save(os.path.join(self.folder, "config.json"))
            start = int(state.step)  # the only read of the device counter: the loop's index mirrors it on the host
            trackers = make_trackers(self.tracker_items, self.folder, c.to_dict(), start) if self.rank == 0 else []
            self._run = run_state = RunState(start, trackers, compiled=self.compiled is not None)
            watch_compile(self.run_step, run_state)
            self._signals.install(run_state)  # SIGTERM, Ctrl-C: stop at the agreed step and save
            run_state.memory = MemoryLine(self.run_step, self.rank, run_state.progress)
            data = FirstBatch(self.loader, lambda batch: run_state.memory.first(state, batch))  # before step 1
            state = run(self.run_step, state, data, num_steps=max(c.train_num_steps - start, 0),
                        log_every=c.log_every, device=self.device, progress=self.rank == 0, on_log=self._on_log,
                        on_step=self._on_step, start=start)
            run_state.end_vote()  # the last step's vote, which every rank started: let it finish
            if self._signalled and isinstance(self.run_step, Runner):
                self.run_step.finish_after_exit(False)  # stopped by SIGTERM: a running compile dies with us
            if run_state.n != run_state.saved_at:  # stopped between saves (SIGTERM, should_stop)
                self.save(state, run_state.n)
            if self._signalled:
                self._signals.saved(run_state.n)
            if run_state.in_a_row >= c.max_consecutive_nonfinite:  # counted by the stop step's log
                self._nonfinite_stop(run_state.n, None)
            self._export(state)
            self._load_module(state)
            done = True
        finally:
            self._run = None
            self._signals.restore()
            for t in run_state.trackers if run_state is not None else ():
                t.close()
            if lock is not None:
                lock.release()
        if done and self.rank == 0 and run_state.n > run_state.start:
            print(self.summary(run_state), flush=True)
        return state

    def _export(self, state: TrainState) -> None:
        """``model.safetensors`` / ``ema.safetensors`` by rank 0 (a sharded state is gathered on every rank
        first), unless stopped by SIGTERM: its grace period is for the checkpoint."""
        signalled = self._signalled
        split = is_sharded(state)
        if split and self.world > 1:  # the gather is collective: every rank must agree on whether to export
            t = torch.tensor([1.0 if signalled else 0.0], device=self.device)
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
            signalled = bool(t.item())
        if signalled:
            return
        whole = gather_state(state) if split else state
        if self.rank == 0:
            self.weights = export_weights(self.folder, whole, module=self.module)

    def _load_module(self, state: TrainState) -> None:
        """Leave the user's module trained: the final params and buffers copied into its own tensors (every
        rank; a sharded state is gathered first, a collective)."""
        self.state = state
        if self.module is not None:
            whole = gather_state(state) if is_sharded(state) else state
            # the initial params share the module's storage: keep them (initial_state() stays the start)
            self.params, self.buffers = load_weights(self.module, whole.params, whole.buffers, self.params,
                                                     self.buffers)

    def ema_module(self, ema_params: Any = None) -> torch.nn.Module:
        """A copy of the trained module holding the EMA weights (in eval mode), as ema-pytorch's ``ema_model``.

        ``ema_params``: the EMA params to hold (what ``sample_fn`` receives), default the last ``train()``'s
        final EMA (and buffers). One copy per trainer (``copy.deepcopy``), refilled on each call. Example::

            sample_fn = lambda ema, n: trainer.ema_module(ema).sample(batch_size=n)   # during training
            images = trainer.ema_module().sample(batch_size=16)                       # after train()
        """
        state = None
        if ema_params is None and self.state is not None:
            state = gather_state(self.state) if is_sharded(self.state) else self.state  # (a collective)
        self._ema_module = ema_copy(self.module, self._ema_module, ema_params, state)
        return self._ema_module

    def summary(self, r: "RunState") -> str:
        """The end-of-run text: final metrics, time (compile apart), where the results are."""
        outputs = {"weights": self.weights.get("model"), "EMA weights": self.weights.get("ema"),
                   "metrics plot": self.plot_path,  # (metrics.jsonl: the jsonl tracker's own line)
                   "checkpoint": self.checkpoints.path(r.saved_at)}
        head = "" if not self._signalled else (f"stopped by {self._signals.signal} at step {r.n} and saved it "
                                               f"({self.checkpoints.path(r.n)}); resume by running again\n")
        return head + run_summary(results_folder=self.folder, step=r.n, total_steps=self.config.train_num_steps,
                                  final_metrics={k: v for k, v in r.last.items() if k in _SUMMARY},
                                  wall_time_s=time.perf_counter() - r.t0,
                                  compile_time_s=r.compile_s if r.compiled else None, steps_run=r.n - r.start,
                                  outputs=outputs, trackers=r.trackers, notes=compile_notes(r))

    def _plot(self, force: bool = False) -> None:
        """Rewrite the metrics plot (rank 0, at every save): one panel per metric, the step on x.

        Drawing takes about a second, so saves closer than ``PLOT_SECONDS`` apart share one plot;
        the last save (the end, a stop) always draws.
        """
        now = time.monotonic()
        if not force and self._plotted_at is not None and now - self._plotted_at < self.PLOT_SECONDS:
            return
        path = write_run_plot(self.folder, self.history)
        if path is not None:  # (None: saved before the first log step, nothing to draw yet)
            self.plot_path, self._plotted_at = path, time.monotonic()

    # -- the hooks of ft.run (no host sync but at log, agreement, eval and save steps) ----------
    def _on_log(self, n: int, host: dict) -> None:
        r = self._run
        r.logged_at = n
        if "skipped" in host:  # the flags of the steps since the last read, and this one's
            flags = r.pending if r.pending_until == n else r.pending + [torch.tensor(host["skipped"])]
            r.pending, r.pending_until = [], n
            r.in_a_row = self._count_skipped(n, flags, r.in_a_row)  # (a stop it calls for is made in _on_step)
        now = time.perf_counter()
        r.first_done(now)
        compile_log(r, n, host)
        if r.compiled and r.first_at is not None and "compile_s" not in r.reported:
            host["compile_s"] = r.compile_s
            r.reported.add("compile_s")
        if r.compiled:  # the throughput from the first step after compilation
            if r.first_at is not None and n > r.start + 1:
                host["steps_per_s"] = (n - r.start - 1) / max(now - r.first_at, 1e-9)
        else:
            host["steps_per_s"] = (n - r.start) / max(now - r.t0, 1e-9)
        host["skipped_updates"] = self.skipped_updates
        self.history.add(n, host)
        r.last.update(host)
        if r.n == n:  # the log of a stop step comes after its _on_step: send it now
            r.emit(n, host)
        else:  # sent at the end of _on_step, with the step's evaluation if it has one
            r.unsent = (n, dict(host))
        if "skipped" not in host and not math.isfinite(host["loss"]) and self.rank == 0:
            warnings.warn(f"step {n}: the loss is {host['loss']} and skip_nonfinite is off: the "
                          f"parameters may now be non-finite", RuntimeWarning, stacklevel=2)
        self.hooks.call("on_log", n, host)
        if self.hooks.stop(n, host):
            self._stop = True

    def _on_step(self, n: int, state: TrainState, metrics: dict) -> bool:
        try:
            return self._step_done(n, state, metrics)
        finally:
            r = self._run
            if r.unsent is not None:
                r.emit(*r.unsent)
                r.unsent = None

    def _step_done(self, n: int, state: TrainState, metrics: dict) -> bool:
        c, r = self.config, self._run
        if r.rates is not None:
            r.memory.after_step(state)
        r.n = n
        r.first_done(time.perf_counter())
        if "skipped" in metrics and r.logged_at != n:
            r.pending.append(metrics["skipped"])
            r.pending_until = n
            if len(r.pending) >= c.max_consecutive_nonfinite:
                r.in_a_row = self._count_skipped(n, r.pending, r.in_a_row)
                r.pending = []
        if r.in_a_row >= c.max_consecutive_nonfinite:
            self._nonfinite_stop(n, state)
        stop = self._stop if self.world == 1 else r.vote(self._stop, self._stop_group)
        if stop and self.rank == 0:
            print(f"stopping at step {n} ({self._signals.signal or 'should_stop'}): saving", flush=True)
        last = n >= c.train_num_steps
        if self.evaluator is not None and not stop and (last or n % (c.eval_every or c.save_and_sample_every) == 0):
            self.evaluate(state, n)
        if n % c.save_and_sample_every == 0 or last:
            if r.unsent is not None:
                # this step's record (with its evaluation) goes out before its checkpoint: after a kill
                # between the two, the resume starts after this step and would never log it again
                r.emit(*r.unsent)
                r.unsent = None
            self.save(state, n)
        return stop

    def _count_skipped(self, n: int, flags: list[torch.Tensor], run: int) -> int:
        """Read the pending `skipped` flags (one host sync), warn; the updates skipped in a row now."""
        if not flags:
            return run
        values = torch.stack([f.reshape(()) for f in flags]).tolist()
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
        return run

    def _nonfinite_stop(self, n: int, state: TrainState | None) -> None:
        """Too many skipped updates in a row: save (the state is the last finite one) and raise."""
        limit = self.config.max_consecutive_nonfinite
        if state is not None:
            self.save(state, n)  # keep the progress made since the last save
        raise FloatingPointError(
            f"{self._run.in_a_row} updates in a row up to step {n} had a non-finite loss or gradient and were "
            f"skipped (TrainConfig.max_consecutive_nonfinite={limit}): the data or the hyper-parameters produce "
            f"inf/NaN. The state (params and EMA unchanged since the last finite update) is saved in "
            f"{self.checkpoints.path(n)}")

    def _lock_folder(self) -> FolderLock | None:
        """Rank 0 locks the results folder for the run; every rank fails together if it cannot.

        Rank 0 raises its own error (:class:`~functrain.checkpoint.FolderLocked` naming the holder, or a link
        planted at ``.lock``, ...); the others raise :class:`~functrain.distributed.PeerFailed`, a secondary
        failure, so the launchers blame rank 0, never another rank's echo of its error.
        """
        lock, error = None, None
        if self.rank == 0:
            try:
                lock = FolderLock(self.folder).acquire()
            except Exception as e:  # noqa: BLE001 - every failure is told to the other ranks, then raised
                error = e
        if self.world > 1:
            t = torch.tensor([0.0 if error is None else 1.0], device=self.device)
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
            if t.item() and error is None and self.rank != 0:
                raise PeerFailed(f"{os.path.abspath(self.folder)}: rank 0 could not lock the results folder (another "
                                 f"run holds it, or see rank 0's error); rank {self.rank} stops with it")
        if error is not None:
            raise error
        return lock

    def _on_sigterm(self) -> None:
        self._stop = self._signalled = True  # SIGTERM or Ctrl-C: finish the current step, save, return


# the metrics of the end-of-run summary line
_SUMMARY = ("loss", "eval_loss", "eval_loss_ema", "grad_norm", "lr", "skipped_updates")
