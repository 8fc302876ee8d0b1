"""``ft.Trainer``: the loop around the step, its components each on its own cadence.

A config of hyper-parameters in, and out: checkpoints (a resume restores the state bit-exactly), EMA sample grids,
metrics (JSONL, TensorBoard, W&B, MLflow) and a loss curve.

Built on functrain's public API (the composed step and ``ft.compile``'s runner, ``ft.shard``, ``ft.gather_state``,
``ft.checkpoint``) and on :func:`functrain.driver.run_steps`, ``ft.run``'s loop as an iterator; besides, it uses
helpers a user's own loop has no need of: the collectives of :mod:`functrain.distributed.comm` and whether a state
is sharded (:func:`functrain.checkpoint.per_rank.is_sharded`). Its components are in
:mod:`~functrain.trainer.components`, :mod:`~functrain.trainer.stopping` and :mod:`~functrain.trainer.compiling`.
"""
from __future__ import annotations

import functools
import os
import warnings
from typing import Any, Callable

import torch

from .. import distributed
from ..checkpoint.export import export_weights
from ..checkpoint import CheckpointError, CheckpointManager, FolderLock, StructureMismatch, load_extra
from ..checkpoint.per_rank import is_sharded
from ..distributed import PeerFailed, gather_state
from ..distributed.comm import any_rank, check_same
from ..driver import run_steps
from ..core.state import TrainState
from .resume import resume_hyper as _resume_hyper
from .components import Checkpointing, Evaluation, MetricsLog, MetricsPlot, Sampling, SkippedUpdates
from .compiling import RunClock, precompile
from .config import FOLDER_OPTIONS, TrainConfig
from .hooks import Hooks
from .plots import MetricHistory
from .stopping import StopAgreement
from .summary import FirstBatch, MemoryLine, run_summary, schedule_change
from .build import evaluation, model_and_loss, train_loader, trainer_config, trainer_step, trainer_trackers
from .inputs import batch_line, ema_copy, load_weights, process_batch, resolve_dataset, with_augmentation
from .trackers import make_trackers

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

    ``train()`` runs ``ft.run``'s loop (:func:`functrain.driver.run_steps`: one loop, one progress bar) to
    ``train_num_steps`` optimizer updates and asks its components at each step, each on its own cadence:
    every ``log_every`` updates (and the last) the metrics go to the history and the trackers; with
    ``eval_dataset`` it evaluates (see :class:`~functrain.trainer.evaluator.Evaluator`) every ``eval_every``
    updates (0: at each save) and at the end, in the same tracker record as the step's log; every
    ``save_and_sample_every`` updates (and at the end) it writes a checkpoint (state + data position + config +
    metric history) under ``results_folder/checkpoints`` and, with ``sample_fn(ema_params, num_samples) ->
    images in [0, 1]``, a ``sample-{step}.png`` grid. Running it again resumes from the newest checkpoint and
    restores its state bit-exactly; the continuation equals an uninterrupted run bit for bit when both run the
    same path (eager or compiled) at each step: ``compile=False``, ``compile_background=False`` or
    ``compile_switch_at=N``. With a background compile that switches when ready (the default) the resumed run's
    first step runs eagerly again, so it equals the uninterrupted run to float rounding only (docs/trainer.md,
    "Running it again").

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
    on a gloo group: no device sync: :class:`~functrain.trainer.stopping.StopAgreement`), and saves within the
    launcher's ``--term-timeout`` (a 2nd Ctrl-C: at once, saying what is lost:
    :class:`~functrain.trainer.stopping.StopSignals`); one run per
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
        config: the :class:`TrainConfig`; or ``None`` (default), and ``**package``: denoising-diffusion-pytorch's
            ``Trainer`` keywords build it (:func:`~functrain.trainer.config.package_config`: its names and defaults,
            ``split_batches=True`` included; ``amp``, ``save_best_and_latest_only``, ... honoured or refused by name).
        sample_fn: ``sample_fn(ema_params, n) -> images`` for the sample grids (``None``: no samples; with the
            package's keywords, a module with ``sample`` samples its EMA copy, as the package's ``Trainer``).
        params, buffers: with a ``loss_fn``: the initial tensors.
        optimizer: a functrain optimizer instead of the config's AdamW.
        transforms: transforms added to the composed step.
        step: a ready step used as it is (its ``accumulate`` must match the config).
        eval_dataset: held-out data for ``eval_loss`` / ``eval_loss_ema``.
        callbacks, on_log, on_save, on_eval, should_stop: hooks (see :class:`Callback`).
        trackers: tracker objects with ``log(step, metrics)``, besides ``config.trackers``.
        **package: with ``config=None``: the package's ``Trainer`` keywords (``train_batch_size=32``, ``amp=True``,
            ...); ``augment_horizontal_flip`` / ``convert_image_to`` (how a folder is read) go with a config too.

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

    # The components the loop asks, each on its own cadence and owning its state (made in __init__):
    hooks: Hooks                     # the user's on_log / on_eval / on_save / should_stop
    skips: SkippedUpdates            # every step: the skipped flags, read at log steps; too many in a row stop
    log: MetricsLog                  # log steps: the history, the summary's values, one tracker record per step
    evaluation: Evaluation | None    # every eval_every (0: each save) and the last step, never at a stop
    checkpointing: Checkpointing     # every save_and_sample_every and the last step; a stop's after the loop
    sampling: Sampling | None        # with each checkpoint (rank 0)
    plot: MetricsPlot                # with each checkpoint, at most every PLOT_SECONDS but the last (rank 0)
    stopping: StopAgreement          # every step: signals and should_stop, the ranks' vote
    clock: RunClock | None           # the last train() call's steps, throughput and compile times

    def __init__(self, model_or_loss: Any, dataset: Any, config: TrainConfig | None = None,
                 sample_fn: Callable[[Any, int], torch.Tensor] | None = None, *, params: Any = None,
                 buffers: Any = None, optimizer: Any = None, transforms: Any = (), step: Any = None,
                 eval_dataset: Any = None, callbacks: list | tuple = (), on_log: Callable | None = None,
                 on_save: Callable | None = None, on_eval: Callable | None = None,
                 should_stop: Callable | None = None, trackers: list | tuple = (), **package: Any):
        folder_options = {k: package.pop(k) for k in FOLDER_OPTIONS if k in package}
        config, package_call = trainer_config(config, package)
        self.config = config
        self.hooks = Hooks(callbacks, on_log=on_log, on_save=on_save, on_eval=on_eval, should_stop=should_stop)
        self.tracker_items = trainer_trackers(config, trackers, eval_dataset)
        self.info = distributed.init()
        self.world = distributed.world_size()
        self.rank = distributed.rank()
        self.device = distributed.device()
        if self.world > 1:  # every rank must train the same run: one all-gather of a hash per field
            check_same(config.to_dict(), "TrainConfig")
        self.module, loss, self.params, self.buffers = model_and_loss(model_or_loss, params, buffers, self.device)
        dataset = resolve_dataset(dataset, model_or_loss, **folder_options)  # (a folder of images, as the package's)
        transforms = with_augmentation(dataset, transforms, step)
        # the step, the CompiledStep (or None) and run_step: what the loop runs (its runner, owned here)
        self.step, self.compiled, self.run_step = trainer_step(loss, config, self.world, optimizer=optimizer,
                                                               transforms=transforms, step=step, module=self.module)
        per_process = process_batch(config, self.world)  # TrainConfig.split_batches: the one batch-size rule
        self.loader = train_loader(dataset, config, self.world, per_process, self.device)
        self.evaluation = evaluation(loss, eval_dataset, config, self.world, per_process, self.device, self.module)
        last = config.train_num_steps
        self.folder = config.results_folder
        self.checkpoints = CheckpointManager(os.path.join(self.folder, "checkpoints"), keep=config.keep_checkpoints,
                                             keep_best=config.keep_best is not None)
        self.skips = SkippedUpdates(config.max_consecutive_nonfinite, config.mixed_precision == "fp16", self.rank)
        self.log = MetricsLog()
        self.checkpointing = Checkpointing(self.checkpoints, config.save_and_sample_every, last, self.world,
                                           config.save_timeout, best=config.keep_best)
        if package_call and sample_fn is None and callable(getattr(self.module, "sample", None)):
            sample_fn = self._sample_ema  # the package's trainer samples its EMA model at each save
        self.sampling = Sampling(sample_fn, config.num_samples, self.folder) if sample_fn is not None else None
        self.plot = MetricsPlot(self.folder, self.PLOT_SECONDS)
        self.stopping = StopAgreement(self.rank, self.world, self.checkpoints)
        self.clock = None
        self.weights: dict = {}  # the exported weights' paths (rank 0)
        self.state: TrainState | None = None  # what the last train() returned
        self._ema_module: torch.nn.Module | None = None
        if self.world > 1 and self.rank == 0:  # the batch rule, said once
            print(batch_line(config, self.world, per_process), flush=True)

    @property
    def skipped_updates(self) -> int:
        """Non-finite updates skipped by this trainer's ``train()`` calls (as of the last log step)."""
        return self.skips.total

    @property
    def history(self) -> MetricHistory:
        """Every logged metric and evaluation of the run (a resumed run: from its start), kept in checkpoints."""
        return self.log.history

    @property
    def plot_path(self) -> str | None:
        """The metrics plot, once drawn."""
        return self.plot.path

    # -- the loop ------------------------------------------------------------------------------
    def train(self, profile: Any = None) -> TrainState:
        """Run (or resume) to ``train_num_steps`` updates and return the final state.

        ``profile``: as ``ft.run``'s (a trace path, or :class:`functrain.compiler.profiling.Profile`): those steps
        recorded on rank 0 into a Chrome trace, with a table of time per stage and phase printed.

        The loop, at each step: the skipped flags; at a log step the record (throughput, compile times, the
        history, ``on_log``, ``should_stop``); the memory line once a background compile has traced; a run of
        skipped updates saves and raises; the stop vote (a stop step is logged too); the evaluation (joining the
        step's record); the one tracker record of the step; the checkpoint (with its sample grid and plot). After
        it: a stop's save between checkpoints, the exported weights, the module's weights, the summary.
        """
        c = self.config
        os.makedirs(self.folder, exist_ok=True)
        lock = self._lock_folder()
        done = False
        memory = None
        try:
            state = self.restore()
            if self.rank == 0:
                c.save(os.path.join(self.folder, "config.json"))
            start = int(state.step)  # the only read of the device counter: the loop's index mirrors it on the host
            self.clock = clock = RunClock(self.run_step, self.compiled is not None, start)
            if start >= c.train_num_steps:  # a finished run, run again: its summary, no trace, no compile, no data
                self.checkpointing.begin(start)
                self.log.last = {k: p[1] for k in _SUMMARY if (p := self.log.history.last(k)) is not None}
                self._export(state)  # (from the checkpoint: the weights are there even if the first run died now)
                self._load_module(state)
                if self.rank == 0:
                    print(self.summary(), flush=True)
                return state
            self.skips.begin()
            self.log.open(make_trackers(self.tracker_items, self.folder, c.to_dict(), start) if self.rank == 0 else [])
            self.checkpointing.begin(start)
            self.stopping.begin(clock, self.checkpointing)  # SIGTERM, Ctrl-C: stop at the agreed step and save
            memory = MemoryLine(self.run_step, self.rank, clock.progress)
            data = FirstBatch(self.loader, functools.partial(memory.first, state))  # before step 1
            with run_steps(self.run_step, state, data, num_steps=max(c.train_num_steps - start, 0),
                           log_every=c.log_every, device=self.device, progress=self.rank == 0, start=start,
                           profile=profile) as steps:
                for n, state, metrics, host in steps:
                    clock.tick(n)
                    self.skips.add(n, metrics, host)
                    record = self._log(n, host) if host is not None else {}
                    memory.after_step(state)
                    if self.skips.too_many:  # the state is the last finite one: keep the progress made, then raise
                        self.log.send(n, record)
                        self._save(state, n, final=True)
                        raise self.skips.error(n, self.checkpoints.path(n))
                    stop = self.stopping.agreed(n)
                    if stop and host is None:  # the stop step is logged too (its metrics read now)
                        record = self._log(n, steps.log())
                    if self.evaluation is not None and self.evaluation.should_evaluate(n, stop):
                        record.update(self._evaluate(state, n))  # one record per step: with the step's log
                    # the record goes out before the step's checkpoint: after a kill between the two, the resume
                    # starts after this step and would never log it again
                    self.log.send(n, record)
                    if self.checkpointing.should_save(n):
                        self._save(state, n, final=stop or n >= c.train_num_steps, record=record)
                    if stop:
                        break
            n, state = steps.index, steps.state
            memory.close()  # the memory line, made off the training thread, is printed by now
            self.stopping.end_vote()  # the last step's vote, which every rank started: let it finish
            if steps.runner is not None:  # stopped by SIGTERM: a running compile dies with us; else it may finish
                steps.runner.finish_after_exit(not self.stopping.signalled)
            if self.checkpointing.saved_at != n:  # stopped between saves (SIGTERM, should_stop)
                self._save(state, n, final=True)
            if self.stopping.signalled:
                self.stopping.signals.saved(n)
            if self.skips.too_many:  # counted by the stop step's log
                raise self.skips.error(n, self.checkpoints.path(n))
            self._export(state)
            self._load_module(state)
            done = True
        finally:
            if memory is not None and not done:  # a run that raised: its memory line's thread ends with it too
                memory.close(timeout=60.0)
            self.stopping.restore()
            self.log.close()
            if lock is not None:
                lock.release()
        if done and self.rank == 0:
            print(self.summary(), flush=True)
        return state

    def _log(self, n: int, host: dict) -> dict:
        """Log step ``n`` (``host``: its metrics read to the host): the skipped flags read, the run's times added,
        the history, ``on_log`` and ``should_stop``; returns the step's tracker record (a copy: an evaluation may
        join it)."""
        self.skips.read(n, host)
        self.clock.fields(n, host)
        host["skipped_updates"] = self.skips.total
        self.log.add(n, host)
        record = dict(host)
        self.hooks.call("on_log", n, host)
        if self.hooks.stop(n, host):
            self.stopping.request()
        return record


    def precompile(self) -> float:
        """Compile the step ahead into the compile caches, without training; returns the seconds it took.

        The step of :meth:`initial_state` and one batch of the loader (whose position is put back) are traced and
        compiled on this thread, with a progress line. A later :meth:`train` (this process's or a later run's)
        then runs compiled from its first steps instead of asking the compile policy. ``TrainConfig(compile=False)``:
        ``ValueError``. What ``--precompile`` does in examples/diffusion.py."""
        return precompile(self)

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
        with warnings.catch_warnings():
            if self.rank != 0:  # rank 0 names every skipped checkpoint (with the rank that found it damaged)
                warnings.simplefilter("ignore")
            try:  # (several processes: the ranks agree on one checkpoint, within save_timeout)
                restored = self.checkpoints.load_latest(template=state, group=self.checkpointing.group())
            except StructureMismatch as e:
                raise ValueError(self._mismatch_message(e)) from None
        if restored is None:
            return state
        extra = restored.extra if isinstance(restored.extra, dict) else {}
        saved = extra.get("config")
        if saved is not None:
            changed = TrainConfig.from_dict(saved).diff(self.config)
            if changed and self.rank == 0:  # one plain line: a resume with a changed config is a choice, not a fault
                logged = MetricHistory.from_json(extra["history"]).last("lr") if "history" in extra else None
                lr = schedule_change(TrainConfig.from_dict(saved), self.config, restored.step, logged)
                print(f"resuming with a changed config: "
                      f"{', '.join(f'{k} {a!r} -> {b!r}' for k, (a, b) in changed.items())}"
                      + (f"; {lr}" if lr else ""), flush=True)
        if "data" not in extra:
            raise CheckpointError(f"{restored.path}: its extra.json has no data position; it was not written by "
                                  f"ft.Trainer")
        hyper = _resume_hyper(restored.state, state, restored.step)  # the config's numbers, the file's state
        state = hyper.state
        self.loader.load_state_dict(extra["data"])
        if "history" in extra:
            self.log.resume(MetricHistory.from_json(extra["history"]).truncate(restored.step))
        else:  # a checkpoint written before the history: its loss curve
            self.log.resume(MetricHistory({"loss": extra.get("losses", [])}).truncate(restored.step))
        if self.rank == 0:
            print(f"resumed from {restored.path} at step {restored.step}{hyper.line}", flush=True)
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

    def save(self, state: TrainState, step: int | None = None) -> None:
        """Write a checkpoint and the sample grid (rank 0; every rank writes its shard of a sharded state).

        ``step`` is the host mirror of ``state.step`` (read from the state if not given). The other ranks
        wait for it on a gloo group bounded by ``config.save_timeout``, so a slow save or ``sample_fn``
        never trips the collective timeout.
        """
        self._save(state, int(state.step) if step is None else step, final=True)  # (a sync, but only when saving)

    def _save(self, state: TrainState, step: int, final: bool, record: dict | None = None) -> None:
        """:meth:`save`; ``final``: the run's last save (the end, a stop), whose plot is drawn whatever its age;
        ``record``: the step's metrics (its evaluation scores the checkpoint for ``keep_best``)."""
        split = is_sharded(state)
        if self.rank == 0 or split:  # a sharded state: every rank writes its shard (a collective save)
            extra = {"data": self.loader.state_dict(), "history": self.log.history.to_json(),
                     "config": self.config.to_dict()}
            path, finite = self.checkpointing.write(state, step, extra, record)
            whole = gather_state(state) if split and self.sampling is not None else state  # (every rank)
        if self.rank == 0:
            if not finite:
                self.checkpointing.warn_if_not_finite(path, step)
            if self.sampling is not None:
                self.sampling.write(whole.ema, step)
            self.plot.draw(self.log.history, force=final)
            self.hooks.call("on_save", step, path)
        self.checkpointing.wait(step)

    def evaluate(self, state: TrainState, step: int | None = None) -> dict:
        """Evaluate ``state`` on the eval set (every process takes part), log it and call ``on_eval``.

        The metrics go to the history (and, while ``train()`` runs, to the trackers as a record of their own; the
        loop's evaluations join their step's record instead); a ``should_stop`` that answers true stops the run.
        """
        if self.evaluation is None:
            raise ValueError("Trainer.evaluate needs Trainer(eval_dataset=...)")
        step = int(state.step) if step is None else step
        metrics = self._evaluate(state, step)
        self.log.send(step, metrics)
        return metrics

    def _evaluate(self, state: TrainState, step: int) -> dict:
        """The evaluation of ``step``: into the history, ``on_eval``, ``should_stop``; the metrics."""
        metrics = self.evaluation(state)  # whole params and EMA
        self.log.add(step, metrics)
        self.hooks.call("on_eval", step, metrics)
        if self.hooks.stop(step, metrics):
            self.stopping.request()
        return metrics

    # -- the end of a run ----------------------------------------------------------------------
    def _export(self, state: TrainState) -> None:
        """``model.safetensors`` / ``ema.safetensors`` by rank 0 (a sharded state is gathered on every rank
        first), unless stopped by SIGTERM: its grace period is for the checkpoint."""
        signalled = self.stopping.signalled
        split = is_sharded(state)
        if split and self.world > 1:  # the gather is collective: every rank must agree on whether to export
            signalled = any_rank(signalled)
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

    def _sample_ema(self, ema_params: Any, n: int) -> torch.Tensor:
        """The package's call's ``sample_fn``: ``n`` samples of the module holding ``ema_params`` (its ``sample``)."""
        return self.ema_module(ema_params).sample(batch_size=n)

    def summary(self) -> str:
        """The last ``train()``'s end-of-run text: final metrics, time (compile apart), where the results are."""
        clock, n = self.clock, self.clock.step
        outputs = {"weights": self.weights.get("model"), "EMA weights": self.weights.get("ema"),
                   "metrics plot": self.plot.path,  # (metrics.jsonl: the jsonl tracker's own line)
                   "checkpoint": self.checkpoints.path(self.checkpointing.saved_at)}
        best = self.checkpoints.best() if self.config.keep_best is not None and self.rank == 0 else None
        if best is not None:
            outputs[f"best checkpoint ({self.config.keep_best})"] = self.checkpoints.path(best)
        ran = n > clock.start
        head = "" if not self.stopping.signalled else (
            f"stopped by {self.stopping.signals.signal} at step {n} and saved it ({self.checkpoints.path(n)}); "
            f"resume by running again\n")
        if not ran:  # a finished run, run again
            head = (f"already at step {n} of {self.config.train_num_steps}: nothing to train (raise "
                    f"train_num_steps to train on)\n")
        return head + run_summary(results_folder=self.folder, step=n, total_steps=self.config.train_num_steps,
                                  final_metrics={k: v for k, v in self.log.last.items() if k in _SUMMARY},
                                  wall_time_s=clock.wall_s() if ran else None,
                                  compile_time_s=clock.compile_time_s() if ran else None,
                                  steps_run=n - clock.start, outputs=outputs, trackers=self.log.trackers,
                                  notes=clock.notes() if ran else [])

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
        if self.world > 1 and any_rank(error is not None) and error is None and self.rank != 0:
            raise PeerFailed(f"{os.path.abspath(self.folder)}: rank 0 could not lock the results folder (another "
                             f"run holds it, or see rank 0's error); rank {self.rank} stops with it")
        if error is not None:
            raise error
        return lock


# the metrics of the end-of-run summary line
_SUMMARY = ("loss", "eval_loss", "eval_loss_ema", "grad_norm", "lr", "skipped_updates")
