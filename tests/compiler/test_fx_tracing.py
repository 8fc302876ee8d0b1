"""torch's make_fx keeps its running tracer in one module global per process, so functrain's threads that trace
(the training thread's trace and compile, the memory line's retrace through inductor's decompositions, a compile
thread) take turns on one lock (functrain.compiler.fx_tracing): each waits while another thread holds it, and
traces made while another thread walks graphs are the graphs made alone."""
from __future__ import annotations

import threading

import pytest
import torch

import functrain as ft
from functrain.compiler.backend import compile_graph
from functrain.compiler.capture import trace
from functrain.compiler.fx_tracing import FX_TRACING
from functrain.compiler.graph_peak import estimate_graph


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.tanh(self.fc(x)) + x


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block() for _ in range(3))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


@pytest.fixture(scope="module")
def problem():
    torch.manual_seed(0)
    apply_fn, params, buffers = ft.functionalize(Net())
    step = ft.train_step(lambda p, b, x: apply_fn(p, b, x).square().mean(), ft.optim.adamw(1e-3))
    return step, step.init(params, buffers, seed=None), torch.randn(4, 8)


def _in_thread(fn):
    """Run ``fn`` on a thread; returns (the thread, an event set when fn returned, a list holding its result)."""
    done, out = threading.Event(), []

    def run():
        try:
            out.append(fn())
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out.append(e)
        done.set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, done, out


@pytest.mark.parametrize("what", ["trace", "compile", "walk"])
def test_each_tracer_waits_while_another_thread_holds_the_lock(problem, what):
    from torch._dynamo.backends.registry import lookup_backend

    step, state, batch = problem
    cap = trace(step.apply, state, batch, "fresh", reuse_blocks=True)
    work = {"trace": lambda: trace(step.apply, state, batch, "fresh", reuse_blocks=True),
            "compile": lambda: compile_graph(lookup_backend("aot_eager"), cap.gm, cap.metas),
            "walk": lambda: estimate_graph(cap.gm, torch.device("cpu"))}[what]
    held, release = threading.Event(), threading.Event()

    def hold():
        with FX_TRACING:
            held.set()
            release.wait(120)

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    assert held.wait(60)
    t, done, out = _in_thread(work)
    try:
        # a negative check: while the lock is held elsewhere the work cannot finish, however long we look
        assert not done.wait(0.5), f"{what} ran while another thread held the tracing lock"
    finally:
        release.set()
    assert done.wait(300), f"{what} did not finish after the lock was released"
    assert not isinstance(out[0], BaseException), out[0]
    holder.join(60)
    t.join(60)


def test_traces_made_while_another_thread_walks_graphs_are_the_graphs_made_alone(problem):
    step, state, batch = problem
    alone = trace(step.apply, state, batch, "fresh", reuse_blocks=True)
    expected = [str(n.target) for n in alone.gm.graph.nodes]
    peak = estimate_graph(alone.gm, torch.device("cpu"))
    stop = threading.Event()
    walks = []

    def walk():
        while not stop.is_set():
            walks.append(estimate_graph(alone.gm, torch.device("cpu")))

    t, done, out = _in_thread(walk)
    try:
        for _ in range(4):
            cap = trace(step.apply, state, batch, "fresh", reuse_blocks=True)
            assert [str(n.target) for n in cap.gm.graph.nodes] == expected
    finally:
        stop.set()
    assert done.wait(300)
    assert not out or not isinstance(out[0], BaseException), out
    assert walks and all(w == peak for w in walks)
