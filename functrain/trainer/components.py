"""The Trainer's components: each decides its own cadence and owns its state; the loop
(:meth:`functrain.Trainer.train`) asks each in turn.

* :class:`SkippedUpdates`: the step's ``skipped`` flags, kept on the device and read at log steps (or when
  ``max_consecutive_nonfinite`` are pending); too many in a row stop the run.
* :class:`MetricsLog`: every log step's (and evaluation's) values: the history, the summary's last values, one
  tracker record per step.
* :class:`Evaluation`: every ``eval_every`` updates (0: at each save) and at the last, never at a stop.
* :class:`Checkpointing`: every ``save_and_sample_every`` updates and at the last (a stop saves after the loop);
  the newest saved step; the group on which the ranks wait for a save.
* :class:`Sampling`: the EMA sample grid, with each checkpoint (rank 0).
* :class:`MetricsPlot`: the metrics plot, with each checkpoint, at most every ``seconds`` but the last (rank 0).

The stop agreement is :class:`~functrain.trainer.stopping.StopAgreement`; the run's clock (its steps, the
throughput and compile times) :class:`~functrain.trainer.compiling.RunClock`.
"""
from __future__ import annotations

import math
import os
import time
import warnings
from typing import Any, Callable

import torch

from ..checkpoint.per_rank import is_sharded
from ..core import tree as T
from ..distributed import gather_state
from ..distributed.comm import every_rank, gloo_group
from .images import write_sample_grid
from .plots import MetricHistory, write_run_plot

__all__ = ["SkippedUpdates", "MetricsLog", "Evaluation", "Checkpointing", "Sampling", "MetricsPlot"]


class SkippedUpdates:
    """The updates the step skipped (its ``skipped`` metric: a non-finite loss or gradient, an fp16 overflow).

    Each step's flag is kept (:meth:`add`: a device tensor, no host sync) and read at the next log step
    (:meth:`read`, one host read of every flag pending) or once ``limit`` are pending, so that ``limit`` skips in a
    row are seen in time however rare the log steps. A read with skips warns (rank 0) and counts them: ``total``
    over this trainer's ``train()`` calls, ``in_a_row`` now; :attr:`too_many` in a row stop the run (:meth:`error`).

    Example::

        >>> import warnings, torch
        >>> skips = SkippedUpdates(limit=3, fp16=False, rank=0)
        >>> with warnings.catch_warnings(record=True):
        ...     for step in (1, 2, 3):
        ...         skips.add(step, {"skipped": torch.tensor(True)}, None)   # the 3rd pending: read
        >>> skips.total, skips.in_a_row, skips.too_many
        (3, 3, True)
    """

    def __init__(self, limit: int, fp16: bool, rank: int):
        self.limit, self.fp16, self.rank = limit, fp16, rank
        self.total = 0  # skipped by this trainer's train() calls (as of the last read)
        self.pending: list = []  # the flags not read yet, oldest first: device tensors (a log step's: a host value)
        self.in_a_row = 0  # skipped updates in a row, as of the last read

    def begin(self) -> None:
        """A ``train()`` call starts: nothing pending, no skip in a row."""
        self.pending, self.in_a_row = [], 0

    def add(self, step: int, metrics: dict, host: dict | None) -> None:
        """Keep step ``step``'s flag (``host``: the step's host metrics at a log step, whose flag is then kept as read);
        read the flags once ``limit`` are pending."""
        if "skipped" not in metrics:
            return
        self.pending.append(metrics["skipped"] if host is None else host["skipped"])
        if host is None and len(self.pending) >= self.limit:
            self._read(step)

    def read(self, step: int, host: dict) -> None:
        """At a log step (``host``: its metrics): read the flags pending; warn of a non-finite loss that no
        ``skip_nonfinite`` skipped (rank 0)."""
        if self.pending:
            self._read(step)
        if "skipped" not in host and not math.isfinite(host["loss"]) and self.rank == 0:
            warnings.warn(f"step {step}: the loss is {host['loss']} and skip_nonfinite is off: the parameters may now "
                          f"be non-finite", RuntimeWarning, stacklevel=3)

    @property
    def too_many(self) -> bool:
        """``limit`` updates in a row were skipped: the run stops (saving first)."""
        return self.in_a_row >= self.limit

    def error(self, step: int, path: str) -> FloatingPointError:
        """The error that stops the run at ``step``, whose checkpoint is ``path``."""
        return FloatingPointError(
            f"{self.in_a_row} updates in a row up to step {step} had a non-finite loss or gradient and were skipped "
            f"(TrainConfig.max_consecutive_nonfinite={self.limit}): the data or the hyper-parameters produce inf/NaN. "
            f"The state (params and EMA unchanged since the last finite update) is saved in {path}")

    def _read(self, step: int) -> None:
        """Read the pending flags (one host read of the device ones), count them, warn."""
        flags, self.pending = self.pending, []
        tensors = [f.reshape(()) for f in flags if torch.is_tensor(f)]
        read = iter(torch.stack(tensors).tolist() if tensors else [])
        values = [next(read) if torch.is_tensor(f) else f for f in flags]
        k = int(sum(values))
        if k == 0:
            self.in_a_row = 0
            return
        self.total += k
        for v in values:
            self.in_a_row = self.in_a_row + 1 if v else 0
        if self.rank == 0:
            why = "fp16 loss-scale overflow or " if self.fp16 else ""
            warnings.warn(f"step {step}: {k} of the last {len(values)} updates skipped ({why}non-finite loss or "
                          f"gradient), {self.total} in this run; {self.in_a_row} in a row now (the run stops at "
                          f"{self.limit})", RuntimeWarning, stacklevel=4)


class MetricsLog:
    """What the run records of its metrics: every log step's and evaluation's values in the :attr:`history` (kept
    in each checkpoint, plotted), the :attr:`last` of each (the summary's), and one record per step for the
    :attr:`trackers` (rank 0's; :meth:`send`, an evaluation joining its step's record)."""

    def __init__(self) -> None:
        self.history = MetricHistory()  # every logged metric and evaluation (a resume: the checkpoint's)
        self.trackers: list = []  # the last train() call's (opened on rank 0); kept after close for the summary
        self.open_now = False  # a train() call runs: records go to the trackers
        self.last: dict = {}  # the last value of each metric in the last train() call

    def open(self, trackers: list) -> None:
        """A ``train()`` call starts with these trackers."""
        self.trackers, self.last, self.open_now = list(trackers), {}, True

    def resume(self, history: MetricHistory) -> None:
        """The history of the checkpoint the run resumes from."""
        self.history = history

    def add(self, step: int, metrics: dict) -> None:
        """Step ``step``'s values (a log step's, an evaluation's) into the history and the last values."""
        self.history.add(step, metrics)
        self.last.update(metrics)

    def send(self, step: int, record: dict) -> None:
        """Step ``step``'s one record (its log and its evaluation) to every tracker (none: an empty record)."""
        if record and self.open_now:
            for t in self.trackers:
                t.log(step, record)

    def close(self) -> None:
        """The ``train()`` call ends: close its trackers (kept for their ``where()`` lines)."""
        if self.open_now:
            self.open_now = False
            for t in self.trackers:
                t.close()


class Evaluation:
    """When the run evaluates (``every`` updates, the ``last`` step; never at a stop, which saves in its grace
    period) and on what: the whole params and EMA (a sharded state is gathered first: every rank calls it)."""

    def __init__(self, evaluator: Callable[[Any], dict], every: int, last: int):
        self.evaluator, self.every, self.last = evaluator, every, last

    def should_evaluate(self, step: int, stop: bool) -> bool:
        """Whether step ``step`` evaluates: every ``every`` steps and at the last, never at a stop step."""
        return not stop and (step >= self.last or step % self.every == 0)

    def __call__(self, state: Any) -> dict:
        return self.evaluator(gather_state(state) if is_sharded(state) else state)


class Checkpointing:
    """The run's checkpoints: when (every ``every`` updates and the ``last`` step; a stop between them saves after
    the loop), the newest step saved (:attr:`saved_at`), and the gloo group of every rank, bounded by
    ``timeout_s`` (``save_timeout``): the ranks agree on the checkpoint to resume on it and wait on it for a
    save (:meth:`wait`), so that a slow save or ``sample_fn`` never trips the collective timeout. ``best``
    (``keep_best``): the metric of the step's record that scores each checkpoint (lower is better), which the
    manager's rotation keeps the best of."""

    def __init__(self, manager: Any, every: int, last: int, world: int, timeout_s: float, best: str | None = None):
        self.manager, self.every, self.last, self.world, self.timeout_s = manager, every, last, world, timeout_s
        self.best = best
        self.saved_at = 0  # the newest checkpoint of this train() call (its start: the step resumed from)
        self._group: Any = None

    def begin(self, start: int) -> None:
        """A ``train()`` call starts at step ``start`` (what the restored checkpoint holds: saved already)."""
        self.saved_at = start

    def should_save(self, step: int) -> bool:
        """Whether step ``step`` saves: every ``every`` steps and at the last."""
        return step % self.every == 0 or step >= self.last

    def group(self) -> Any:
        """The group (``None`` on one process); made at the first call, which every rank makes in turn."""
        if self.world > 1 and self._group is None:
            self._group = gloo_group(self.timeout_s)
        return self._group

    def write(self, state: Any, step: int, extra: dict, record: dict | None = None) -> tuple[str, bool]:
        """Write ``state`` as the checkpoint of ``step`` (rank 0; every rank its shard of a sharded state):
        ``(path, finite)``, finite: every tensor of the params and EMA (of every shard) is finite. ``record``: the
        step's metrics, whose ``best`` metric scores the checkpoint (none: a step that did not evaluate)."""
        finite = _finite(state)
        if is_sharded(state) and self.world > 1:  # every shard finite: one flag for the whole state
            finite = every_rank(finite)
        score = (record or {}).get(self.best) if self.best is not None else None
        return self.manager.save(step, state, extra=extra, finite=finite, score=score), finite

    def wait(self, step: int) -> None:
        """Every rank waits here for the save of ``step`` (bounded by ``timeout_s``), which is then the newest."""
        if self.world > 1:
            torch.distributed.barrier(group=self.group())
        self.saved_at = step

    def warn_if_not_finite(self, path: str, step: int) -> None:
        """Rank 0, after a checkpoint holding non-finite values: say which one rotation keeps."""
        good = self.manager.newest_finite()
        kept = f"rotation keeps {self.manager.path(good)}, the newest finite one" if good is not None \
            else "there is no finite checkpoint"
        warnings.warn(f"checkpoint {path} (step {step}) holds non-finite parameters or EMA; {kept}", RuntimeWarning,
                      stacklevel=3)


def _finite(state: Any) -> bool:
    leaves = [t for t in T.tree_leaves((state.params, state.ema)) if torch.is_tensor(t)]
    if not leaves:
        return True
    return bool(torch.stack([torch.isfinite(t).all() for t in leaves]).all())


class Sampling:
    """The sample grid written with each checkpoint (rank 0): ``sample_fn(ema_params, num_samples)`` (images in
    [0, 1]) as ``sample-{step}.png`` in ``folder``."""

    def __init__(self, sample_fn: Callable[[Any, int], torch.Tensor], num_samples: int, folder: str):
        self.sample_fn, self.num_samples, self.folder = sample_fn, num_samples, folder

    def write(self, ema: Any, step: int) -> None:
        """Sample ``num_samples`` images from the EMA weights and write their grid as ``sample-{step}.png``."""
        images = self.sample_fn(ema, self.num_samples)
        write_sample_grid(os.path.join(self.folder, f"sample-{step}.png"), images.detach().float().cpu().numpy(),
                          step=step, scale=4)


class MetricsPlot:
    """The metrics plot (``metrics.png``: one panel per metric, the step on x), redrawn with each checkpoint (rank 0).

    Drawing takes about a second, so saves closer than ``seconds`` apart share one plot; the last save of a run
    (the end, a stop) always draws (``force``).
    """

    def __init__(self, folder: str, seconds: float):
        self.folder, self.seconds = folder, seconds
        self.path: str | None = None  # the plot, once drawn
        self.drawn_at: float | None = None

    def draw(self, history: MetricHistory, force: bool) -> None:
        """Draw ``metrics.png`` from ``history``: at most once every ``seconds`` unless ``force`` (a final save)."""
        now = time.monotonic()
        if not force and self.drawn_at is not None and now - self.drawn_at < self.seconds:
            return
        path = write_run_plot(self.folder, history)
        if path is not None:  # (None: saved before the first log step, nothing to draw yet)
            self.path, self.drawn_at = path, time.monotonic()
