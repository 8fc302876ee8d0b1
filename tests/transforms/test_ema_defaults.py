"""One EMA for both APIs: ft.ema's defaults are ema-pytorch's (the warm-up of denoising-diffusion-pytorch's Trainer),
so the same numbers through ft.ema and through ft.TrainConfig give the same EMA; the plain EMA is warmup=False."""
from __future__ import annotations

import pytest
import torch

import functrain as ft
from functrain import tree as T
from functrain.trainer.build import config_ema


def _run(transform, updates):
    loss = lambda p, b, x: ((x @ p["w"]) ** 2).mean()  # noqa: E731
    step = transform(ft.train_step(loss, ft.optim.adamw(1e-1)))
    state = step.init({"w": torch.randn(3, 2, generator=torch.Generator().manual_seed(0))})
    gen = torch.Generator().manual_seed(1)
    emas = []
    for _ in range(updates):
        state, _ = step(state, torch.randn(4, 3, generator=gen))
        emas.append(state.ema)
    return state, emas


@pytest.mark.parametrize("numbers", [dict(decay=0.995, every=10), dict(decay=0.9, every=1), dict(decay=0.99, every=3)])
def test_the_same_numbers_give_the_same_ema_through_ft_ema_and_the_trainers_config(numbers):
    """ft.ema(d, every=k) and TrainConfig(ema_decay=d, ema_update_every=k): the same transform (its repr) and the
    same EMA after every one of 150 updates, bitwise; after the copy phase (100 updates) it is not the params."""
    ours = ft.ema(numbers["decay"], every=numbers["every"])
    config = config_ema(ft.TrainConfig(ema_decay=numbers["decay"], ema_update_every=numbers["every"]))
    assert repr(ours) == repr(config)
    a, emas_a = _run(ours, 150)
    b, emas_b = _run(config, 150)
    for k, (x, y) in enumerate(zip(emas_a, emas_b), 1):
        assert T.tree_equal(x, y), k
    assert not T.tree_equal(a.ema, a.params)


def test_the_default_is_ema_pytorchs_warm_up():
    """Copies for the first 100 updates, then blends with d_k = 1 - (1 + (k - 100)) ** -(2/3), capped at decay: the
    reference computed here, update by update."""
    state, emas = _run(ft.ema(0.995, every=1), 130)
    loss = lambda p, b, x: ((x @ p["w"]) ** 2).mean()  # noqa: E731
    step = ft.train_step(loss, ft.optim.adamw(1e-1))
    plain = step.init({"w": torch.randn(3, 2, generator=torch.Generator().manual_seed(0))})
    gen = torch.Generator().manual_seed(1)
    ema = plain.params["w"].clone()
    for k in range(1, 131):
        plain, _ = step(plain, torch.randn(4, 3, generator=gen))
        if k <= 100:
            ema = plain.params["w"].clone()
        else:
            d = min(0.995, 1 - (1 + (k - 100)) ** (-2 / 3))
            ema = torch.lerp(ema, plain.params["w"], 1 - d)
        torch.testing.assert_close(emas[k - 1]["w"], ema, rtol=1e-6, atol=1e-7, msg=f"update {k}")


def test_warmup_false_is_the_plain_ema():
    """ema = d * ema + (1 - d) * params from the first update: against the reference computed here."""
    _, emas = _run(ft.ema(0.9, warmup=False), 5)
    loss = lambda p, b, x: ((x @ p["w"]) ** 2).mean()  # noqa: E731
    step = ft.train_step(loss, ft.optim.adamw(1e-1))
    state = step.init({"w": torch.randn(3, 2, generator=torch.Generator().manual_seed(0))})
    gen = torch.Generator().manual_seed(1)
    ema = state.params["w"].clone()
    for k in range(5):
        state, _ = step(state, torch.randn(4, 3, generator=gen))
        ema = torch.lerp(ema, state.params["w"], 0.1)
        torch.testing.assert_close(emas[k]["w"], ema)
    assert repr(ft.ema(0.9, warmup=False)) == "ema(0.9, every=1, start_step=0)"


@pytest.mark.parametrize("bad,message", [
    (dict(warmup=False, power=1.0), "ema: power=1.0 shapes the warm-up, which warmup=False turns off"),
    (dict(warmup="no"), "ema: warmup must be True (ema-pytorch's warm-up) or False (the plain EMA); got 'no'"),
])
def test_bad_warmup_arguments_are_refused_by_name(bad, message):
    with pytest.raises(ft.BadValue if hasattr(ft, "BadValue") else ValueError) as info:
        ft.ema(0.9, **bad)
    assert str(info.value).startswith(message), str(info.value)
