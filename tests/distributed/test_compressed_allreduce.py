"""data_parallel(compress="bf16" | "fp16"): the gradient all-reduced in 16 bits, within that dtype's rounding of
the exact mean (2 real gloo processes; the reference is computed here in float64)."""
import pytest
import torch

import functrain as ft

SIZE = 32
EPS = {"bf16": 2.0 ** -7, "fp16": 2.0 ** -10}
TINY = {"bf16": 2.0 ** -133, "fp16": 2.0 ** -24}  # the dtype's subnormal spacing (its smallest subnormal)


def _loss(params, buffers, g):
    return (params["w"] * g).sum()  # the gradient is the batch itself


def _worker(compress, backend):
    import torch.distributed as dist
    from hypothesis import HealthCheck, Phase, given, settings, strategies as st

    rank, world = dist.get_rank(), dist.get_world_size()
    step = ft.data_parallel(compress=compress)(ft.train_step(_loss, ft.optim.sgd(1.0)))
    run = ft.compile(step, backend=backend) if backend else step
    fresh = step.init({"w": torch.zeros(SIZE)})
    seen = []

    def mean_of(grads):
        state, _ = run(fresh, grads[rank])  # sgd(1.0) from 0: the new params are minus the mean gradient
        return -state.params["w"]

    values = st.lists(st.floats(-1.0, 1.0, width=32), min_size=SIZE, max_size=SIZE)

    # every rank draws the same examples (derandomized, no database, no shrinking) and asserts nothing here, so
    # both call the step equally often; the parent asserts on what they report
    @settings(derandomize=True, database=None, max_examples=40, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(g0=values, g1=values, exponent=st.integers(-8, 3))
    def law(g0, g1, exponent):
        grads = [torch.tensor(g, dtype=torch.float32) * 10.0 ** exponent for g in (g0, g1)]
        exact = (grads[0].double() + grads[1].double()) / world
        got = mean_of(grads)
        bound = world * EPS[compress] * torch.maximum(grads[0].abs(), grads[1].abs()).double() + world * TINY[compress]
        seen.append({"over": float(((got.double() - exact).abs() - bound).max()),
                     "compressed": not torch.equal(got, ((grads[0] + grads[1]) / world)),
                     "sum": float(sum(g.sum() for g in grads))})

    law()
    # fp16 overflow: 6e4 on both ranks sums to 1.2e5 > 65504, so each rank divides by the world size first
    big = [torch.full((SIZE,), 6e4), torch.full((SIZE,), 6e4)]
    overflow = mean_of(big)
    return {"seen": seen, "overflow": overflow.tolist(), "compiles": run.compiles if backend else None}


def _check(reports, compress):
    assert reports[0]["seen"] == reports[1]["seen"]  # the same examples, the same results on both ranks
    seen = reports[0]["seen"]
    assert len(seen) >= 20, len(seen)
    worst = max(s["over"] for s in seen)
    assert worst <= 0.0, f"{compress}: the mean exceeds the bound world * eps * max|g| by {worst:.3e}"
    assert any(s["compressed"] for s in seen), f"{compress}: every result equals the fp32 mean: nothing compressed"
    assert all(abs(v - 6e4) <= 2 * EPS[compress] * 6e4 for v in reports[0]["overflow"]), reports[0]["overflow"]
    if reports[0]["compiles"] is not None:
        assert reports[0]["compiles"] == 1, reports[0]["compiles"]


@pytest.mark.parametrize("compress", ["bf16", "fp16"])
def test_compressed_allreduce_within_the_dtype_rounding_eager(compress):
    _check(ft.launch(_worker, nprocs=2, args=(compress, None), timeout=300, dist_timeout=120), compress)


@pytest.mark.parametrize("compress", ["bf16", "fp16"])
def test_compressed_allreduce_within_the_dtype_rounding_compiled(compress):
    _check(ft.launch(_worker, nprocs=2, args=(compress, "aot_eager"), timeout=500, dist_timeout=240), compress)


def test_compressed_allreduce_within_the_dtype_rounding_inductor():
    _check(ft.launch(_worker, nprocs=2, args=("fp16", "inductor"), timeout=550, dist_timeout=400), "fp16")


def test_compress_refuses_bad_values():
    with pytest.raises(ValueError, match=r"data_parallel: compress must be one of \(None, 'bf16', 'fp16'\); got 'int8'"):
        ft.data_parallel(compress="int8")
    with pytest.raises(ValueError, match=r"compress='fp16' compresses the replicated all-reduce; shard='optimizer'"):
        ft.data_parallel(shard="optimizer", compress="fp16")
    assert repr(ft.data_parallel(compress="bf16")) == "data_parallel(compress='bf16')"
