"""Property-testing tools for functrain steps and the transforms you write.

functrain proves the laws of its own transforms (accumulation equals the big
batch, wrapping order does not matter, compiled equals eager, ...) with
`hypothesis <https://hypothesis.readthedocs.io>`_ property tests built from
this module. Use it to test your own :class:`functrain.Transform` the same way.
It needs hypothesis (``pip install functrain[test]``); ``import functrain``
does not import it.

Strategies (hypothesis ``SearchStrategy`` objects):
    :func:`shapes`, :func:`tensors`, :func:`pytrees` (nested dicts, lists and
    tuples of tensors), :func:`batches` (``(x, y)`` regression batches),
    :func:`mlp_problems` (a small MLP: params, a pure mean loss and a batch whose
    rows divide by a drawn ``n``), :func:`token_problems` (a tiny language model on
    variable-length padded sequences whose loss is a token sum with
    ``aux["num_items"]``), :func:`nd_params` and :func:`nd_problems` (params of 0 to 4
    dimensions: scalars, vectors, matrices, 3-D, convolution filters; a loss using them all).

Checkers (plain functions; they raise ``AssertionError`` naming the first
differing leaves):
    :func:`assert_same_state` (bitwise, or allclose), :func:`assert_pure`,
    :func:`assert_compiled_equals_eager` (and no recompiles; ``law=`` for bf16/fp16),
    :func:`assert_order_independent` (every wrapping order gives the same state),
    :func:`assert_close_normwise` (the documented norm-wise law of bf16/fp16 compute),
    :func:`assert_data_parallel_equals_one_process` (2 gloo processes, replicated and
    sharded, equal one process).

Tools:
    :func:`probe` (what a transform sees at a stage: gradients, params, the update),
    :func:`with_step` and :func:`state_at` (a state at step ``t``: the counters that
    schedules and bias corrections read), :func:`run_steps`, :func:`clone_tree`.

Example, a transform that scales the gradients, tested for purity, for
commuting with :func:`functrain.clip`, and for compiling to one graph::

    import torch, functrain as ft
    import functrain.testing as ftt
    from hypothesis import given, settings

    class ScaleGrads(ft.Transform):
        name, order = "scale_grads", 50          # stage "transform", after clip (10)

        def __init__(self, factor):
            self.factor = factor

        def transform(self, ctx):
            ctx.grads = ft.tree.tree_scale(ctx.grads, self.factor)

    @settings(deadline=None, max_examples=25)
    @given(ftt.mlp_problems())
    def test_scale_grads_laws(problem):
        step = ft.train_step(problem.loss_fn, ft.optim.adam(1e-2))
        state = ScaleGrads(0.5)(step).init(problem.params)
        ftt.assert_pure(ScaleGrads(0.5)(step), state, problem.batch)
        ftt.assert_order_independent(step, [ScaleGrads(0.5), ft.clip(0.1)], (problem.params,), problem.batch)

    @settings(deadline=None, max_examples=3)   # each example compiles (about a second with aot_eager)
    @given(ftt.mlp_problems())
    def test_scale_grads_compiles(problem):
        step = ScaleGrads(0.5)(ft.train_step(problem.loss_fn, ft.optim.sgd(0.1)))
        ftt.assert_compiled_equals_eager(step, step.init(problem.params), problem.batch,
                                         steps=10, backend="aot_eager")
"""
from __future__ import annotations

from .strategies import (Problem, batches, mlp_loss, mlp_problems, nd_loss, nd_params, nd_problems,  # noqa: F401
                         pytrees, shapes, tensors, token_mean_loss, token_problems, token_sum_loss, SEEDS)
from .checks import (LAW_EPS, assert_close_normwise, assert_compiled_equals_eager,  # noqa: F401
                     assert_order_independent, assert_pure, assert_same_state, clone_tree, law_dtype, run_steps,
                     state_at, with_step)
from .probe import PROBE_FIELDS, Probe, probe  # noqa: F401
from .parallel import SHARD_MODES, assert_data_parallel_equals_one_process  # noqa: F401

__all__ = [
    "shapes", "tensors", "pytrees", "batches", "mlp_problems", "token_problems", "nd_params", "nd_problems",
    "Problem", "mlp_loss", "token_sum_loss", "token_mean_loss", "nd_loss",
    "assert_same_state", "assert_pure", "assert_compiled_equals_eager", "assert_order_independent",
    "assert_close_normwise", "LAW_EPS", "law_dtype", "assert_data_parallel_equals_one_process", "SHARD_MODES",
    "probe", "Probe", "PROBE_FIELDS", "with_step", "state_at", "run_steps", "clone_tree",
]
