"""Checkpoints written before FlatSpec and FlatLayout became one type (commit ed14ba9) still load, bit for bit.

tests/checkpoint/old_checkpoints/ holds what make_old_checkpoints.py (beside them) wrote with that code: a
2-rank sharded checkpoint per mode (a ShardState slot, shard trees of two dtypes, an EMA), the same state
gathered as a plain checkpoint, and a flat state. The format did not change; this guards it as the layout
code moves.
"""
from __future__ import annotations

import pathlib
import sys

import pytest
import torch

import functrain as ft
from functrain import tree as T
from functrain.checkpoint import folder
from functrain.checkpoint.format import complete
from functrain.core.flat import SLOT, FlatLayout, FlatParams

OLD = pathlib.Path(__file__).parent / "old_checkpoints"
sys.path.insert(0, str(OLD))
from make_old_checkpoints import problem  # noqa: E402  (the problem the old code ran)


@pytest.mark.parametrize("mode", ["optimizer", "params"])
def test_an_old_sharded_checkpoint_loads_whole_and_resharded(mode):
    bare = ft.load(OLD / f"logical_{mode}")
    assert T.tree_equal(ft.load(OLD / f"sharded_{mode}"), bare)  # the two rank folders joined
    step, params, buffers, batch = problem()
    # written before the hyper-parameters were data: loaded with a template, its are the template's (the
    # constructor's), everything the file holds is the file's
    logical = complete(bare, step.init(params, buffers))
    assert bare.opt_state.hyper is None and float(logical.opt_state.hyper["lr"]) == 1e-2
    assert float(logical.slots["clip"].hyper["max_norm"]) == 1.0 and float(logical.slots["ema"].hyper["decay"]) == 0.5
    assert T.tree_equal(ft.load(OLD / f"sharded_{mode}", step.init(params, buffers)), logical)  # unsharded template
    one = ft.data_parallel(shard=mode)(step)
    loaded = ft.load(OLD / f"sharded_{mode}", one.init(params, buffers))  # cut again for 1 rank
    assert T.tree_equal(ft.gather_state(loaded), logical)
    # the layout a saved ShardState describes is the one the new type computes for those params
    for rank in (0, 1):
        slot = folder.load(OLD / f"sharded_{mode}" / f"rank_0000{rank}").slots[SLOT]
        saved = FlatLayout.from_slot(slot)
        assert (saved.world, saved.rank) == (2, rank)
        assert saved.entries == FlatLayout.from_params(logical.params, world=2, rank=rank).entries
    a, _ = step(ft.load(OLD / f"logical_{mode}", step.init(params, buffers)), batch)
    b, _ = one(loaded, batch)
    assert max(float((x - y).abs().max()) for x, y in zip(T.tree_leaves(a), T.tree_leaves(ft.gather_state(b)))
               if x.is_floating_point()) <= 1e-6


def test_an_old_flat_checkpoint_loads_into_a_flat_template():
    step, params, buffers, _ = problem()
    plain = complete(ft.load(OLD / "flat"), step.init(params, buffers))  # (hyper-parameters: the template's)
    state = ft.load(OLD / "flat", ft.flat(step.init(params, buffers)))
    assert isinstance(state.params, FlatParams) and isinstance(state.opt_state.exp_avg, FlatParams)
    assert sorted(state.params.buffers) == ["float32", "float64"]
    assert T.tree_equal(ft.unflat(state), plain)
    assert int(plain.step) == 2 and plain.params["scale"].dtype == torch.float64
