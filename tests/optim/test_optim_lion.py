"""Lion: against an independent per-tensor reference, its laws, compiled, checkpointed."""
from __future__ import annotations

import optree
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_optim import (assert_tree_close, bits_equal, compiled_and_eager_updates, make_grads, make_params,
                        run_functional)

from functrain.optim import LionState, lion, masks, schedules


def lion_reference(params, grads, lr, betas, wd, decay=None, mult=None):
    """Lion as written in the paper (Chen et al. 2023, Alg. 2), one tensor at a time, plain ops."""
    b1, b2 = betas
    p = {k: v.clone() for k, v in params.items()}
    m = {k: torch.zeros_like(v) for k, v in params.items()}
    for t, g in enumerate(grads):
        lr_t = lr(t) if callable(lr) else lr
        for k in p:
            lr_k = lr_t * (1.0 if mult is None else mult[k])
            c = m[k] * b1 + g[k] * (1 - b1)
            if decay is None or decay[k]:
                p[k] = p[k] - lr_k * wd * p[k]
            p[k] = p[k] - lr_k * torch.sign(c)
            m[k] = m[k] * b2 + g[k] * (1 - b2)
    return p, m


_shapes = st.lists(st.lists(st.integers(1, 4), min_size=0, max_size=3).map(tuple), min_size=1, max_size=4)


@settings(max_examples=20, deadline=None)
@given(
    shapes=_shapes,
    lr=st.floats(1e-4, 0.1),
    beta1=st.floats(0.0, 0.99),
    beta2=st.floats(0.5, 0.999),
    wd=st.sampled_from([0.0, 0.01, 1.0]),
    steps=st.integers(1, 8),
    seed=st.integers(0, 2**16),
)
def test_property_matches_reference(shapes, lr, beta1, beta2, wd, steps, seed):
    params = make_params(seed, {f"p{i}": s for i, s in enumerate(shapes)})
    grads = make_grads(params, steps=steps, seed=seed + 1)
    expected_p, expected_m = lion_reference(params, grads, lr, (beta1, beta2), wd)
    actual, state, _ = run_functional(lion(lr, betas=(beta1, beta2), weight_decay=wd), params, grads)
    assert isinstance(state, LionState) and int(state.count) == steps
    # A sign flip would move an element by 2 * lr >= 2e-4; float32 round-off stays far below.
    assert_tree_close(actual, expected_p, atol=1e-5)
    assert_tree_close(state.exp_avg, expected_m, atol=1e-6)


def test_matches_reference_with_schedule_mask_and_multipliers():
    params = {"fc.weight": torch.randn(4, 3), "fc.bias": torch.randn(4), "head.weight": torch.randn(2, 4)}
    grads = make_grads(params, steps=12, seed=7)
    sched = schedules.warmup_cosine(0.01, warmup_steps=3, total_steps=12, final=0.001)
    mult = {"fc.weight": 1.0, "fc.bias": 2.0, "head.weight": 0.5}
    decay = masks.resolve(masks.no_decay_bias_and_norm, params)
    expected, _ = lion_reference(params, grads, lambda t: float(sched(t)), (0.9, 0.99), 0.5, decay, mult)
    opt = lion(sched, weight_decay=0.5, weight_decay_mask=masks.no_decay_bias_and_norm, lr_multipliers=mult)
    actual, _, lrs = run_functional(opt, params, grads)
    assert lrs[0] == 0.0 and lrs[3] == pytest.approx(0.01)
    assert_tree_close(actual, expected, atol=1e-6)


@settings(max_examples=10, deadline=None)
@given(scale_exp=st.integers(-20, 20), seed=st.integers(0, 2**16), wd=st.sampled_from([0.0, 0.1]))
def test_law_invariant_to_gradient_scale(scale_exp, seed, wd):
    """sign(lerp(m, g)) ignores a positive gradient scale: power-of-two scales give the same bits."""
    params = make_params(seed)
    grads = make_grads(params, steps=5, seed=seed + 1)
    scaled = [optree.tree_map(lambda g: g * 2.0**scale_exp, g) for g in grads]
    a, _, _ = run_functional(lion(0.01, weight_decay=wd), params, grads)
    b, _, _ = run_functional(lion(0.01, weight_decay=wd), params, scaled)
    assert bits_equal(a, b)


def test_law_every_element_moves_by_lr():
    params = make_params(3)
    grads = make_grads(params, steps=4, seed=4)
    opt = lion(0.125)  # a power of two: |p - p'| == lr exactly unless rounding at large |p|
    state = opt.init(params)
    for g in grads:
        new, state = opt.update(g, state, params)
        for x, y in zip(optree.tree_leaves(params), optree.tree_leaves(new)):
            torch.testing.assert_close((x - y).abs(), torch.full_like(x, 0.125), rtol=0, atol=1e-6)
        params = new
    zero = optree.tree_map(torch.zeros_like, params)
    fresh = opt.init(params)
    same, _ = opt.update(zero, fresh, params)  # c == 0: sign 0, no move
    assert bits_equal(same, params)


def test_compiled_fullgraph_matches_eager():
    params = {"fc.weight": torch.randn(4, 3), "fc.bias": torch.randn(4), "ln.weight": torch.randn(4),
              "scale": torch.randn(())}
    opt = lion(schedules.warmup_linear_decay(0.01, 1, 4, final=0.001), weight_decay=0.1,
               weight_decay_mask=masks.no_decay_bias_and_norm,
               lr_multipliers=lambda name, p: 3.0 if name.startswith("fc") else 1.0)
    p_c, s_c, p_e, s_e, graphs = compiled_and_eager_updates(opt, params, make_grads(params, steps=4, seed=9),
                                                            "aot_eager")
    assert graphs == 1
    assert int(s_c.count) == 4
    assert_tree_close(p_c, p_e, atol=0)
    assert_tree_close(s_c, s_e, atol=0)


def test_state_checkpoint_roundtrip(tmp_path):
    from functrain import checkpoint

    params = make_params(1)
    opt = lion(0.01)
    params, state = opt.update(make_grads(params, steps=1)[0], opt.init(params), params)
    checkpoint.save(tmp_path / "ck", state)
    loaded = checkpoint.load(tmp_path / "ck")
    assert isinstance(loaded, LionState) and bits_equal(loaded, state)


@pytest.mark.parametrize("make, exc, match", [
    (lambda: lion(lr=-1.0), ValueError, r"lr must be .* got -1\.0"),
    (lambda: lion(lr=0.1, betas=(0.9, 1.0)), ValueError, r"betas\[1\] must be a float in \[0, 1\); got 1\.0"),
    (lambda: lion(lr=0.1, weight_decay=-0.1), ValueError, r"weight_decay must be a float >= 0; got -0\.1"),
])
def test_bad_arguments(make, exc, match):
    with pytest.raises(exc, match=match):
        make()
