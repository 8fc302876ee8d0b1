"""Weight-decay masks and lr multipliers: bitwise parity with torch.optim param groups."""
from __future__ import annotations

import optree
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_optim import bits_equal, make_grads, run_functional

from functrain.optim import adam, adamw, groups, lion, masks, schedules, sgd

STEPS = 30

# A small "model": the names functrain.functionalize gives (named_parameters keys).
SHAPES = {
    "embed.weight": (6, 4),
    "blocks.0.ln_1.weight": (4,),
    "blocks.0.ln_1.bias": (4,),
    "blocks.0.attn.in_proj_weight": (12, 4),
    "blocks.0.attn.in_proj_bias": (12,),
    "blocks.0.norm2.weight": (2, 4),  # a 2-D norm weight: excluded by name, not by ndim
    "blocks.0.mlp.fc.weight": (8, 4),
    "blocks.0.mlp.fc.bias": (8,),
    "head.weight": (3, 4),
    "gain": (),
}
NO_DECAY = {"blocks.0.ln_1.weight", "blocks.0.ln_1.bias", "blocks.0.attn.in_proj_bias", "blocks.0.norm2.weight",
            "blocks.0.mlp.fc.bias", "gain"}


def model_params(seed: int = 0, shapes=SHAPES) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=gen) for k, s in shapes.items()}


def run_torch_groups(opt_cls, groups_spec, params, grads, lr_lambda=None, **common):
    """torch.optim with one param group per ``(names, group_kwargs)`` in ``groups_spec``."""
    ps = {k: torch.nn.Parameter(v.clone()) for k, v in params.items()}
    opt = opt_cls([dict(params=[ps[n] for n in names], **kw) for names, kw in groups_spec if names], **common)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda) if lr_lambda is not None else None
    for g in grads:
        for k, p in ps.items():
            p.grad = g[k].clone()
        opt.step()
        if sched is not None:
            sched.step()
    return {k: p.detach() for k, p in ps.items()}


def test_no_decay_bias_and_norm_rule():
    got = masks.resolve(masks.no_decay_bias_and_norm, model_params())
    assert {k for k, v in got.items() if not v} == NO_DECAY
    decay = masks.no_decay_bias_and_norm
    m = torch.ones(3, 3)
    for name in ["encoder.LayerNorm.weight", "ln_f/weight", "bn1.weight", "final_layer_norm.weight",
                 "model.layers.0.input_layernorm.weight", "rms_norm.scale", "relative_attention_bias.weight",
                 "gn.weight", "ln2.weight"]:
        assert decay(name, m) is False, name
    for name in ["fc.weight", "lm_head.weight", "conv1.weight", "linear.weight", "kiln.weight", "w",
                 "subnet.weight", "lnx.weight", "embedding.weight"]:
        assert decay(name, m) is True, name
    assert decay("fc.weight", torch.ones(3)) is False and decay("fc.weight", torch.ones(())) is False
    assert masks.name_tokens("a.B_c/d-1") == ["a", "b", "c", "d", "1"]


def _split(mask_names):
    decay = [k for k in SHAPES if k not in mask_names]
    return decay, [k for k in SHAPES if k in mask_names]


MASK_CASES = {
    "adamw_predicate": (adamw, torch.optim.AdamW, dict(lr=2e-2, betas=(0.85, 0.97), weight_decay=0.3),
                        masks.no_decay_bias_and_norm),
    "adamw_tree": (adamw, torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1),
                   {k: k not in NO_DECAY for k in SHAPES}),
    "adam_l2": (adam, torch.optim.Adam, dict(lr=1e-2, weight_decay=0.2), masks.no_decay_bias_and_norm),
    "sgd_momentum": (sgd, torch.optim.SGD, dict(lr=0.05, momentum=0.9, weight_decay=0.1),
                     masks.no_decay_bias_and_norm),
    "sgd_nesterov": (sgd, torch.optim.SGD, dict(lr=0.03, momentum=0.8, nesterov=True, weight_decay=0.2),
                     masks.no_decay_bias_and_norm),
}


@pytest.mark.parametrize("name", list(MASK_CASES))
def test_weight_decay_mask_matches_two_torch_param_groups_bitwise(name):
    ours, theirs, kw, mask = MASK_CASES[name]
    params = model_params(1)
    grads = make_grads(params, steps=STEPS, seed=2)
    decay, no_decay = _split(NO_DECAY)
    wd = kw["weight_decay"]
    common = {k: v for k, v in kw.items() if k != "weight_decay"}
    expected = run_torch_groups(theirs, [(decay, dict(weight_decay=wd)), (no_decay, dict(weight_decay=0.0))],
                                params, grads, **common)
    actual, state, _ = run_functional(ours(**kw, weight_decay_mask=mask), params, grads)
    assert int(state.count) == STEPS
    assert bits_equal(actual, expected)
    # The mask matters: decaying everything gives other numbers on the masked leaves.
    unmasked, _, _ = run_functional(ours(**kw), params, grads)
    assert not bits_equal({k: unmasked[k] for k in no_decay}, {k: expected[k] for k in no_decay})
    assert bits_equal({k: unmasked[k] for k in decay}, {k: expected[k] for k in decay})


def _mult(name, p):
    return 10.0 if name.startswith("head") else 0.5 if "ln_1" in name else 1.0


@pytest.mark.parametrize("with_schedule", [False, True], ids=["constant_lr", "lambda_lr"])
@pytest.mark.parametrize("ours, theirs, kw", [
    (adamw, torch.optim.AdamW, dict(betas=(0.9, 0.95), weight_decay=0.1)),
    (adam, torch.optim.Adam, dict(weight_decay=0.05)),
    (sgd, torch.optim.SGD, dict(momentum=0.9, dampening=0.1, weight_decay=0.05)),
], ids=["adamw", "adam", "sgd"])
def test_lr_multipliers_and_mask_match_torch_param_groups_bitwise(ours, theirs, kw, with_schedule):
    params = model_params(3)
    grads = make_grads(params, steps=STEPS, seed=4)
    base = 0.02
    sched = schedules.warmup_linear_decay(base, warmup_steps=5, total_steps=STEPS, final=0.002)
    # torch: one group per (decay, multiplier); with LambdaLR, group lr = initial lr * lambda(t).
    spec = {}
    for k, p in params.items():
        key = (masks.no_decay_bias_and_norm(k, p), _mult(k, p))
        spec.setdefault(key, []).append(k)
    assert len(spec) == 4
    scale = 1.0 if with_schedule else base
    torch_groups = [(names, dict(lr=scale * m, weight_decay=kw["weight_decay"] if d else 0.0))
                    for (d, m), names in spec.items()]
    common = {k: v for k, v in kw.items() if k != "weight_decay"}
    expected = run_torch_groups(theirs, torch_groups, params, grads,
                                lr_lambda=(lambda t: float(sched(t))) if with_schedule else None, lr=1.0, **common)
    opt = ours(lr=sched if with_schedule else base, **kw,
               weight_decay_mask=masks.no_decay_bias_and_norm, lr_multipliers=_mult)
    actual, _, lrs = run_functional(opt, params, grads)
    assert bits_equal(actual, expected)
    assert lrs[0] == (0.0 if with_schedule else base)  # learning_rate() reports the base lr
    # The same multipliers as a pytree of floats give the same bits.
    tree = {k: _mult(k, p) for k, p in params.items()}
    again, _, _ = run_functional(ours(lr=sched if with_schedule else base, **kw,
                                      weight_decay_mask=masks.no_decay_bias_and_norm, lr_multipliers=tree),
                                 params, grads)
    assert bits_equal(again, actual)


@settings(max_examples=12, deadline=None)
@given(
    shapes=st.lists(st.lists(st.integers(1, 3), min_size=0, max_size=3).map(tuple), min_size=1, max_size=5),
    data=st.data(),
    lr=st.floats(1e-4, 0.1),
    wd=st.sampled_from([1e-3, 0.1, 0.5]),
    seed=st.integers(0, 2**16),
)
def test_property_random_groups_match_torch(shapes, data, lr, wd, seed):
    names = [f"p{i}" for i in range(len(shapes))]
    params = model_params(seed, dict(zip(names, shapes)))
    mask = {n: data.draw(st.booleans(), label=f"decay {n}") for n in names}
    mult = {n: data.draw(st.sampled_from([0.0, 0.25, 1.0, 3.0]), label=f"mult {n}") for n in names}
    grads = make_grads(params, steps=6, seed=seed + 1)
    spec = {}
    for n in names:
        spec.setdefault((mask[n], mult[n]), []).append(n)
    for ours, theirs, extra in [(adamw, torch.optim.AdamW, dict(betas=(0.8, 0.99))),
                                (sgd, torch.optim.SGD, dict(momentum=0.7))]:
        tg = [(ns, dict(lr=lr * m, weight_decay=wd if d else 0.0)) for (d, m), ns in spec.items()]
        expected = run_torch_groups(theirs, tg, params, grads, lr=lr, **extra)
        actual, _, _ = run_functional(ours(lr=lr, weight_decay=wd, weight_decay_mask=mask, lr_multipliers=mult,
                                           **extra), params, grads)
        assert bits_equal(actual, expected)


def test_groups_are_pure_and_nested_names():
    params = {"enc": {"fc": {"weight": torch.randn(3, 2), "bias": torch.randn(3)}}, "ln": {"w": torch.randn(2, 2)}}
    seen = []

    def pred(name, p):
        seen.append(name)
        return name == "enc/fc/weight"

    opt = adamw(0.1, weight_decay=0.5, weight_decay_mask=pred)
    state = opt.init(params)
    assert sorted(set(seen)) == ["enc/fc/bias", "enc/fc/weight", "ln/w"]
    snapshot = optree.tree_map(torch.clone, (state, params))
    g = optree.tree_map(torch.ones_like, params)
    new_params, _ = opt.update(g, state, params)
    assert bits_equal((state, params), snapshot)
    assert groups.decay_mask(pred, params) == [False, True, False]


@pytest.mark.parametrize("make, exc, match", [
    (lambda: adamw(0.1, weight_decay_mask=True), TypeError, r"adamw: weight_decay_mask must be None, a pytree of bools"),
    (lambda: sgd(0.1, weight_decay=0.1, weight_decay_mask="bias"), TypeError, r"weight_decay_mask .* got 'bias'"),
    (lambda: lion(0.1, lr_multipliers=2.0), TypeError, r"lion: lr_multipliers must be None, a pytree of floats"),
])
def test_bad_group_arguments(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


def test_bad_groups_for_the_params():
    params = {"w": torch.ones(2, 2), "b": torch.ones(2)}
    with pytest.raises(ValueError, match=r"weight_decay_mask must have the structure of the params \(2 leaves"):
        adamw(0.1, weight_decay_mask={"w": True}).init(params)
    with pytest.raises(TypeError, match=r"weight_decay_mask for param 'b' must be a bool \(True = decay\); got 1 \(int\)"):
        adamw(0.1, weight_decay_mask={"w": True, "b": 1}).init(params)
    with pytest.raises(TypeError, match=r"weight_decay_mask for param 'b' .* got tensor\(False\) \(Tensor\); .*Python"):
        sgd(0.1, weight_decay=0.1, weight_decay_mask=lambda n, p: p.ndim > torch.tensor(1)).init(params)
    with pytest.raises(ValueError, match=r"lr_multipliers for param 'b' must be a finite float >= 0; got -1\.0"):
        adam(0.1, lr_multipliers={"w": 1.0, "b": -1.0}).init(params)
    with pytest.raises(ValueError, match=r"lr_multipliers for param 'b' .* got nan"):
        sgd(0.1, lr_multipliers=lambda n, p: float("nan")).init(params)
    with pytest.warns(UserWarning, match=r"sgd: weight_decay_mask has no effect with weight_decay=0"):
        sgd(0.1, weight_decay_mask=masks.no_decay_bias_and_norm)
