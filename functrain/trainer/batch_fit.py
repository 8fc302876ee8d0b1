"""A micro-batch that fits: the largest one whose memory estimate fits a budget, found before training, and a
first step that halves it on a real out-of-memory error.

:func:`fit_batch` keeps the global batch (what one optimizer update sees) and changes only how it is cut: the
step is wrapped in ``ft.accumulate(global // micro)``, whose law makes the update the same for every cut. The
search runs :func:`functrain.memory` (a trace, no step) for each micro-batch that divides the global batch, from
the whole batch down, and keeps the first that fits. :meth:`BatchFit.first_step` runs the first real step and,
if CUDA's allocator still fails (the estimate is an estimate), halves the micro-batch and retries on the same,
untouched state.
"""
from __future__ import annotations

import sys
import time
import warnings
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import optree
import torch

from ..compiler import CompiledStep, MemoryEstimate, memory
from ..core.step import Step
from ..core.validate import check_int
from ..transforms import accumulate

__all__ = ["BatchFit", "fit_batch"]


def _global_batch(batch: Any) -> int:
    rows = {t.shape[0] for t in optree.tree_leaves(batch) if isinstance(t, torch.Tensor) and t.dim() > 0}
    if len(rows) != 1:
        raise ValueError(f"fit_batch: the batch's tensors must share one leading dimension (the global batch); "
                         f"got {sorted(rows) if rows else 'no tensor with a dimension'}")
    return rows.pop()


def _candidates(global_batch: int, min_micro: int) -> list[int]:
    """The micro-batches that divide the global batch, at least ``min_micro``, largest first."""
    return [m for m in range(global_batch, 0, -1) if global_batch % m == 0 and m >= min_micro]


@dataclass(frozen=True)
class BatchFit:
    """How a global batch is cut: ``micro`` rows per micro-batch, ``accumulate`` micro-batches per update.

    Attributes:
        micro: the rows of one micro-batch.
        accumulate: ``global_batch // micro``, the factor of ``ft.accumulate``.
        global_batch: the rows of one call's batch (one optimizer update).
        step: the step to train with: ``prepare(ft.accumulate(accumulate)(base))`` (the base step unchanged
            when ``accumulate`` is 1).
        estimate: the :class:`~functrain.MemoryEstimate` of that cut (``None`` after an out-of-memory retry).
        budget: the bytes the estimate had to fit.
        min_micro: the smallest micro-batch allowed.

    Args:
        (as :func:`fit_batch` fills them)

    Example::

        >>> import torch, functrain as ft
        >>> step = ft.train_step(lambda p, b, x: (x @ p["w"]).square().mean(), ft.optim.sgd(0.1))
        >>> state = step.init({"w": torch.zeros(16, 16)})
        >>> fit = ft.fit_batch(step, state, torch.randn(8, 16), budget=10**9)
        >>> fit.micro, fit.accumulate
        (8, 1)
    """

    micro: int
    accumulate: int
    global_batch: int
    step: Any
    estimate: MemoryEstimate | None
    budget: int
    min_micro: int = 1
    base: Step = field(default=None, repr=False)
    prepare: Callable[[Step], Any] | None = field(default=None, repr=False)

    def with_micro(self, micro: int) -> "BatchFit":
        """The same fit cut into micro-batches of ``micro`` rows (it must divide the global batch)."""
        check_int("BatchFit.with_micro: micro", micro, minimum=1)
        if self.global_batch % micro:
            raise ValueError(f"BatchFit.with_micro: micro={micro} does not divide the global batch "
                             f"{self.global_batch}; ft.accumulate needs equal micro-batches")
        return replace(self, micro=micro, accumulate=self.global_batch // micro,
                       step=_build(self.base, self.global_batch // micro, self.prepare), estimate=None)

    def first_step(self, state: Any, batch: Any) -> tuple[Any, dict, "BatchFit"]:
        """Run one step; on ``torch.OutOfMemoryError`` halve the micro-batch and retry on the same state.

        The state is never donated here (a plain step or ``ft.compile(..., donate=False)``: a step that fails
        leaves its input as it was), so every retry starts from the state you passed. Each retry takes the
        largest micro-batch dividing the global batch that is at most half the last one, rebuilds the step with
        the larger ``ft.accumulate`` factor and frees CUDA's cached blocks. The update is the same whatever the
        cut (the accumulate law), so the result equals a run that used the final micro-batch from the start.

        Returns:
            ``(new_state, metrics, fit)``: ``fit`` is the cut that worked; train on with ``fit.step``
            (``ft.run(fit.step, new_state, loader)`` donates from there on).

        Raises:
            torch.OutOfMemoryError: the step does not fit even with ``min_micro`` rows per micro-batch
                (the message names the global batch and the cuts tried; the allocator's error is its cause).
            ValueError: ``self.step`` is a compiled step that donates its input (a failed call could leave the
                state half written): prepare it with ``ft.compile(step)`` (``donate=False``, the default).
        """
        fit, tried = self, []
        while True:
            if isinstance(fit.step, CompiledStep) and fit.step.donate:
                raise ValueError("BatchFit.first_step: the step donates its input state (ft.compile(..., "
                                 "donate=True)), so an out-of-memory failure could leave the state half written; "
                                 "prepare it with ft.compile(step) (donate=False; ft.run still donates later)")
            tried.append(fit.micro)
            failure = None
            try:
                new_state, metrics = fit.step(state, batch)
                return new_state, metrics, fit
            except torch.OutOfMemoryError as e:
                failure = e
            smaller = [m for m in _candidates(fit.global_batch, fit.min_micro) if m <= fit.micro // 2]
            if not smaller:
                raise torch.OutOfMemoryError(
                    f"fit_batch: the step ran out of memory even with micro-batches of {fit.micro} rows "
                    f"(global batch {fit.global_batch}, accumulate({fit.accumulate}); micro-batches tried: "
                    f"{tried}, smallest allowed {fit.min_micro}): use a smaller global batch, ft.remat, or shard "
                    f"the state (ft.data_parallel(shard=...))") from failure
            del failure  # its traceback holds the failed call's tensors
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            fit = fit.with_micro(smaller[0])


def _build(base: Step, n: int, prepare: Callable[[Step], Any] | None) -> Any:
    step = accumulate(n)(base) if n > 1 else base
    return prepare(step) if prepare is not None else step


def _probe(step: Step, state: Any, batch: Any, micro: int, global_batch: int, donate: bool) -> MemoryEstimate:
    """The estimate of ``ft.accumulate(global_batch // micro)(step)`` on ``batch`` (the whole unrolled step: its peak
    grows with the number of micro-batches, by the gradient sums; on tests/trainer/test_batch_fit.py's MLP a
    compiled accumulate(16) of 2 rows peaks at 176 KB where accumulate(2) of the same rows would say 82 KB)."""
    n = global_batch // micro
    with warnings.catch_warnings():  # over the device's memory is what the search is finding out
        warnings.simplefilter("ignore", RuntimeWarning)
        return memory(_build(step, n, None), state, batch, donate=donate)


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def fit_batch(step: Step, state: Any, batch: Any, *, budget: int | None = None, min_micro: int = 1,
              prepare: Callable[[Step], Any] | None = None, donate: bool = True, max_probes: int = 12,
              quiet: bool = False) -> BatchFit:
    """The largest micro-batch whose memory estimate fits ``budget``, found without running a step.

    ``batch`` is one global batch (its leading dimension is what one optimizer update sees). For each
    micro-batch that divides it (the whole batch first, then smaller), :func:`functrain.memory` estimates
    ``ft.accumulate(global // micro)(step)`` on ``state`` and ``batch``; the first whose total fits is kept.
    Only divisors are tried, because ``ft.accumulate`` cuts a batch into equal parts: a global batch of 24 tries
    24, 12, 8, 6, 4, 3, 2, 1, and a prime one only itself and 1, so pick a global batch with many divisors (a
    power of two). The update does not depend on the cut (the accumulate law): the same global batch, the same
    training, less memory per micro-batch. Each probe is a trace of a step that unrolls ``global // micro``
    micro-batches (no compile, no step run; longer as the cut gets finer): at most ``max_probes`` of them, a line
    on stderr before the search and one per probe (its estimate, the budget and its seconds) unless ``quiet``.

    Args:
        step: a functrain :class:`~functrain.Step` without ``ft.accumulate`` (its transforms are kept).
        state: the state it will train (shapes and devices count; nothing is changed).
        batch: one global batch, as the step will be called with it.
        budget: bytes one rank may use; default: the device's memory (CUDA's total, the CPU's RAM).
        min_micro: the smallest micro-batch allowed (an int >= 1).
        prepare: applied to each built step, e.g. ``ft.compile`` (:attr:`BatchFit.step` is what it returns;
            the estimate is of the plain step, traced as ``ft.compile`` traces it).
        donate: estimate as ``ft.run`` runs a compiled step (the new state written into the old one's buffers);
            ``False``: the new state is fresh memory (a plain step, or ``donate=False``).
        max_probes: the most micro-batch sizes estimated (an int >= 1; the largest ``max_probes`` divisors).
        quiet: say nothing (default: a line on stderr when the search starts and one per probe).

    Returns:
        A :class:`BatchFit`; ``fit.step`` is the step to train with, ``fit.first_step(state, batch)`` a first
        step that halves the micro-batch on a real out-of-memory error.

    Raises:
        ValueError: the step already accumulates, the batch has no single leading dimension, no budget is given
            and the device's memory is unknown, or even the smallest micro-batch tried does not fit (the message
            names its estimate, the budget and the sizes ``max_probes`` left untried).
        BadValue: ``budget``, ``min_micro`` or ``max_probes`` is not a positive int.

    Example::

        >>> import torch, functrain as ft
        >>> step = ft.train_step(lambda p, b, x: torch.relu(x @ p["w"]).square().mean(), ft.optim.sgd(0.1))
        >>> state, x = step.init({"w": torch.zeros(8, 1024)}), torch.randn(32, 8)
        >>> whole = ft.memory(step, state, x, donate=True).total   # the whole batch in one piece
        >>> fit = ft.fit_batch(step, state, x, budget=whole - 1, quiet=True)
        >>> fit.micro < 32, fit.micro * fit.accumulate
        (True, 32)
    """
    if not isinstance(step, Step):
        raise TypeError(f"fit_batch: step must be a functrain Step (before ft.compile; pass prepare=ft.compile); "
                        f"got {type(step).__name__}")
    if any(t.name == "accumulate" for t in step.transforms):
        raise ValueError("fit_batch: the step already has ft.accumulate; give it the step without it (fit_batch "
                         "chooses the factor)")
    min_micro = check_int("fit_batch: min_micro", min_micro, minimum=1)
    if budget is not None:
        budget = check_int("fit_batch: budget", budget, minimum=1)
    if not isinstance(donate, bool):
        raise TypeError(f"fit_batch: donate must be a bool; got {donate!r}")
    max_probes = check_int("fit_batch: max_probes", max_probes, minimum=1)
    if not isinstance(quiet, bool):
        raise TypeError(f"fit_batch: quiet must be a bool; got {quiet!r}")
    global_batch = _global_batch(batch)
    candidates = _candidates(global_batch, min_micro)
    if not candidates:
        raise ValueError(f"fit_batch: min_micro={min_micro} is larger than the global batch {global_batch}")

    def say(line: str) -> None:
        if not quiet:
            print(f"fit_batch: {line}", file=sys.stderr, flush=True)

    tried = candidates[:max_probes]
    say(f"global batch {global_batch}: trying micro-batches {', '.join(map(str, tried))} (largest first, one "
        f"ft.memory trace each, at most {max_probes} probes)"
        + (f"; {len(candidates) - len(tried)} smaller ones not tried (max_probes={max_probes})"
           if len(tried) < len(candidates) else ""))
    est = None
    for i, micro in enumerate(tried):
        t0 = time.perf_counter()
        est = _probe(step, state, batch, micro, global_batch, donate)
        if budget is None:
            if est.capacity is None:
                raise ValueError(f"fit_batch: the memory of {est.device} is unknown; pass budget= (bytes)")
            budget = est.capacity
        ok = est.total <= budget
        say(f"probe {i + 1}/{len(tried)}: micro-batch {micro} (accumulate({global_batch // micro})): about "
            f"{_mib(est.total)} of {_mib(budget)}: {'fits' if ok else 'over'} ({time.perf_counter() - t0:.1f} s)")
        if ok:
            break
    else:
        least = tried[-1]
        more = (f" (max_probes={max_probes} stopped the search before micro-batches of "
                f"{', '.join(map(str, candidates[len(tried):]))})" if len(tried) < len(candidates) else "")
        raise ValueError(f"fit_batch: even micro-batches of {least} rows (accumulate({global_batch // least}) "
                         f"of the global batch {global_batch}) need about {est.total} bytes, over the budget "
                         f"of {budget}{more}: {est}. Use a smaller global batch, ft.remat, or shard the state")
    n = global_batch // micro
    return BatchFit(micro, n, global_batch, _build(step, n, prepare), est, budget, min_micro, step, prepare)
