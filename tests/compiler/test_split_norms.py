"""``_foreach_norm`` as per-tensor norms (functrain.compiler.rewrites.split_foreach_norms, issue 40): a CPU graph's C++
wrapper would call ``_foreach_norm`` (clip's global norm) through torch's proxy executor, a round trip through
Python on every call; the backend rewrites it into per-tensor norms that inductor compiles. The same numbers."""
from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._python_dispatch import TorchDispatchMode

import functrain as ft
import functrain.testing as ftt
from functrain.compiler import backend
from functrain.compiler.rewrites import split_foreach_norms

FOREACH_NORM = torch.ops.aten._foreach_norm.Scalar


@given(st.lists(st.tuples(st.integers(1, 5), st.integers(1, 7)), min_size=1, max_size=5),
       st.sampled_from([1.0, 2.0, float("inf")]), st.integers(0, 2**16))
@settings(max_examples=25, deadline=None)
def test_split_norms_equal_foreach_norm(shapes, order, seed):
    """A law: the rewritten graph gives ``torch._foreach_norm``'s values (computed here) bit for bit, for any list
    of tensors and order, with no ``_foreach_norm`` left in it; a graph without one is returned as it is."""
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(*s, generator=g) for s in shapes]

    def f(*ts):
        return [n * 2 for n in torch._foreach_norm(list(ts), order)]

    gm = make_fx(f)(*xs)
    split = split_foreach_norms(gm)
    assert not any(n.target is FOREACH_NORM for n in split.graph.nodes)
    assert any(n.target is FOREACH_NORM for n in gm.graph.nodes)  # (the original is not changed)
    for got, want in zip(split(*xs), [n * 2 for n in torch._foreach_norm(xs, order)]):
        assert torch.equal(got, want)
    plain = make_fx(lambda a: a * 2)(xs[0])
    assert split_foreach_norms(plain) is plain


class _Ops(TorchDispatchMode):
    """Records the ATen ops that reach Python's dispatch during a call (the proxy executor's calls do)."""

    def __init__(self):
        super().__init__()
        self.ops = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(func)
        return func(*args, **(kwargs or {}))


def _clipped():
    g = torch.Generator().manual_seed(0)
    params = {"w0": torch.randn(8, 32, generator=g) / 3, "b0": torch.zeros(32),
              "w1": torch.randn(32, 2, generator=g) / 6, "b1": torch.zeros(2)}
    step = ft.clip(0.5)(ft.train_step(ftt.mlp_loss, ft.optim.adamw(1e-2)))
    batches = [(torch.randn(16, 8, generator=g), torch.randn(16, 2, generator=g)) for _ in range(3)]
    return step, step.init(params), batches


def _run(step, state, batches, monkeypatch, split):
    if not split:  # the control: the backend as it was, _foreach_norm left for the proxy executor
        monkeypatch.setattr(backend, "split_foreach_norms", lambda gm: gm)
    cs = ft.compile(step)
    s, m = cs(ftt.clone_tree(state), batches[0])  # (compiles)
    mode = _Ops()
    with mode:
        s, m = cs(s, batches[1])
    s, m = cs(s, batches[2])
    monkeypatch.undo()
    return mode.ops, (s, m)


def test_a_clipped_cpu_step_calls_no_norm_through_python(monkeypatch):
    """Compiled with inductor on the CPU (its C++ wrapper): a call of the clipped step sends no ``_foreach_norm``
    through Python; the control (the rewrite turned off) does, so the check sees what it looks for; the state
    and metrics after 3 steps agree with the control's to float rounding and with eager's."""
    step, state, batches = _clipped()
    ops, got = _run(step, state, batches, monkeypatch, split=True)
    control_ops, control = _run(step, state, batches, monkeypatch, split=False)
    assert FOREACH_NORM in control_ops, sorted(map(str, control_ops))
    assert FOREACH_NORM not in ops, sorted(map(str, ops))
    want, _ = ftt.run_steps(step, ftt.clone_tree(state), lambda i: batches[i], steps=3)
    ftt.assert_same_state(got[0], control[0], rtol=1e-6, atol=1e-7, what="split against the control")
    ftt.assert_same_state(got[0], want, rtol=1e-4, atol=1e-6, what="split against eager")
    ftt.assert_same_state(got[1], control[1], rtol=1e-6, atol=1e-7, what="metrics")
