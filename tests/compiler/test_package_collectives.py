"""A CPU package whose graph waits in collectives runs without holding the GIL (functrain/compiler/package.py,
``_FreeRunner``), on 2 real gloo ranks.

Why it must: a gloo worker thread that frees a collective's tensors takes the GIL while it holds its queue's lock;
if the training thread holds the GIL while the graph waits in a collective (torch's AOTInductor runner does), the
rank deadlocks. That hung the 2-rank main job in 4 of 14 warm runs.

The test makes that dependency certain instead of likely: rank 1 enters the all-reduce only after a Python thread
of rank 0 ran *while rank 0 is inside the package's call* (the thread is released by an event set right before
the call, and a switch interval of 1000 s keeps the training thread from giving the GIL up by itself). A runner
that holds the GIL never lets that thread run: rank 1 times out waiting for it. The package is built by one rank
(the other waits for the build's lock and loads it) from a hand-made graph: an all-reduce, and ``_foreach_norm``,
which AOTInductor would call through torch's proxy executor, so the package decomposes it. Results against eager
ones computed in the same ranks; then 40 calls interleaved with Python-level all-reduces whose tensors are freed
at once (the deadlock's pattern)."""
from __future__ import annotations

import pytest
import torch

import functrain as ft


def _graph(group: str) -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    x, y = graph.placeholder("x"), graph.placeholder("y")
    doubled = graph.call_function(torch.ops.aten.mul.Tensor, (x, 2.0))
    reduced = graph.call_function(torch.ops._c10d_functional.all_reduce.default, (doubled, "sum", group))
    waited = graph.call_function(torch.ops._c10d_functional.wait_tensor.default, (reduced,))
    norms = graph.call_function(torch.ops.aten._foreach_norm.Scalar, ([x, y], 2.0))
    import operator
    n0 = graph.call_function(operator.getitem, (norms, 0))
    n1 = graph.call_function(operator.getitem, (norms, 1))
    graph.output([waited, n0, n1])
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def _worker(folder):
    import datetime
    import sys
    import threading

    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    from functrain.compiler import package

    rank = dist.get_rank()
    store = distributed_c10d._get_default_store()
    x = torch.full((4, 3), float(rank + 1))
    y = torch.arange(5.0) * (rank + 1)
    made = []
    fn = package.Packages(folder)(_graph(dist.group.WORLD.group_name), [x, y], lambda: made.append(1))
    report = {"runner": type(fn).__name__, "frees_the_gil": getattr(fn, "frees_the_gil", None), "made": len(made)}
    if fn is None:
        return report

    # the proof: rank 1 joins the all-reduce only after rank 0's thread ran during rank 0's call
    old = sys.getswitchinterval()
    sys.setswitchinterval(1000.0)
    try:
        if rank == 0:
            go = threading.Event()
            helper = threading.Thread(target=lambda: (go.wait(), store.set("ran during the call", "1")))
            helper.start()
            go.set()
            out = fn(x, y)
            helper.join(timeout=60)
        else:
            store.wait(["ran during the call"], datetime.timedelta(seconds=60))
            out = fn(x, y)
    finally:
        sys.setswitchinterval(old)
    reference = x * 2.0
    dist.all_reduce(reference)
    report["reduced"] = torch.equal(out[0], reference)
    report["norms"] = max(float((out[1] - torch.linalg.vector_norm(x)).abs()),
                          float((out[2] - torch.linalg.vector_norm(y)).abs()))

    # the deadlock's pattern: a Python-level collective whose tensor is freed at once, then the package's call
    same = True
    for i in range(40):
        dist.all_reduce(torch.full((3,), float(i)))
        same = same and torch.equal(fn(x, y)[0], reference)
    report["repeated"] = same
    return report


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    folder = tmp_path_factory.mktemp("packages")
    return ft.launch(_worker, nprocs=2, args=(str(folder),), timeout=400, dist_timeout=90)


def test_a_cpu_package_with_collectives_is_built_once_and_frees_the_gil(reports):
    assert [r["runner"] for r in reports] == ["PackageCall", "PackageCall"], reports
    assert [r["frees_the_gil"] for r in reports] == [True, True], reports
    assert [r["made"] for r in reports] == [1, 1], reports


def test_its_results_equal_eager_and_other_threads_ran_during_its_call(reports):
    for r in reports:
        assert r["reduced"], r  # the all-reduce's sum over both ranks, bitwise
        assert r["norms"] < 1e-5, r  # _foreach_norm, decomposed per tensor: to rounding
        assert r["repeated"], r


def test_graphs_with_collectives_are_packaged_only_on_the_cpu():
    from functrain.compiler import package

    gm = _graph("0")
    assert package.takes(gm, torch.device("cpu"))
    assert not package.takes(gm, torch.device("cuda", 0))
    plain = torch.fx.Graph()
    z = plain.placeholder("z")
    plain.output([plain.call_function(torch.ops.aten.mul.Tensor, (z, z))])
    assert package.takes(torch.fx.GraphModule(torch.nn.Module(), plain), torch.device("cuda", 0))
