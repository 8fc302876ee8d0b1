"""The data-parallel law, checked on real processes: N gloo ranks, each on 1/N of the batch, equal one process on
the whole batch, replicated and in each sharding mode. Re-exported by :mod:`functrain.testing`."""
from __future__ import annotations

import pickle
from typing import Any, Callable

import optree
import torch

from ..compiler.api import compile as ft_compile
from ..core.step import Step
from ..core.validate import BadValue, check_choice, check_int, check_real, describe
from ..distributed.data_parallel import data_parallel
from ..distributed.sharding import gather_state
from ..distributed.spawn import launch
from .checks import _batch_at, assert_same_state

__all__ = ["assert_data_parallel_equals_one_process", "SHARD_MODES"]

SHARD_MODES = ("none", "optimizer", "params")
"""The ``data_parallel(shard=...)`` modes: replicated, optimizer state sharded (ZeRO-2), params too (ZeRO-3)."""


def _host(tree: Any) -> Any:
    return optree.tree_map(lambda x: x.detach().to("cpu", copy=True) if torch.is_tensor(x) else x, tree)


def _rows(batch: Any, rank: int, world: int) -> Any:
    """This rank's contiguous 1/world of every leaf of ``batch`` along dim 0."""
    return optree.tree_map(lambda x: x.chunk(world)[rank] if torch.is_tensor(x) else x, batch)


def _made(make_step: Callable, args: tuple) -> Step:
    step = make_step(*args)
    if not isinstance(step, Step):
        raise TypeError(f"assert_data_parallel_equals_one_process: make_step(*args) must return a functrain Step "
                        f"(from ft.train_step, wrapped in your transforms, without data_parallel); got "
                        f"{describe(step, 80)}")
    return step


def _rank_job(make_step: Callable, args: tuple, params: Any, buffers: Any, batch: Any, steps: int, modes: tuple,
              backend: Any) -> dict:
    """What each rank runs: for each mode, ``steps`` data-parallel steps on its rows, then the whole state."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for mode in modes:
        dp = data_parallel(shard=mode)(_made(make_step, args))
        state = dp.init(params, buffers)
        run = ft_compile(dp, backend=backend) if backend is not None else dp
        history = []
        for i in range(steps):
            state, metrics = run(state, _rows(_batch_at(batch, i), rank, world))
            history.append(_host(metrics))
        out[mode] = (_host(gather_state(state)), history)
    # by value: ft.launch's queue would share the tensors' storage by file descriptors, gone once the rank exits
    return pickle.dumps(out)


def assert_data_parallel_equals_one_process(make_step: Callable[..., Step], params: Any, batch: Any, *,
                                            shard: Any = SHARD_MODES, buffers: Any = None, args: tuple = (),
                                            steps: int = 2, nprocs: int = 2, rtol: float = 1e-6, atol: float = 1e-6,
                                            backend: Any = None, timeout: float = 300.0) -> dict[str, float]:
    """Assert ``ft.data_parallel(shard=...)`` of your step on ``nprocs`` processes (gloo, CPU), each on its
    contiguous ``1/nprocs`` of every batch, equals the step on one process on the whole batch: the whole
    state (``ft.gather_state``) and the metrics of every step, on every rank, for each ``shard`` mode.

    ``make_step(*args)`` builds the step (your transforms applied, no ``data_parallel``) in each process: the
    ranks are new processes (:func:`functrain.launch`) that import it by name, so it must be a module-level
    function of an importable module (not a lambda, a nested function, or a function typed into a notebook or
    ``python -c``); ``args``, ``params``, ``buffers`` and ``batch`` are pickled to them. The one-process reference
    runs here. Each launch costs seconds (the ranks import torch), so all modes share one.

    What does not hold across processes by design is not a failure of this law: a transform that draws random
    numbers draws other numbers on each rank (each adds its rank to the step's seed), and an ``accumulate(n)``
    step's micro-batches are ``1/nprocs`` as large on a rank (the same sums, grouped otherwise: fp32 rounding).

    Args:
        make_step: a module-level ``make_step(*args) -> Step``.
        params: the initial params (every rank starts from them).
        batch: the whole batch (a pytree of tensors whose rows, dim 0, divide by ``nprocs`` times the step's
            micro-batches), or a picklable ``callable(i) -> batch`` for step ``i``.
        shard: a mode or a tuple of modes among ``"none"`` (replicated), ``"optimizer"``, ``"params"``
            (default: all three).
        buffers: the initial buffers (default ``None``).
        args: the arguments of ``make_step`` (default none).
        steps: how many steps (default 2).
        nprocs: the number of processes, >= 2 (default 2).
        rtol, atol: the tolerances of the comparison with one process (default ``1e-6``: the reduction sums in
            another order); the ranks' whole states must be bitwise the same.
        backend: ``None`` (default: eager), or a :func:`functrain.compile` backend for both sides
            (``"aot_eager"``).
        timeout: the job's limit in seconds (default 300): :func:`functrain.launch` kills it then.

    Returns:
        ``{mode: the largest absolute difference of a state element from one process}``.

    Raises:
        AssertionError: a rank's state or metrics differ from one process, or the ranks differ among
            themselves, naming the mode, the rank and the leaves.
        ValueError: a bad mode, ``steps``, ``nprocs`` or a batch that does not divide (``BadValue``, also a
            ``TypeError``), or ``make_step``/``args``/``batch`` that cannot be sent to the ranks.
        Exception: a rank's own error (:func:`functrain.launch` re-raises it with its traceback).

    Example (in a test module: ``make_step`` at its top level)::

        def make_step():
            return GradCentralize()(ft.train_step(loss_fn, ft.optim.adamw(1e-2)))

        def test_grad_centralize_data_parallel():
            ftt.assert_data_parallel_equals_one_process(make_step, params, (x, y))
    """
    modes = (shard,) if isinstance(shard, str) else tuple(shard)
    if not modes:
        raise BadValue(f"assert_data_parallel_equals_one_process: shard names no mode; use some of {SHARD_MODES}")
    for m in modes:
        check_choice("assert_data_parallel_equals_one_process: shard", m, SHARD_MODES)
    steps = check_int("assert_data_parallel_equals_one_process: steps", steps, minimum=1)
    nprocs = check_int("assert_data_parallel_equals_one_process: nprocs", nprocs, minimum=2)
    timeout = check_real("assert_data_parallel_equals_one_process: timeout", timeout, lo=0, lo_open=True)
    if not callable(make_step):
        raise BadValue(f"assert_data_parallel_equals_one_process: make_step must be a callable(*args) -> Step; "
                       f"got {describe(make_step, 80)}")
    try:
        pickle.dumps((make_step, args, batch))
    except Exception as e:  # noqa: BLE001 - any pickling failure means the ranks cannot get it
        raise BadValue(f"assert_data_parallel_equals_one_process: make_step, args and batch go to new processes, "
                       f"which import make_step by name: define it at the top level of an importable module (not "
                       f"a lambda, a nested function or a notebook cell) and pass picklable args and batch; "
                       f"pickling failed: {type(e).__name__}: {e}") from None
    reference_step = _made(make_step, args)
    micro = reference_step.micro_batches
    for i in range(steps):
        for leaf in optree.tree_leaves(_batch_at(batch, i)):
            rows = leaf.shape[0] if torch.is_tensor(leaf) and leaf.dim() else None
            if rows is None or rows % (nprocs * micro):
                raise BadValue(f"assert_data_parallel_equals_one_process: every batch leaf needs rows (dim 0) that "
                               f"divide by nprocs * micro-batches = {nprocs} * {micro}; step {i}'s batch has a leaf "
                               f"of shape {tuple(leaf.shape) if torch.is_tensor(leaf) else describe(leaf, 40)}")
    reference = reference_step.init(params, buffers)
    run = ft_compile(reference_step, backend=backend) if backend is not None else reference_step
    ref_history = []
    for i in range(steps):
        reference, metrics = run(reference, _batch_at(batch, i))
        ref_history.append(_host(metrics))
    reference = _host(reference)
    results = launch(_rank_job, nprocs=nprocs, args=(make_step, args, params, buffers, batch, steps, modes, backend),
                     timeout=timeout, dist_timeout=min(60.0, timeout))
    results = [pickle.loads(r) for r in results]  # what our own ranks pickled (_rank_job)
    errors = {}
    for mode in modes:
        for rank, out in enumerate(results):
            state, history = out[mode]
            where = f"data_parallel(shard={mode!r}) on {nprocs} processes, rank {rank},"
            if rank:
                assert_same_state(state, results[0][mode][0], what=f"{where} vs rank 0 (the replicas differ)")
            assert_same_state(state, reference, rtol, atol, what=f"{where} vs one process: the state after {steps} steps")
            for i, (got, want) in enumerate(zip(history, ref_history)):
                assert_same_state(got, want, rtol, atol, what=f"{where} vs one process: the metrics of step {i}")
        state = results[0][mode][0]
        errors[mode] = max((float((a.double() - b.double()).abs().max()) for a, b in
                            zip(optree.tree_leaves(state), optree.tree_leaves(reference))
                            if torch.is_tensor(a) and a.is_floating_point() and a.numel()), default=0.0)
    return errors
