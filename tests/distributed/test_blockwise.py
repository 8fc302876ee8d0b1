"""data_parallel(shard="params", blocks=model): each ft.remat-marked block gathers its parameters when it runs.

Laws: on 1 process and on 2 real processes over gloo, the per-block step equals the one-process unsharded step on
the whole batch (to float rounding), with every transform, eager and compiled; the gathered params are bitwise
identical on every rank; the compiled graph never gathers more than one block (or the parameters outside the
blocks) at a time, and reduce-scatters nothing; a checkpoint resumes bit-exactly and loads into the
whole-gather step (the state's layout is the same)."""
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import functrain as ft
from conftest import blockwise_problem
from functrain import tree as T

CONFIGS = ("plain", "accumulate", "clip", "ema", "fp16", "all")
POLICIES = ("nothing_saveable", "everything_saveable", "dots_saveable")


def _err(a, b) -> float:
    return max(float((x.double() - y.double()).abs().max()) for x, y in zip(T.tree_leaves(a), T.tree_leaves(b))
               if x.is_floating_point() and x.numel())


def test_one_process_law():
    """On one process (no group: the gather is the concatenation), for random depths, marks and policies, the
    per-block step equals the unsharded step, eagerly, with accumulation and clipping."""

    @settings(max_examples=12, deadline=None)
    @given(st.integers(1, 4), st.lists(st.sampled_from(POLICIES + (None,)), min_size=4, max_size=4),
           st.sampled_from(("plain", "accumulate", "clip")), st.integers(0, 1000))
    def law(depth, policies, config, seed):
        if all(p is None for p in policies[:depth]):
            policies = ["nothing_saveable"] + policies[1:]
        model, step, params, buffers, batch = blockwise_problem(config, policies, depth=depth, seed=seed)
        blockwise = ft.data_parallel(shard="params", blocks=model)(step)
        ref, state = step.init(params, buffers), blockwise.init(params, buffers)
        for _ in range(2):
            ref, ref_m = step(ref, batch)
            state, m = blockwise(state, batch)
        full = ft.gather_state(state)
        assert T.tree_structure(full) == T.tree_structure(ref)
        assert _err(full, ref) <= 1e-6, (depth, policies, config)
        assert abs(float(m["loss"]) - float(ref_m["loss"])) <= 1e-6

    law()


def test_empty_parameters_in_blocks():
    """A block holding an empty parameter (zero elements: no run of the buffer) gets it, empty, with the rest."""

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.empty = torch.nn.Parameter(torch.zeros(0))
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            return torch.tanh(self.lin(x)) + self.empty.sum()

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), Block(), Block(), torch.nn.Linear(4, 1))
    ft.remat([model[1], model[2]])
    apply_fn, params, buffers = ft.functionalize(model)
    step = ft.train_step(lambda p, b, x: apply_fn(p, b, x).square().mean(), ft.optim.adamw(1e-2))
    blockwise = ft.data_parallel(shard="params", blocks=model)(step)
    x = torch.randn(8, 3)
    ref, state = step.init(params, buffers), blockwise.init(params, buffers)
    for _ in range(2):
        ref, _ = step(ref, x)
        state, _ = blockwise(state, x)
    assert _err(ft.gather_state(state).params, ref.params) <= 1e-6


class _Collectives:
    """A compile backend noting each graph's functional collectives (op, input numel)."""

    def __init__(self):
        from torch._dynamo.backends.registry import lookup_backend

        self.backend, self.graphs = lookup_backend("aot_eager"), []

    def __call__(self, gm, example_inputs):
        self.graphs.append([(str(n.target).split(".")[-2], n.args[0].meta["val"].numel()) for n in gm.graph.nodes
                            if n.op == "call_function" and ("c10d_functional" in str(n.target)
                                                            and "wait_tensor" not in str(n.target)
                                                            or str(n.target) in ("aten.addmm.default",
                                                                                 "aten.mm.default"))])
        return self.backend(gm, example_inputs)


def _law_worker(backend, root):
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    report = {}
    for config in CONFIGS if backend != "inductor" else ("all",):
        _, ref_step, params, buffers, batch = blockwise_problem(config, micro=2 * world)
        ref_run = ft.compile(ref_step, backend=backend) if backend else ref_step
        reference = ref_step.init(params, buffers)
        model, step, params, buffers, _ = blockwise_problem(config)
        if rank:  # rank 1 starts from other weights: init must take rank 0's
            params = {k: v + 1.0 for k, v in params.items()}
        blockwise = ft.data_parallel(shard="params", blocks=model)(step)
        recorder = _Collectives() if backend == "aot_eager" else None
        run = ft.compile(blockwise, backend=recorder or backend) if backend else blockwise
        state = blockwise.init(params, buffers)
        rows = slice(rank * 8 // world, (rank + 1) * 8 // world)
        mine = tuple(t[rows] for t in batch)
        for _ in range(3):
            reference, ref_m = ref_run(reference, batch)
            state, m = run(state, mine)
        full = ft.gather_state(state)
        flat = torch.cat([p.reshape(-1).double() for p in T.tree_leaves(full.params)])
        gathered = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(gathered, flat)
        r = {"err": _err(full, reference), "same_structure": T.tree_structure(full) == T.tree_structure(reference),
             "ranks_identical": all(torch.equal(gathered[0], g) for g in gathered),
             "loss": (float(m["loss"]), float(ref_m["loss"])),
             "param_elems": (sum(t.numel() for t in T.tree_leaves(state.params)),
                             sum(t.numel() for t in T.tree_leaves(reference.params))),
             "graphs": recorder.graphs if recorder else None, "compiles": getattr(run, "compiles", None),
             "micro": step.micro_batches,
             "sizes": {"rest": sum(v.numel() for k, v in params.items() if not k.startswith("blocks.")),
                       "block": max(sum(v.numel() for k, v in params.items() if k.startswith(f"blocks.{i}."))
                                    for i in range(3)),
                       "all": sum(v.numel() for v in params.values())}}
        if config == "all" and backend is None:  # resume bit-exactly, and into the whole-gather step
            path = os.path.join(root, "ckpt")
            ft.save(path, state)
            uninterrupted = state
            for _ in range(2):
                uninterrupted, _ = run(uninterrupted, mine)
            model2, step2, params2, buffers2, _ = blockwise_problem(config)
            again = ft.data_parallel(shard="params", blocks=model2)(step2)
            resumed = ft.load(path, again.init(params2, buffers2))
            r["loaded_exact"] = T.tree_equal(resumed, state)
            for _ in range(2):
                resumed, _ = again(resumed, mine)
            r["resume_exact"] = T.tree_equal(resumed, uninterrupted)
            whole = ft.data_parallel(shard="params")(blockwise_problem(config)[1])
            r["whole_exact"] = T.tree_equal(ft.load(path, whole.init(params2, buffers2)), state)
        report[config] = r
    return report


def _check(reports, compiled: bool):
    tol = 1e-5 if compiled else 1e-6
    for report in reports:
        for config, r in report.items():
            assert r["same_structure"], config
            assert r["ranks_identical"], f"{config}: gathered params differ between ranks"
            assert r["err"] <= tol, f"{config}: per-block sharded state differs from one process by {r['err']:.2e}"
            assert abs(r["loss"][0] - r["loss"][1]) <= tol * max(1.0, abs(r["loss"][1])), (config, r["loss"])
            mine, whole = r["param_elems"]
            assert mine * 2 <= whole + 2, f"{config}: params not sharded at rest ({mine} of {whole})"
            if compiled:
                assert r["compiles"] == 1, (config, r["compiles"])
            if "resume_exact" in r:
                assert r["loaded_exact"] and r["resume_exact"], f"{config}: resume is not bit-exact"
                assert r["whole_exact"], f"{config}: the checkpoint does not load into the whole-gather step"
            if r["graphs"] is not None:
                (ops,) = r["graphs"]
                sizes = r["sizes"]
                # prefetch: the second block's gather is issued before the first block computes (the graph's
                # addmms: the input layer's, then the first block's)
                first = [i for i, (op, n) in enumerate(ops) if op == "addmm"][1]
                issued = [i for i, (op, n) in enumerate(ops) if op == "all_reduce" and n == 30][1]
                assert issued < first, f"{config}: the next block's gather is not prefetched: {ops}"
                # ... and in the backward: the block before's re-gather is issued as soon as the last block's is,
                # before the last block's backward (its mm): the first micro-batch's head is the 5th addmm
                head = [i for i, (op, n) in enumerate(ops) if op == "addmm"][4]
                regather = next(i for i, (op, n) in enumerate(ops) if i > head and op == "all_reduce" and n == 30)
                assert ops[regather + 1] == ("all_reduce", 30), f"{config}: the backward does not prefetch: {ops}"
                ops = [(op, n) for op, n in ops if op not in ("addmm", "mm")]
                assert not [op for op, _ in ops if op.startswith(("reduce_scatter", "all_gather"))], ops
                biggest = max(sizes["rest"], sizes["block"])
                big = [n for op, n in ops if n > biggest]
                assert not big, f"{config}: collectives larger than one block or the rest ({biggest}): {big}"
                # per micro-batch: each block's float32 parameters (30) gathered in its forward and again in its
                # backward, and their gradient summed; the rest (58) gathered once and its gradient summed
                gathers = sorted(n for op, n in ops if op.startswith("all_reduce") and n >= 10)
                want = sorted([30] * 3 * 3 + [58] * 2) * r["micro"]
                assert gathers == sorted(want), f"{config}: parameter all-reduces {gathers}, expected {want}: {ops}"


def test_two_processes_eager_and_resume(tmp_path):
    _check(ft.launch(_law_worker, nprocs=2, args=(None, str(tmp_path)), timeout=300), compiled=False)


def test_two_processes_compiled():
    _check(ft.launch(_law_worker, nprocs=2, args=("aot_eager", None), timeout=600), compiled=True)


def test_two_processes_inductor():
    _check(ft.launch(_law_worker, nprocs=2, args=("inductor", None), timeout=600), compiled=True)


def test_bad_blocks_are_refused():
    model, step, params, buffers, batch = blockwise_problem("plain")
    with pytest.raises(ValueError, match="needs shard='params'; got shard='optimizer'"):
        ft.data_parallel(shard="optimizer", blocks=model)
    with pytest.raises(ValueError, match="must be the model given to ft.functionalize.*got"):
        ft.data_parallel(shard="params", blocks=[model])
    with pytest.raises(ValueError, match="has no block marked with ft.remat"):
        ft.data_parallel(shard="params", blocks=torch.nn.Linear(2, 2))
    # blocks= another model than the one the loss runs: no block of it runs in the loss
    other, *_ = blockwise_problem("plain")
    wrong = ft.data_parallel(shard="params", blocks=other)(step)
    with pytest.raises(RuntimeError, match="no marked block of blocks=BlockwiseNet ran in the loss"):
        wrong(wrong.init(params, buffers), batch)
    # the Dynamo path cannot trace it: refused by name
    blockwise = ft.data_parallel(shard="params", blocks=model)(step)
    with pytest.raises(ft.GraphBreakError, match="per-block gathering is traced by ft.compile's direct path"):
        ft.compile(blockwise, capture="dynamo", backend="eager")(blockwise.init(params, buffers), batch)
    # a parameter shared between a block and the rest of the model
    model.out.weight = model.blocks[0].lin.weight
    tied = ft.data_parallel(shard="params", blocks=model)(ft.train_step(
        lambda p, b, x: ft.functionalize(model)[0](p, b, x[0]).sum(), ft.optim.sgd(0.1)))
    with pytest.raises(ValueError, match="shared between two marked blocks or between a block and the rest"):
        tied(tied.init(ft.functionalize(model)[1]), batch)
