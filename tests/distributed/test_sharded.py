"""data_parallel(shard="optimizer" | "params"): 2 real processes over gloo equal one process on the whole batch;
sharded checkpoints save per rank and load on 1 or 2 ranks to the same logical state."""
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from conftest import kill_when_running

import functrain as ft
from functrain import tree as T
from functrain.checkpoint import folder as ckpt_folder
from functrain.core.flat import FlatLayout

MODES = ("optimizer", "params")
CONFIGS = ["plain", "two_dtypes", "accumulate", "clip", "ema", "fp16_overflow", "fp16_shard_overflow", "num_items",
           "all"]
MAX_NORM = {"clip": 0.05, "num_items": 0.5, "all": 0.05}
INIT_SCALE = {"fp16_overflow": 2.0 ** 16, "fp16_shard_overflow": 1024.0}


def _problem(config: str, rank: int, micro: int = 2):
    """A tiny model (67 params: odd, so the last shard is padded) and a batch of 8 rows.

    ``micro``: the accumulation factor; the one-process reference accumulates over world x as many
    micro-batches, so that both see the same micro-batches (fp16 rounding depends on the grouping).
    """
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    apply_fn, params, buffers = ft.functionalize(model)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 4, generator=g), torch.randn(8, 3, generator=g)
    mse = lambda params, buffers, batch: torch.nn.functional.mse_loss(  # noqa: E731
        apply_fn(params, buffers, batch[0]), batch[1])
    loss_fn, batch = mse, (x, y)
    if config == "num_items":
        # rank 0's half has 9 valid targets, rank 1's half 3: a mean of rank means would be wrong
        mask = torch.zeros(8, 3)
        mask[:4].view(-1)[:9] = 1
        mask[4:].view(-1)[:3] = 1

        def items_loss(params, buffers, batch):
            x, y, m = batch
            return ((apply_fn(params, buffers, x) - y) ** 2 * m).sum(), {"num_items": m.sum()}

        loss_fn, batch = items_loss, (x, y, mask)
    elif config == "two_dtypes":  # one float64 parameter: a second flat buffer
        params = {**params, "scale": torch.full((3,), 1.5, dtype=torch.float64)}

        def scaled_loss(params, buffers, batch):
            out = apply_fn({k: v for k, v in params.items() if k != "scale"}, buffers, batch[0])
            return torch.nn.functional.mse_loss(out * params["scale"].float(), batch[1])

        loss_fn = scaled_loss
    elif config == "fp16_overflow":
        x[6, 0] = 1e30  # in rank 1's half only: inf in fp16
    elif config == "fp16_shard_overflow":
        # A finite loss whose gradient overflows fp16 in ONE element, 0.bias[0], driven by rank 1's rows only and
        # held by rank 0's shard only (_overflow_owners): after the reduce-scatter only rank 0's shard has the
        # inf, so a finite check local to the shard would skip on rank 0 alone.
        c = torch.zeros(8)
        c[4:] = 1e3

        def overflow_loss(params, buffers, batch):
            x, y, c = batch
            return mse(params, buffers, (x, y)) + (params["0.bias"][0].float() * c.float()).mean()

        loss_fn, batch = overflow_loss, (x, y, c)
    transforms = {
        "plain": [], "two_dtypes": [], "accumulate": [ft.accumulate(micro)], "clip": [ft.clip(MAX_NORM["clip"])],
        "ema": [ft.ema(0.5, warmup=False)], "fp16_overflow": [ft.mixed_precision("fp16", init_scale=INIT_SCALE["fp16_overflow"]), ft.ema(0.5, warmup=False)],
        "fp16_shard_overflow": [ft.mixed_precision("fp16", init_scale=INIT_SCALE["fp16_shard_overflow"]), ft.ema(0.5, warmup=False)],
        "num_items": [ft.accumulate(micro), ft.clip(MAX_NORM["num_items"])],
        "all": [ft.accumulate(micro), ft.clip(MAX_NORM["all"]), ft.ema(0.5, warmup=False), ft.mixed_precision("fp16", init_scale=256.0)],
    }[config]
    step = ft.train_step(loss_fn, ft.optim.adamw(1e-2))
    for t in transforms:
        step = t(step)
    if rank:  # rank 1 starts from other weights: the sharded init must broadcast rank 0's
        params = {k: v + 1.0 for k, v in params.items()}
    return step, params, buffers, batch


def _nbytes(tree) -> int:
    return sum(t.numel() * t.element_size() for t in T.tree_leaves(tree) if torch.is_tensor(t))


def _my_rows(batch, rank, world):
    rows = batch[0].shape[0] // world
    return tuple(t[rank * rows:(rank + 1) * rows] for t in batch)


def _overflow_owners(params, world):
    """The ranks whose shard holds 0.bias[0] (the element fp16_shard_overflow makes overflow)."""
    marker = {k: torch.zeros_like(v) for k, v in params.items()}
    marker["0.bias"][0] = 1.0
    return [r for r in range(world) if any(s.any() for s in FlatLayout.from_params(marker, world, r)
                                           .shard_of(marker).values())]


class _Collectives:
    """A compile backend that notes the functional collectives of each graph (op name, input numel), then
    hands the graph to the real backend."""

    def __init__(self, backend: str):
        from torch._dynamo.backends.registry import lookup_backend

        self.backend, self.graphs = lookup_backend(backend), []

    def __call__(self, gm, example_inputs):
        ops = []
        for n in gm.graph.nodes:
            name = str(n.target)
            if n.op == "call_function" and "c10d_functional" in name and "wait_tensor" not in name:
                ops.append((name.split(".")[-2], n.args[0].meta["val"].numel()))
        self.graphs.append(ops)
        return self.backend(gm, example_inputs)


def _law_worker(modes, configs, backend):
    """Each config's one-process reference (compiled with the same backend, as the sharded step: inductor's
    fp16 rounding differs from eager's), then the sharded step in each mode from the same start."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    report = {}
    for config in configs:
        ref_step, ref_params, ref_buffers, batch = _problem(config, 0, micro=2 * world)
        reference = ref_step.init(ref_params, ref_buffers)
        ref_run = ft.compile(ref_step, backend=backend) if backend else ref_step
        for _ in range(3):
            reference, ref_metrics = ref_run(reference, batch)
        for mode in modes:
            step, params, buffers, _ = _problem(config, rank)
            sharded = ft.data_parallel(shard=mode)(step)
            state = sharded.init(params, buffers)
            recorder = _Collectives(backend) if backend == "aot_eager" else None
            run = ft.compile(sharded, backend=recorder or backend) if backend else sharded
            for _ in range(3):
                state, metrics = run(state, _my_rows(batch, rank, world))
            full = ft.gather_state(state)
            same_structure = T.tree_structure(full) == T.tree_structure(reference)
            err = max(float((a.double() - b.double()).abs().max()) for a, b in
                      zip(T.tree_leaves(full), T.tree_leaves(reference)) if a.is_floating_point())
            ints_equal = all(torch.equal(a, b) for a, b in zip(T.tree_leaves(full), T.tree_leaves(reference))
                             if not a.is_floating_point())
            flat = torch.cat([p.reshape(-1).double() for p in T.tree_leaves(full.params)])
            gathered = [torch.empty_like(flat) for _ in range(world)]
            dist.all_gather(gathered, flat)
            # the moments' shards (the 1-D leaves; the hyper-parameters, one small replicated vector, aside)
            moments = [x for x in T.tree_leaves(state.opt_state._replace(hyper=None)) if x.dim() == 1]
            report[(mode, config)] = {
                "same_structure": same_structure, "err": err, "ints_equal": ints_equal,
                "exact": T.tree_equal(full.params, reference.params) and T.tree_equal(full.ema, reference.ema),
                "ranks_identical": all(torch.equal(gathered[0], g) for g in gathered),
                "loss": (float(metrics["loss"]), float(ref_metrics["loss"])),
                "skipped": bool(metrics.get("skipped", False)),
                "scale": float(state.loss_scale.scale) if state.loss_scale is not None else None,
                "compiles": getattr(run, "compiles", None),
                "moment_bytes": (_nbytes(moments), _nbytes(reference.opt_state.exp_avg) * 2),
                "param_bytes": (_nbytes(state.params), _nbytes(reference.params)),
                "ema_bytes": (_nbytes(state.ema), _nbytes(reference.ema)),
                "grad_norm": (float(metrics.get("grad_norm", float("nan"))),
                              float(ref_metrics.get("grad_norm", float("nan")))),
                "overflow_owners": _overflow_owners(params, world),
                "graphs": recorder.graphs if recorder else None,
                "flat_size": world * FlatLayout.from_params(params, world, rank).size["float32"],
                "micro": next((t.n for t in step.transforms if t.name == "accumulate"), 1),
                "backend": dist.get_backend(),
            }
    return report


def _check(report, compiled: bool):
    tol = 1e-5 if compiled else 1e-6
    for (mode, config), r in report.items():
        what = f"shard={mode!r} {config}"
        assert r["same_structure"], f"{what}: gather_state's structure is not the unsharded state's"
        assert r["ranks_identical"], f"{what}: gathered params differ between ranks"
        assert r["ints_equal"], f"{what}: counters differ from one process"
        assert r["err"] <= tol, f"{what}: sharded state differs from one process by {r['err']:.2e}"
        assert abs(r["loss"][0] - r["loss"][1]) <= tol * max(1.0, abs(r["loss"][1])), f"{what}: loss {r['loss']}"
        mine, whole = r["moment_bytes"]
        assert mine * 2 <= whole + 64, f"{what}: optimizer moments per rank {mine} B of {whole} B: not sharded"
        if r["ema_bytes"][1]:
            assert r["ema_bytes"][0] * 2 <= r["ema_bytes"][1] + 32, f"{what}: EMA not sharded {r['ema_bytes']}"
        if mode == "params":
            assert r["param_bytes"][0] * 2 <= r["param_bytes"][1] + 32, f"{what}: params {r['param_bytes']}"
        else:
            assert r["param_bytes"][0] == r["param_bytes"][1], f"{what}: params {r['param_bytes']}"
        if compiled:
            assert r["compiles"] == 1, f"{what}: {r['compiles']} graphs over 3 steps"
        if config in ("fp16_overflow", "fp16_shard_overflow"):  # an overflow on one rank: every rank skips
            assert r["skipped"] and r["scale"] == INIT_SCALE[config] * 0.5 ** 3, (what, r)
            assert r["exact"], f"{what}: skipped steps must leave params and EMA bitwise unchanged"
        if config == "fp16_shard_overflow":  # the overflowing element lies in rank 0's shard only
            assert r["overflow_owners"] == [0], (what, r["overflow_owners"])
        if config in MAX_NORM:  # the global norm, summed over the shards, on every rank
            norm, ref_norm = r["grad_norm"]
            assert abs(norm - ref_norm) <= tol * max(1.0, ref_norm), f"{what}: grad_norm {norm} vs {ref_norm}"
        if config in ("clip", "all"):  # clipping happened: a norm local to each shard would be wrong
            assert r["grad_norm"][1] > 2 * MAX_NORM[config], (what, r["grad_norm"])
        if r["graphs"] is not None:
            _check_collectives(what, r, mode)


def _check_collectives(what, r, mode):
    """The compiled sharded step's one graph reduce-scatters the gradient (one float32 buffer) and all-reduces
    nothing of its size except, on gloo, the param all-gathers (done there as a sum with -0.0: see sharded.py)."""
    (ops,) = r["graphs"]
    scatters = [n for op, n in ops if op.startswith("reduce_scatter")]
    assert scatters == [r["flat_size"]], f"{what}: reduce-scatters {scatters} in the graph {ops}"
    gathers = 1 if mode == "optimizer" else r["micro"]  # after the EMA / before each micro-batch's forward
    big = [n for op, n in ops if op.startswith("all_reduce") and n >= r["flat_size"]]
    if r["backend"] == "gloo":
        assert big == [r["flat_size"]] * gathers, f"{what}: gradient-sized all-reduces {big} in the graph {ops}"
    else:
        assert not big and sum(op.startswith("all_gather") for op, _ in ops) == gathers, (what, ops)


# -------------------------------------------------------------------------- checkpoints
def _ckpt_worker(root):
    """Save a sharded state on 2 ranks; reload on the same 2 ranks (bit-exact resume, and across modes)."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for mode in MODES:
        step, params, buffers, batch = _problem("all", rank)
        sharded = ft.data_parallel(shard=mode)(step)
        mine = _my_rows(batch, rank, world)
        state = sharded.init(params, buffers)
        for _ in range(2):
            state, _ = sharded(state, mine)
        path = os.path.join(root, mode)
        ft.save(path, state, extra={"mode": mode})
        ft.save(path, state, extra={"mode": mode})  # replacing a sharded checkpoint works too
        logical = ft.gather_state(state)
        uninterrupted = state
        for _ in range(2):
            uninterrupted, _ = sharded(uninterrupted, mine)
        # resume: a fresh step object and template, as a new job would
        again = ft.data_parallel(shard=mode)(_problem("all", rank)[0])
        resumed = ft.load(path, again.init(params, buffers))
        loaded_exact = T.tree_equal(resumed, state)
        for _ in range(2):
            resumed, _ = again(resumed, mine)
        other = "params" if mode == "optimizer" else "optimizer"
        across = ft.data_parallel(shard=other)(_problem("all", rank)[0])
        converted = ft.load(path, across.init(params, buffers))
        out[mode] = {
            "loaded_exact": loaded_exact,
            "resume_exact": T.tree_equal(resumed, uninterrupted),
            "across_modes_exact": T.tree_equal(ft.gather_state(converted), logical),
            "logical": ft.save(os.path.join(root, f"logical-{mode}-{rank}"), logical),  # tensors by file
            "extra": ft.load_extra(path),
        }
    return out


def test_layout_shards_and_joins_any_tree():
    """Cutting a params tree for W ranks and joining the W shards gives it back bitwise, for any world size,
    dtypes and shapes (0-dim and empty leaves too); shards are equal-sized and padded with zeros."""

    shapes = st.lists(st.tuples(st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
                                st.lists(st.integers(0, 4), max_size=3)), min_size=1, max_size=6)

    @settings(max_examples=60, deadline=None)
    @given(shapes, st.integers(1, 5), st.integers(0, 2**31 - 1))
    def law(specs, world, seed):
        g = torch.Generator().manual_seed(seed)
        tree = {f"p{i}": torch.randn(shape, generator=g).to(dtype) for i, (dtype, shape) in enumerate(specs)}
        layouts = [FlatLayout.from_params(tree, world, r) for r in range(world)]
        shards = [lay.shard_of(tree, copy=True) for lay in layouts]
        for k in layouts[0].keys:
            assert {tuple(s[k].shape) for s in shards} == {(layouts[0].size[k],)}
            joined = torch.cat([s[k] for s in shards])
            assert not joined[layouts[0].numel[k]:].any(), "padding must be zeros"
        back = layouts[0].tree({k: torch.cat([s[k] for s in shards]) for k in layouts[0].keys})
        assert T.tree_equal(back, tree)
        assert all(lay.is_shard_tree(s) for lay, s in zip(layouts, shards))
        assert layouts[0].is_params_like(tree) and not layouts[0].is_params_like(shards[0])
        slot = layouts[-1].slot(params_sharded=True)
        again = FlatLayout.from_slot(slot)
        assert again.same_params(layouts[0]) and (again.world, again.rank) == (world, world - 1)

    law()


def test_sharded_equals_one_process_eager_and_checkpoints(tmp_path):
    root = str(tmp_path / "ckpt")

    reports = ft.launch(_both_worker, nprocs=2, args=(MODES, CONFIGS, None, root), timeout=300)
    for law, _ in reports:
        _check(law, compiled=False)
    ckpts = [c for _, c in reports]
    for mode in MODES:
        for r in ckpts:
            assert r[mode]["loaded_exact"], f"{mode}: the loaded state is not the saved one bitwise"
            assert r[mode]["resume_exact"], f"{mode}: resumed run differs from the uninterrupted one"
            assert r[mode]["across_modes_exact"], f"{mode}: loading into the other sharding changed the state"
            assert r[mode]["extra"] == {"mode": mode}
        logical = ft.load(ckpts[0][mode]["logical"])
        assert T.tree_equal(logical, ft.load(ckpts[1][mode]["logical"])), "ranks gathered different states"
        path = os.path.join(root, mode)
        assert sorted(os.listdir(path)) == ["SHARDED.json", "rank_00000", "rank_00001"]
        assert not [e for e in os.listdir(root) if e.startswith(".")], "leftover temporary folders"
        assert ft.load_extra(path) == {"mode": mode}

        # 2 ranks saved -> 1 process loads: without a template, into the unsharded step, into a 1-rank sharded step
        step, params, buffers, batch = _problem("all", 0)
        assert T.tree_equal(ft.load(path), logical)
        plain = ft.load(path, step.init(params, buffers))
        assert T.tree_equal(plain, logical)
        one = ft.data_parallel(shard=mode)(step)
        loaded = ft.load(path, one.init(params, buffers))
        assert T.tree_equal(ft.gather_state(loaded), logical)
        # ... and both continue identically on the whole batch
        a, _ = step(plain, batch)
        b, _ = one(loaded, batch)
        b = ft.gather_state(b)
        assert max(float((x - y).abs().max()) for x, y in zip(T.tree_leaves(a), T.tree_leaves(b))
                   if x.is_floating_point()) <= 1e-6

        # clear errors: a rank's raw shard (cut for 2 ranks) in a 1-rank step, outside its group, in a plain step
        raw = ckpt_folder.load(os.path.join(path, "rank_00001"))
        with pytest.raises(ValueError, match="another world size"):
            one(raw, batch)
        with pytest.raises(RuntimeError, match="sharded over 2 ranks"):
            ft.gather_state(raw)
        with pytest.raises(ValueError, match="is not a sharded data_parallel step"):
            step(loaded, batch)
        with pytest.raises(ValueError, match="is not a sharded data_parallel step"):
            ft.data_parallel()(step)(loaded, batch)
        with pytest.raises(ValueError, match="not sharded"):
            one(plain, batch)
        other = ft.data_parallel(shard="params" if mode == "optimizer" else "optimizer")(step)
        other.init(params, buffers)
        with pytest.raises(ValueError, match="shard="):
            other(loaded, batch)
        with pytest.raises(RuntimeError, match="every rank"):
            ft.save(str(tmp_path / "alone"), raw)


def _both_worker(modes, configs, backend, root):
    return _law_worker(modes, configs, backend), _ckpt_worker(root)


def test_sharded_equals_one_process_compiled():
    # aot_eager: the whole step (all-reduce and all-gathers included) as one graph, quickly
    reports = ft.launch(_law_worker, nprocs=2, args=(MODES, [c for c in CONFIGS if c != "two_dtypes"],
                                                     "aot_eager"), timeout=600)
    for report in reports:
        _check(report, compiled=True)


def test_sharded_inductor_all_transforms():
    reports = ft.launch(_law_worker, nprocs=2, args=(MODES, ["all"], "inductor"), timeout=600)
    for report in reports:
        _check(report, compiled=True)


def test_shard_argument_is_checked():
    with pytest.raises(ValueError, match="shard must be one of"):
        ft.data_parallel(shard="zero3")


# -------------------------------------------------------------------------- SIGKILL during sharded saves
KILL_CHILD = """
import sys
sys.path.insert(0, {root!r})
import torch
import functrain as ft

def make(step_no):
    g = torch.Generator().manual_seed(step_no % 3)
    params = {{"w": torch.randn(1024, 1024, generator=g), "b": torch.randn(1024, generator=g)}}
    step = ft.data_parallel(shard="params")(ft.ema(0.9, warmup=False)(ft.train_step(lambda p, b, x: (p["b"] * x).sum(),
                                                                       ft.optim.adamw(1e-3))))
    return step.init(params)._replace(step=torch.tensor(step_no))

if __name__ == "__main__":
    path, start = sys.argv[1], int(sys.argv[2])
    print("ready", flush=True)
    n = start
    while True:
        ft.save(path, make(n), extra={{"step": n}})
        print("saved", n, flush=True)
        n += 1
"""


def test_sigkill_during_sharded_saves_leaves_a_complete_checkpoint(tmp_path):
    import random
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = KILL_CHILD.format(root=root)
    script = tmp_path / "child.py"
    script.write_text(code)
    scope: dict = {}
    exec(code.split("if __name__")[0], scope)
    make = scope["make"]
    path = str(tmp_path / "ckpt")
    ft.save(path, make(0), extra={"step": 0})
    rng = random.Random(7)
    start, leftovers_seen = 1, 0
    for _ in range(6):
        _, lines = kill_when_running([sys.executable, str(script), path, str(start)], rng.uniform(0.0, 1.0))
        leftovers_seen += any(e.startswith(".") for e in os.listdir(tmp_path))
        saved = [int(x[1]) for x in lines if x[0] == "saved"]
        n = ft.load_extra(path)["step"]
        assert n >= max(saved, default=0)
        assert T.tree_equal(ft.load(path), ft.gather_state(make(n))), f"checkpoint of step {n} is not its state"
        start = n + 1
    ft.save(path, make(start), extra={"step": start})  # the next save cleans what the killed ones left
    assert not [e for e in os.listdir(tmp_path) if e.startswith(".")]
    print(f"{leftovers_seen} of 6 kills left a temporary folder")


def test_per_parameter_groups_are_refused_by_a_sharded_step():
    # the update runs on flat per-dtype shards: a name-based mask would silently apply to nothing
    loss = lambda p, b, x: (p["w"] * x).sum() + p["b"].sum()  # noqa: E731
    masked = ft.optim.adamw(1e-3, weight_decay=0.1, weight_decay_mask=lambda name, p: p.ndim > 1)
    for shard in ("optimizer", "params"):
        with pytest.raises(ValueError, match="weight_decay_mask"):
            ft.data_parallel(shard=shard)(ft.train_step(loss, masked))
        ft.data_parallel(shard=shard)(ft.train_step(loss, ft.optim.adamw(1e-3, weight_decay=0.1)))  # no groups: fine
    assert masked.per_param and not ft.optim.adamw(1e-3).per_param
    assert ft.optim.sgd(0.1, lr_multipliers=lambda name, p: 2.0).per_param
