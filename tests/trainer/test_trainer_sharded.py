"""ft.Trainer with TrainConfig.shard: 2 real processes (gloo) equal the replicated run, resume bit-exactly, and their
checkpoints (one folder per rank) resume on another world size; CheckpointManager with sharded states; the sharded
step on 2 "nodes" on loopback equals one process on the whole batch.

Every subprocess runs with a timeout.
"""
import json
import os
import shutil
import sys
import textwrap
import warnings

import pytest
import torch
from conftest import two_nodes_on_loopback

import functrain as ft
from functrain import tree as T

sys.path.insert(0, os.path.dirname(__file__))
from test_trainer import _final, _run  # noqa: E402  (the trainer job's runner: same env, same timeouts)
from trainer_job import Model  # noqa: E402

STEPS = 8
MODES = ("optimizer", "params")
ARGS = ("--no-compile", "--save-every", 2)


def _max_err(a, b) -> float:
    """The largest difference between two states of one structure (their integer leaves must be equal)."""
    assert T.tree_structure(a) == T.tree_structure(b), "different structures"
    err = 0.0
    for x, y in zip(T.tree_leaves(a), T.tree_leaves(b)):
        if not torch.is_tensor(x):
            assert x == y
        elif x.is_floating_point():
            err = max(err, float((x.double() - y.double()).abs().max()) if x.numel() else 0.0)
        else:
            assert torch.equal(x, y), "integer leaves differ"
    return err


def _losses(results) -> list:
    return [json.loads(line)["loss"] for line in open(os.path.join(results, "metrics.jsonl"))]


@pytest.fixture(scope="module")
def replicated(tmp_path_factory):
    """The replicated 2-process run (shard="none"), uninterrupted, to STEPS."""
    results = tmp_path_factory.mktemp("replicated")
    _run(results, 2, "--steps", STEPS, *ARGS)
    return results, _final(results, STEPS)


@pytest.mark.parametrize("mode", MODES)
def test_sharded_trainer_equals_replicated_and_resumes_bit_exactly(tmp_path, replicated, mode):
    ref_results, reference = replicated
    whole = tmp_path / "whole"
    _run(whole, 2, "--steps", STEPS, "--shard", mode, *ARGS)
    final = _final(whole, STEPS)  # ft.load without a template: the whole (logical) state
    ckpt = ft.CheckpointManager(whole / "checkpoints").path(STEPS)
    assert sorted(os.listdir(ckpt)) == ["SHARDED.json", "rank_00000", "rank_00001"], "not one folder per rank"
    assert "data_parallel" not in final.slots
    err = _max_err(final, reference)
    assert err <= 1e-6, f"shard={mode!r}: the trained state differs from the replicated run by {err:.2e}"
    # the per-rank checkpoints hold shards: each rank's moments are about half of the whole
    shard0 = ft.checkpoint.folder.load(os.path.join(ckpt, "rank_00000"))
    moments = sum(t.numel() for t in T.tree_leaves(shard0.opt_state) if torch.is_tensor(t) and t.dim() == 1)
    whole_moments = sum(t.numel() for t in T.tree_leaves(final.opt_state) if torch.is_tensor(t) and t.dim() > 0)
    assert moments * 2 <= whole_moments + 64, (moments, whole_moments)
    # exported weights and sample grids come from the gathered state (rank 0 writes them)
    from safetensors.torch import load_file

    model = load_file(str(whole / "model.safetensors"))
    ema = load_file(str(whole / "ema.safetensors"))
    assert T.tree_equal(model, {k: v for k, v in final.params.items()}), "exported params are not the state's"
    assert T.tree_equal(ema, dict(final.ema)), "exported EMA is not the state's"
    assert (whole / f"sample-{STEPS}.png").exists()

    # stopped at a checkpoint (a run to STEPS / 2), then run again to STEPS: the uninterrupted run, bitwise
    stopped = tmp_path / "stopped"
    _run(stopped, 2, "--steps", STEPS // 2, "--shard", mode, *ARGS)
    out = _run(stopped, 2, "--steps", STEPS, "--shard", mode, *ARGS)
    assert f"at step {STEPS // 2}" in out.stdout and "resumed from" in out.stdout, out.stdout[-2000:]
    assert T.tree_equal(_final(stopped, STEPS), final), f"shard={mode!r}: the resumed run is not bit-exact"
    assert _losses(stopped) == _losses(whole)
    assert not [e for e in os.listdir(stopped / "checkpoints") if e.startswith(".")], "leftover folders"

    # the 2-rank checkpoint resumes on 1 process (sharded over 1 rank, or replicated) to the same logical state
    half = ft.CheckpointManager(stopped / "checkpoints").path(STEPS // 2)
    logical = ft.load(half)
    for shard in (mode, "none"):
        one = tmp_path / f"one-{shard}"
        shutil.copytree(half, one / "checkpoints" / os.path.basename(half))
        trainer = _trainer(one, shard)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the changed config (shard, the step count)
            restored = trainer.restore()
        assert ft.distributed.world_size() == 1
        assert T.tree_equal(ft.gather_state(restored), logical), f"{shard}: resharded resume changed the state"
        position = {k: v for k, v in trainer.loader.state_dict().items() if k != "world_size"}
        saved = ft.load_extra(half)["data"]
        assert saved["world_size"] == 2 and position == {k: v for k, v in saved.items() if k != "world_size"}


def _trainer(results, shard, marked=False):
    """The trainer job's trainer, in this process (one process); ``marked``: its first layer marked with ft.remat."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(72, 6, generator=g)
    data = torch.utils.data.TensorDataset(x, x.flip(1) * 0.5)
    torch.manual_seed(0)
    config = ft.TrainConfig(train_batch_size=4, gradient_accumulate_every=2, train_lr=3e-3, train_num_steps=STEPS,
                            ema_update_every=2, ema_decay=0.9, ema_update_after_step=0, save_and_sample_every=2,
                            num_samples=4,
                            mixed_precision="fp16", results_folder=str(results), seed=3, log_every=1,
                            keep_checkpoints=100, compile=False, shard=shard)
    model = Model()
    if marked:
        ft.remat(model.net[0])
    return ft.Trainer(model, data, config)


def test_shard_config_is_checked_and_reaches_the_step():
    with pytest.raises(ValueError, match=r"TrainConfig.shard must be one of \('none', 'optimizer', 'params'\)"):
        ft.TrainConfig(shard="zero3")
    from functrain.trainer.build import build_step

    loss = lambda p, b, batch: (p["w"] * batch).sum()  # noqa: E731
    for shard in MODES:
        step, _ = build_step(loss, ft.TrainConfig(shard=shard, train_num_steps=10), world=1)
        assert [t for t in step.transforms if t.name == "data_parallel"][0].shard == shard
        state = step.init({"w": torch.ones(3)})
        assert ft.checkpoint.per_rank.is_sharded(state)
    plain, _ = build_step(loss, ft.TrainConfig(train_num_steps=10), world=1)
    assert not [t for t in plain.transforms if t.name == "data_parallel"]
    ready = ft.data_parallel(shard="params")(ft.train_step(loss, ft.optim.adamw(1e-3)))
    with pytest.raises(ValueError, match="shard='params'.*TrainConfig.shard='optimizer'"):
        build_step(loss, ft.TrainConfig(shard="optimizer", train_num_steps=10), world=1, step=ready)
    build_step(loss, ft.TrainConfig(train_num_steps=10), world=1, step=ready)  # the default leaves it to the step

    # shard="params" with a module whose blocks are marked: gathered block by block; without marks, whole
    model = Model()
    dp = lambda s: [t for t in s.transforms if t.name == "data_parallel"][0]  # noqa: E731
    assert dp(build_step(loss, ft.TrainConfig(shard="params", train_num_steps=10), 1, module=model)[0]).blocks is None
    ft.remat(model.net[0])
    for shard, blocks in (("params", model), ("optimizer", None)):
        got = dp(build_step(loss, ft.TrainConfig(shard=shard, train_num_steps=10), 1, module=model)[0])
        assert got.blocks is blocks, (shard, got)


def test_trainer_gathers_marked_blocks_one_at_a_time(tmp_path):
    """A Trainer on a model with marked blocks and shard="params" trains as the one without marks (one process)."""
    finals = []
    for marked in (False, True):
        trainer = _trainer(tmp_path / str(marked), "params", marked=marked)
        assert (trainer.step.transforms[-1].blocks is trainer.module) is marked
        trainer.train()
        finals.append(ft.gather_state(trainer.state))
    assert _max_err(*finals) <= 1e-6


# -------------------------------------------------------------------------- CheckpointManager, 2 ranks
def _state(mode, seed, wide=False):
    g = torch.Generator().manual_seed(seed)
    params = {"w": torch.randn(5, 3 if not wide else 4, generator=g), "b": torch.randn(3, generator=g)}
    step = ft.data_parallel(shard=mode)(ft.ema(0.9, warmup=False)(ft.train_step(lambda p, b, x: (p["b"] * x).sum(),
                                                                   ft.optim.adamw(1e-3))))
    return step, step.init(params)


def _manager_worker(root):
    import torch.distributed as dist

    rank = dist.get_rank()
    out = {}
    for mode in MODES:
        folder = os.path.join(root, mode)
        manager = ft.CheckpointManager(folder, keep=2)
        step, state = _state(mode, 0)
        saved = {}
        for n in range(1, 5):
            state, _ = step(state, torch.ones(3))
            finite = not (n == 4 and rank == 1)  # one rank's shard "non-finite" at step 4: the mark says so
            manager.save(n, state, extra={"n": n}, finite=finite)
            saved[n] = ft.gather_state(state)
        dist.barrier()
        # every rank sees the rotation rank 0 did (after the checkpoint was complete); step 3 is kept, the
        # newest finite one
        restored = manager.load_latest(template=step.init({"w": torch.zeros(5, 3), "b": torch.zeros(3)}))
        other = _state(mode, 1, wide=True)[0].init({"w": torch.zeros(5, 4), "b": torch.zeros(3)})
        try:
            manager.load_latest(template=other)
            mismatch = None
        except ft.checkpoint.StructureMismatch as e:
            mismatch = str(e)
        out[mode] = {"steps": manager.steps(), "newest_finite": manager.newest_finite(),
                     "restored_step": restored.step, "extra": restored.extra,
                     "exact": T.tree_equal(ft.gather_state(restored.state), saved[4]),
                     "mismatch": mismatch, "leftovers": [e for e in os.listdir(folder) if e.startswith(".")]}
    return out


def test_manager_saves_rotates_and_loads_sharded_states(tmp_path):
    root = str(tmp_path)
    reports = ft.launch(_manager_worker, nprocs=2, args=(root,), timeout=300)
    for mode in MODES:
        for r in (x[mode] for x in reports):
            assert r["steps"] == [3, 4], r  # keep=2 ...
            assert r["newest_finite"] == 3, r  # ... one non-finite shard makes the whole checkpoint non-finite
            assert r["restored_step"] == 4 and r["extra"] == {"n": 4} and r["exact"], r
            assert r["mismatch"] and "does not match" in r["mismatch"], r  # another model: refused, no fallback
            assert r["leftovers"] == [], r
        folder = os.path.join(root, mode)
        manager = ft.CheckpointManager(folder, keep=2)
        # one process reads the 2-rank checkpoints: whole, or into a 1-rank sharded template
        step, _ = _state(mode, 0)
        one = manager.load_latest(template=step.init({"w": torch.zeros(5, 3), "b": torch.zeros(3)}))
        assert T.tree_equal(ft.gather_state(one.state), ft.load(manager.path(4)))
        # a damaged shard in the newest: a warning naming it, then the previous checkpoint
        victim = os.path.join(manager.path(4), "rank_00001")
        tensors = [f for f in os.listdir(victim) if f.endswith(".safetensors")][0]
        with open(os.path.join(victim, tensors), "r+b") as f:
            f.seek(-4, os.SEEK_END)
            f.write(b"\xff\xff\xff\xff")
        with pytest.warns(RuntimeWarning, match="skipping checkpoint .*step_00000004"):
            fallback = manager.load_latest(template=step.init({"w": torch.zeros(5, 3), "b": torch.zeros(3)}))
        assert fallback.step == 3


# -------------------------------------------------------------------------- 2 nodes on loopback
NODE = textwrap.dedent("""
    import sys, torch, functrain as ft

    sys.path[:0] = [{tests!r}, {helpers!r}]  # this test's folder, and tests/ (conftest)
    from test_trainer_sharded import _node_problem

    info = ft.distributed.init()
    for mode in ("optimizer", "params"):
        step, params, batch = _node_problem()
        step = ft.data_parallel(shard=mode)(step)
        if info.rank:
            params = {{k: v + 1.0 for k, v in params.items()}}  # rank 0's start is broadcast
        state = step.init(params)
        rows = batch[0].shape[0] // info.world_size
        mine = tuple(t[info.rank * rows:(info.rank + 1) * rows] for t in batch)
        for _ in range(3):
            state, _ = step(state, mine)
        ft.save(f"{{sys.argv[1]}}/{{mode}}-{{info.rank}}", ft.gather_state(state))
""")


def _node_problem():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    apply_fn, params, _ = ft.functionalize(model)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 4, generator=g), torch.randn(8, 3, generator=g)

    def loss_fn(params, buffers, batch):
        return torch.nn.functional.mse_loss(apply_fn(params, buffers, batch[0]), batch[1])

    step = ft.ema(0.5, warmup=False)(ft.clip(0.05)(ft.train_step(loss_fn, ft.optim.adamw(1e-2))))
    return step, params, (x, y)


def test_sharded_step_on_two_nodes_on_loopback(tmp_path):
    script = tmp_path / "node.py"
    here = os.path.dirname(os.path.abspath(__file__))
    script.write_text(NODE.format(tests=here, helpers=os.path.dirname(here)))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    for returncode, out, err in two_nodes_on_loopback(script, tmp_path, env, 180, tmp_path):
        assert returncode == 0, out[-3000:] + err[-3000:]
    step, params, batch = _node_problem()
    reference = step.init(params)
    for _ in range(3):
        reference, _ = step(reference, batch)
    for mode in MODES:
        node0, node1 = ft.load(str(tmp_path / f"{mode}-0")), ft.load(str(tmp_path / f"{mode}-1"))
        assert T.tree_equal(node0.params, node1.params), f"{mode}: the nodes' gathered params differ"
        err = _max_err(node0, reference)
        assert err <= 1e-6, f"shard={mode!r} on 2 nodes differs from one process on the whole batch by {err:.2e}"
