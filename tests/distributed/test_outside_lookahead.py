"""A Lookahead-style transform written outside functrain, sharded by data_parallel through its declarations alone.

``SlowWeights`` (Zhang et al. 2019, "Lookahead Optimizer: k steps forward, 1 step back") is defined here
and nowhere in functrain: its slot holds the slow weights (a tree shaped like the params, declared in
``params_fields``) and a count of applied updates; its ``after`` hook, every ``k`` applied updates, moves
the slow weights towards the params, ``slow += alpha * (params - slow)``, and puts the params back to
them. On 2 real processes (gloo) under ``data_parallel(shard="optimizer")`` and ``shard="params"`` it
trains to the state one process reaches on the whole batch (gathered), each rank holds 1/N of the slow
weights, and a sharded checkpoint resumes bit-exactly. functrain knows neither its name nor its type.
"""
from __future__ import annotations

import os
import pathlib
from typing import Any, NamedTuple

import torch

import functrain as ft
from functrain import tree as T

NAME = "outside_slow_weights"
MODES = ("optimizer", "params")
K, ALPHA, STEPS = 2, 0.5, 5


@ft.register_checkpoint_type("tests.outside.SlowWeightsState")
class SlowWeightsState(NamedTuple):
    """The slot: the slow weights (params-shaped) and the number of applied updates."""

    slow: Any
    count: torch.Tensor


class SlowWeights(ft.Transform):
    """Every ``k`` applied updates: ``slow += alpha * (params - slow)``, then ``params = slow`` (stage ``after``)."""

    name = NAME
    order = 50  # in "after": before the sharded data_parallel (1000) gathers the new params
    params_fields = ("slow",)  # shaped like the params: a sharded step holds 1/N of it per rank
    needs = "elementwise"  # per element: a sharded step may run it on its shard

    def __init__(self, k: int, alpha: float):
        self.k, self.alpha = k, alpha

    def init(self, params, buffers) -> SlowWeightsState:
        device = T.tree_leaves(params)[0].device
        return SlowWeightsState(T.tree_map(lambda p: p.detach().clone(), params),
                                torch.zeros((), dtype=torch.int64, device=device))

    def after(self, ctx) -> None:
        old: SlowWeightsState = ctx.slot(self)
        applied = torch.ones((), dtype=torch.bool) if ctx.apply is None else ctx.apply
        count = old.count + applied.to(torch.int64)
        sync = applied & (count % self.k == 0)
        moved = T.tree_map(lambda s, p: s + self.alpha * (p - s), old.slow, ctx.params)
        ctx.params = T.tree_select(sync, moved, ctx.params)
        ctx.set_slot(self, SlowWeightsState(T.tree_select(sync, moved, old.slow), count))


def problem(rank: int = 0):
    """A 67-parameter MLP (odd: the last shard is padded), AdamW, a batch of 8 rows; rank 1 starts elsewhere."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    apply_fn, params, buffers = ft.functionalize(model)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 4, generator=g), torch.randn(8, 3, generator=g)) for _ in range(STEPS)]

    def loss_fn(params, buffers, batch):
        return torch.nn.functional.mse_loss(apply_fn(params, buffers, batch[0]), batch[1])

    if rank:  # the sharded init must broadcast rank 0's params
        params = {k: v + 1.0 for k, v in params.items()}
    return loss_fn, params, buffers, batches


def make_step(loss_fn, with_transform: bool = True):
    step = ft.clip(1.0)(ft.train_step(loss_fn, ft.optim.adamw(1e-2, weight_decay=0.1)))
    return SlowWeights(K, ALPHA)(step) if with_transform else step


def rows(batch, rank: int, world: int):
    n = batch[0].shape[0] // world
    return tuple(t[rank * n:(rank + 1) * n] for t in batch)


def _nbytes(tree) -> int:
    return sum(t.numel() * t.element_size() for t in T.tree_leaves(tree) if torch.is_tensor(t))


def test_one_process_is_lookahead_by_hand():
    """The law on one process: the plain step's updates, and every K-th applied update the slow weights move
    by ALPHA towards the params and the params jump to them (computed here from the step without it)."""
    loss_fn, params, buffers, batches = problem()
    step, plain = make_step(loss_fn), make_step(loss_fn, with_transform=False)
    state = step.init(params, buffers)
    ref, slow = plain.init(params, buffers), T.tree_map(torch.clone, params)
    for i, b in enumerate(batches, start=1):
        state, _ = step(state, b)
        ref, _ = plain(ref, b)
        if i % K == 0:
            slow = T.tree_map(lambda s, p: s + ALPHA * (p - s), slow, ref.params)
            ref = ref._replace(params=T.tree_map(torch.clone, slow))
    assert T.tree_equal(state.params, ref.params) and T.tree_equal(state.slots[NAME].slow, slow)
    assert T.tree_equal(state.opt_state, ref.opt_state) and int(state.slots[NAME].count) == len(batches)


def _worker(root: str) -> dict:
    """On each rank: the one-process reference on the whole batch, then per mode the sharded run on this
    rank's rows, gathered and compared, the slot's size, and a checkpoint at step 2 resumed to the end."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    loss_fn, params0, buffers, batches = problem(0)
    reference = make_step(loss_fn).init(params0, buffers)
    one = make_step(loss_fn)
    for b in batches:
        reference, _ = one(reference, b)
    out = {}
    for mode in MODES:
        loss_fn, params, buffers, batches = problem(rank)
        step = ft.data_parallel(shard=mode)(make_step(loss_fn))
        state = step.init(params, buffers)
        for i, b in enumerate(batches):
            state, _ = step(state, rows(b, rank, world))
            if i == 1:
                path = os.path.join(root, mode)
                ft.save(path, state)
                saved = state
        full = ft.gather_state(state)
        err = max(float((a.double() - b.double()).abs().max()) for a, b in
                  zip(T.tree_leaves(full), T.tree_leaves(reference)) if a.is_floating_point())
        # resume: a fresh step and template, as a new job would
        again = ft.data_parallel(shard=mode)(make_step(problem(rank)[0]))
        resumed = ft.load(path, again.init(params, buffers))
        loaded_exact = T.tree_equal(resumed, saved)
        for b in batches[2:]:
            resumed, _ = again(resumed, rows(b, rank, world))
        out[mode] = {
            "same_structure": T.tree_structure(full) == T.tree_structure(reference),
            "err": err,
            "counts_equal": int(full.slots[NAME].count) == int(reference.slots[NAME].count) == STEPS,
            "slow_bytes": (_nbytes(state.slots[NAME].slow), _nbytes(reference.slots[NAME].slow)),
            "slow_is_shard": sorted(state.slots[NAME].slow) == ["float32"],
            "loaded_exact": loaded_exact,
            "resume_exact": T.tree_equal(resumed, state),
        }
    return out


def test_sharded_on_two_processes_equals_one_and_resumes(tmp_path):
    reports = ft.launch(_worker, nprocs=2, args=(str(tmp_path / "ckpt"),), timeout=300)
    for rank, report in enumerate(reports):
        for mode, r in report.items():
            what = f"rank {rank}, shard={mode!r}"
            assert r["same_structure"], f"{what}: gather_state's structure is not the one-process state's"
            assert r["err"] <= 1e-6, f"{what}: differs from one process on the whole batch by {r['err']:.2e}"
            assert r["counts_equal"], what
            mine, whole = r["slow_bytes"]
            assert r["slow_is_shard"] and mine * 2 <= whole + 64, f"{what}: slow weights {mine} B of {whole} B per rank"
            assert r["loaded_exact"], f"{what}: the loaded sharded state is not the saved one bitwise"
            assert r["resume_exact"], f"{what}: the resumed run differs from the uninterrupted one"
    for mode in MODES:
        assert sorted(os.listdir(tmp_path / "ckpt" / mode)) == ["SHARDED.json", "rank_00000", "rank_00001"]
        whole = ft.load(tmp_path / "ckpt" / mode)  # one process, no template: the whole state, slow weights too
        assert type(whole.slots[NAME]) is SlowWeightsState and T.tree_structure(whole.slots[NAME].slow) == \
            T.tree_structure(problem()[1])


def test_no_functrain_file_names_the_transform():
    """No edit to functrain: nothing in the package names the transform, its slot or its type."""
    root = pathlib.Path(ft.__file__).parent
    for path in root.rglob("*.py"):
        text = path.read_text()
        for word in (NAME, "SlowWeights", "SlowWeightsState"):
            assert word not in text, f"{path} mentions {word}"
