"""Repeated blocks traced once (functrain.core.regions): one region per distinct block, reused at every depth.

Laws: the compiled step equals the eager step (to inductor's float rounding); the input state is
never written (a region compiled with buffer reuse wrote into its parameters: the regression below);
the number of regions does not grow with depth; blocks that compute differently never share a
region, blocks that differ only in what their computation does not read do.
"""
import torch
import torch.nn.functional as F

import functrain as ft
from functrain import tree as T
from functrain.compiler.capture import trace
from functrain.core.regions import repeated_blocks


class Block(torch.nn.Module):
    """A pre-norm residual MLP block; ``scale`` is read by the computation, ``layer_idx`` is not."""

    def __init__(self, d=16, layer_idx=0, scale=1.0, dropout=0.0):
        super().__init__()
        self.ln = torch.nn.LayerNorm(d)
        self.fc = torch.nn.Linear(d, 2 * d)
        self.out = torch.nn.Linear(2 * d, d)
        self.layer_idx, self.scale, self.dropout = layer_idx, scale, dropout

    def forward(self, x):
        h = F.gelu(self.fc(self.ln(x)))
        return x + self.scale * self.out(F.dropout(h, self.dropout, self.training))


class Net(torch.nn.Module):
    def __init__(self, depth, scales=None, dropout=0.0):
        super().__init__()
        self.inp = torch.nn.Linear(4, 16)
        scales = scales or [1.0] * depth
        self.blocks = torch.nn.ModuleList(Block(16, i, s, dropout) for i, s in enumerate(scales))
        self.head = torch.nn.Linear(16, 1)

    def forward(self, x, y):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return F.mse_loss(self.head(h), y)


def _step(net):
    apply_fn, params, buffers = ft.functionalize(net)

    def loss_fn(p, b, batch):
        return apply_fn(p, b, *batch)

    return ft.train_step(loss_fn, ft.optim.adamw(1e-2)), params, buffers


def _batch():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 4, generator=g)
    return x, x[:, :1] * 0.5


def _regions(net, reuse=True):
    step, params, buffers = _step(net)
    cap = trace(step.apply, step.init(params, buffers, seed=None), _batch(), "fresh", reuse_blocks=reuse)
    subs = [n for n, _ in cap.gm.named_children()]
    calls = sum(1 for n in cap.gm.graph.nodes if getattr(n.target, "__name__", "") == "invoke_subgraph")
    return subs, calls


def test_blocks_are_found_and_traced_once_whatever_the_depth():
    torch.manual_seed(0)
    assert [len(g) for g in repeated_blocks(Net(3))] == [3]
    assert repeated_blocks(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4))) == []
    shallow, deep = _regions(Net(2)), _regions(Net(12))
    # forward and backward regions: as many for 12 blocks as for 2, called once per block and direction
    assert len(deep[0]) == len(shallow[0]) <= 3 and deep[1] == 24 and shallow[1] == 4, (shallow, deep)
    assert _regions(Net(12), reuse=False) == ([], 0)  # ft.compile(reuse_blocks=False), the default: flat
    assert ft.compile(_step(Net(2))[0]).options.reuse_blocks is False


def test_blocks_that_compute_differently_do_not_share_a_region():
    torch.manual_seed(0)
    same_but_index = _regions(Net(4))  # layer_idx differs, the computation does not read it
    two_scales = _regions(Net(4, scales=[1.0, 0.5, 1.0, 0.5]))
    assert len(two_scales[0]) > len(same_but_index[0]), (same_but_index, two_scales)


def test_compiled_with_regions_equals_eager_and_never_writes_its_input():
    torch.manual_seed(0)
    net = Net(6, dropout=0.1)  # random draws inside the region too
    step, params, buffers = _step(net)
    state = step.init(params, buffers)
    before = T.tree_map(torch.clone, state)
    cstep = ft.compile(step, reuse_blocks=True)
    assert len(trace(step.apply, state._replace(rng=None), _batch(), "fresh", reuse_blocks=True)
               .gm._modules) >= 2  # (this step does use regions)
    c = e = state
    for _ in range(4):
        c, cm = cstep(c, _batch())
        e, em = step(e, _batch())
    assert T.tree_equal(state, before), "the compiled step wrote into its input state"
    assert T.tree_allclose(c, e, rtol=1e-5, atol=1e-6) and cstep.compiles == 1
    assert abs(float(cm["loss"]) - float(em["loss"])) <= 1e-5 * max(1.0, abs(float(em["loss"])))


class ReadsOutside(torch.nn.Module):
    """A block that reads a tensor that is neither a parameter, a buffer nor an argument (a plain attribute):
    a region cannot take it (its trace sees only its own inputs), so the step is traced flat."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
        self.act = torch.nn.Tanh()
        self.mask = torch.tensor([1.0, 0.0, 1.0, 1.0])

    def forward(self, x):
        return self.act(self.fc(x)) * self.mask


def test_a_step_whose_blocks_cannot_be_regions_is_traced_flat():
    torch.manual_seed(0)
    net = torch.nn.Sequential(ReadsOutside(), ReadsOutside(), torch.nn.Linear(4, 1))
    apply_fn, params, buffers = ft.functionalize(net)
    step = ft.train_step(lambda p, b, batch: F.mse_loss(apply_fn(p, b, batch[0]), batch[1]), ft.optim.sgd(0.1))
    state = step.init(params, buffers)
    cap = trace(step.apply, state._replace(rng=None), _batch(), "fresh", reuse_blocks=True)
    assert not list(cap.gm.named_children())  # flat, and still one graph
    c, _ = ft.compile(step, backend="aot_eager", reuse_blocks=True)(state, _batch())
    e, _ = step(state, _batch())
    assert T.tree_allclose(c, e, rtol=1e-6, atol=1e-7)


def _probes(net, monkeypatch):
    """How many forward-only probe traces one trace of ``net``'s step makes, and its regions."""
    from functrain.core import regions
    real, count = regions._probe, [0]

    def counting(region, operands):
        count[0] += 1
        return real(region, operands)

    monkeypatch.setattr(regions, "_probe", counting)
    found = _regions(net)
    monkeypatch.setattr(regions, "_probe", real)
    return count[0], found


def test_blocks_equal_in_their_attributes_are_probed_once_and_private_ones_count(monkeypatch):
    torch.manual_seed(0)
    alike = Net(6)
    for b in alike.blocks:
        b.layer_idx = 0  # every attribute equal: one probe decides for all six blocks
    probes, alike_regions = _probes(alike, monkeypatch)
    assert probes == 1, probes
    indexed, _ = _probes(Net(6), monkeypatch)  # layer_idx differs: each block is probed (then they share)
    assert indexed == 6, indexed
    # a private attribute the computation reads must split the blocks as a public one does
    private = Net(4)
    for i, b in enumerate(private.blocks):
        b.layer_idx = 0
        del b.scale
        b._scale = 1.0 if i % 2 == 0 else 0.5
        b.forward = None
        del b.forward
    type_ = type("PrivateBlock", (Block,), {"forward": lambda self, x: x + self._scale * self.out(
        F.gelu(self.fc(self.ln(x))))})
    for b in private.blocks:
        b.__class__ = type_
    _, private_regions = _probes(private, monkeypatch)
    assert len(private_regions[0]) > len(alike_regions[0]), (alike_regions, private_regions)
