"""ft.remat, eagerly: marked blocks keep only their inputs (and what the policy saves) and recompute the rest in the
backward, and the step's update is the one without remat (the law), with every transform; marks on Hugging Face
models (gradient_checkpointing_enable) recompute the same way; bad marks and policies are refused by name.

The compiled side (aot_eager and inductor, the measured peak) is tests/compiler/test_compiled_remat.py; remat
with data_parallel on 2 processes is tests/distributed/test_remat_parallel.py.
"""
from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import functrain as ft
from functrain import tree as T
from functrain.core.remat import RematError, checkpoint, marked_blocks, policy_of
from conftest import OPTIMIZERS, POLICIES, TRANSFORMS, Net, batches, build, hf_step, max_diff, run

aten = torch.ops.aten


def test_remat_changes_memory_never_the_update_eager():
    """The law, eagerly: for any stack of blocks (LayerNorm / BatchNorm / none, with or without dropout), any
    policy, any subset of accumulate, clip, EMA and skip_nonfinite with no / bf16 / fp16 (loss-scaled) mixed
    precision, and any optimizer, two steps with the
    blocks marked give the state of two steps without (params, optimizer state, EMA, loss scale and the buffers
    BatchNorm updates) to float rounding (1e-6; measured: bitwise), and the same metrics."""

    @settings(max_examples=40, deadline=None)
    @given(st.integers(1, 3), st.sampled_from([4, 6]), st.sampled_from(["ln", "bn", "none"]), st.booleans(),
           st.sampled_from(sorted(POLICIES)), st.sets(st.sampled_from(["accumulate", "clip", "ema", "skip_nonfinite"])),
           st.sampled_from(["no", "bf16", "fp16"]), st.sampled_from(sorted(OPTIMIZERS)))
    def law(depth, width, norm, dropout, policy, transforms, precision, optimizer):
        transforms = sorted(transforms) + ([precision] if precision != "no" else [])
        kw = dict(width=width, depth=depth, norm=norm, dropout=dropout, transforms=transforms, optimizer=optimizer)
        data = batches(width)
        _, plain, s0 = build(**kw)
        net, marked, s1 = build(policy=policy, **kw)
        assert T.tree_equal(s0, s1)
        a, ma = run(plain, s0, data)
        b, mb = run(marked, s1, data)
        assert max_diff(a, b) <= 1e-6, (kw, policy, max_diff(a, b))
        assert T.tree_structure(a) == T.tree_structure(b)
        assert all(torch.equal(x, y) for x, y in zip(T.tree_leaves(a), T.tree_leaves(b)) if not x.is_floating_point())
        assert max_diff(ma, mb) <= 1e-6
        # the blocks really ran again in the backward: twice per micro-batch per step
        micro = 2 if "accumulate" in transforms else 1
        assert [blk.calls for blk in net.blocks] == [2 * micro * len(data)] * depth

    law()


def saved_numels(net, x):
    """The number of elements autograd keeps for the backward of ``net(x)`` (a saved-tensors hook on the forward)."""
    sizes = []

    def pack(t):
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        net(x).sum()
    return sum(sizes)


class CountOps(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = {}

    def __torch_dispatch__(self, op, types, args=(), kwargs=None):
        self.counts[op] = self.counts.get(op, 0) + 1
        return op(*args, **(kwargs or {}))


def backward_ops(net, x):
    """The aten ops the backward of ``net(x)`` runs (forward ops among them are recomputations)."""
    y = net(x).sum()
    with CountOps() as c:
        torch.autograd.grad(y, list(net.parameters()))
    return c.counts


def test_each_policy_keeps_what_it_names():
    """A stack of 3 blocks (LayerNorm, Linear, GELU, Linear): with "nothing_saveable" autograd keeps only each
    block's inputs (its parameters and its input rows) and the backward recomputes every forward op (6 addmm,
    3 gelu, 3 layer norms); "dots_saveable", "dots_with_no_batch_dims_saveable" and torch's policy function
    keep the matmul outputs (no addmm in the backward, gelu and layer norm recomputed); the op list
    {addmm, gelu} keeps those two; "everything_saveable" and no mark keep everything (no forward op in the
    backward)."""
    torch.manual_seed(0)
    width, rows = 6, 64  # rows enough for the activations to outweigh the parameters
    x = torch.randn(rows, width)
    net = Net(width, depth=3, norm="ln")
    block_params = sum(p.numel() for p in net.blocks[0].parameters())
    head = saved_numels(net.head, torch.randn(rows, width, requires_grad=True))
    full = saved_numels(net, x)
    ft.remat(net.blocks)
    assert saved_numels(net, x) == 3 * (block_params + rows * width) + head < full / 2
    forward_ops = (aten.addmm.default, aten.gelu.default, aten.native_layer_norm.default)
    recomputed = {"nothing_saveable": (6, 3, 3), "dots_saveable": (0, 3, 3),
                  "dots_with_no_batch_dims_saveable": (0, 3, 3), "torch_policy": (0, 3, 3), "ops": (0, 0, 3),
                  "everything_saveable": (0, 0, 0)}
    for name, expect in recomputed.items():
        ft.remat(net.blocks, POLICIES.get(name, name))
        counts = backward_ops(net, x)
        assert tuple(counts.get(op, 0) for op in forward_ops) == expect, (name, counts)
    plain = Net(width, depth=3, norm="ln")
    assert tuple(backward_ops(plain, x).get(op, 0) for op in forward_ops) == (0, 0, 0)


def test_random_draws_are_kept_and_reused():
    """Dropout in a recomputed block: the recomputation reuses the forward's mask (an in-place draw too), so
    the gradient is the one without remat, bitwise, although the global generator moved on in between."""
    torch.manual_seed(0)
    x = torch.randn(16, 8)

    def block(x, w):
        h = torch.nn.functional.dropout(x @ w, 0.5, training=True)
        mask = torch.empty_like(h).bernoulli_(0.5)  # an in-place draw, then written again
        mask.mul_(2.0)
        return (h * mask).tanh()

    w = torch.randn(8, 8, requires_grad=True)
    torch.manual_seed(1)
    ref = torch.autograd.grad(block(x, w).sum(), w)[0]
    torch.manual_seed(1)
    y = ft.remat(block)(x, w).sum()
    torch.randn(1000)  # the generator moves on before the backward
    got = torch.autograd.grad(y, w)[0]
    assert torch.equal(got, ref)


def test_batchnorm_statistics_are_updated_once():
    """A BatchNorm in a recomputed block updates its running statistics (and its batch counter) once per
    forward, as without remat: the recomputation runs on copies."""
    data = batches(6, n=3)
    _, plain, s0 = build(norm="bn")
    _, marked, s1 = build(norm="bn", policy="nothing_saveable")
    a, _ = run(plain, s0, data)
    b, _ = run(marked, s1, data)
    assert T.tree_equal(a.buffers, b.buffers)
    assert int(b.buffers["blocks.0.norm.num_batches_tracked"]) == 3


def test_marks_survive_a_copy_and_leave_the_module_as_it_was():
    """A mark changes no parameter name, state_dict or hook; a deepcopy keeps it and runs its own parameters;
    marking again replaces the policy; marked_blocks lists the outermost marked modules in order."""
    torch.manual_seed(0)
    net = Net()
    names = [n for n, _ in net.named_parameters()]
    sd = {k: v.clone() for k, v in net.state_dict().items()}
    ft.remat(net.blocks)
    assert [n for n, _ in net.named_parameters()] == names and T.tree_equal(dict(net.state_dict()), sd)
    assert marked_blocks(net) == list(net.blocks)
    ft.remat(net.blocks, "dots_saveable")
    assert policy_of(net.blocks[1]).name == "dots_saveable"
    twin = copy.deepcopy(net)
    with torch.no_grad():
        for p in twin.parameters():
            p.add_(1.0)
    x = torch.randn(3, 6)
    assert not torch.allclose(twin(x), net(x))  # the copy's forward uses the copy's weights
    assert marked_blocks(twin) == list(twin.blocks)
    hooked = []
    net.blocks[0].register_forward_hook(lambda m, i, o: hooked.append(1))
    net(x).sum().backward()
    assert hooked == [1], "module hooks run once (outside the recomputation)"
    ft.remat(net)  # the whole model as one block: its marked children are not listed again
    assert marked_blocks(net) == [net]


def test_a_closure_over_a_parameter_is_refused():
    """A recomputed function that reads a parameter it was not given could not give it a gradient (torch.func
    would silently make it zero): refused by name, eagerly and under torch.func."""
    w = torch.randn(4, 4, requires_grad=True)
    f = ft.remat(lambda x: torch.tanh(x @ w))
    with pytest.raises(RematError, match=r"shape \(4, 4\) that needs a gradient but is not one of its inputs"):
        f(torch.randn(2, 4))

    def loss(p, x):
        return ft.remat(lambda h: torch.tanh(h @ p))(x).sum()

    with pytest.raises(RematError, match="not one of its inputs"):
        torch.func.grad(loss)(torch.randn(4, 4), torch.randn(2, 4))
    # passed as an argument, it is an input: the gradient of the plain function
    x = torch.randn(2, 4)
    got = torch.func.grad(lambda p, x: ft.remat(lambda h, q: torch.tanh(h @ q))(x, p).sum())(w.detach(), x)
    assert torch.equal(got, torch.func.grad(lambda p, x: torch.tanh(x @ p).sum())(w.detach(), x))


def test_bad_marks_and_policies_are_named():
    net = Net()
    with pytest.raises(ft.core.validate.BadValue, match=r"policy must be one of \('nothing_saveable', 'dots_saveable'.*got 'dots' \(str\)"):
        ft.remat(net.blocks, "dots")
    with pytest.raises(ft.core.validate.BadValue, match="must hold aten ops.*'mm' \\(str\\)"):
        ft.remat(net.blocks, {"mm"})
    with pytest.raises(ft.core.validate.BadValue, match=r"target must be a torch.nn.Module.*got 3 \(int\)"):
        ft.remat(3)
    with pytest.raises(ft.core.validate.BadValue, match=r"item 1 of the list is 'head' \(str\)"):
        ft.remat([net.head, "head"])
    with pytest.raises(ft.core.validate.BadValue, match="empty list"):
        ft.remat([])
    with pytest.raises(ft.core.validate.BadValue, match="context_fn"):
        from torch.utils.checkpoint import create_selective_checkpoint_contexts
        checkpoint(net.head, torch.randn(2, 6), context_fn=lambda: create_selective_checkpoint_contexts([aten.mm]))
    assert marked_blocks(net) == [], "a refused call marks nothing"


def test_reentrant_torch_checkpoint_in_the_loss_is_explained():
    """torch.utils.checkpoint with use_reentrant=True cannot run under torch.autograd.grad (the eager step's
    gradient): the error says so and names ft.remat, instead of torch's message about .backward()."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4)
    apply_fn, params, buffers = ft.functionalize(lin)

    def loss(p, b, x):
        return torch.utils.checkpoint.checkpoint(lambda h: apply_fn(p, b, h), x, use_reentrant=True).sum()

    step = ft.train_step(loss, ft.optim.sgd(0.1))
    with pytest.raises(RuntimeError, match=r"use_reentrant=True.*ft\.remat"):
        step(step.init(params, buffers), torch.randn(2, 4, requires_grad=True))


# -- Hugging Face's gradient checkpointing ---------------------------------------------------------------------------------------
def test_hugging_face_gradient_checkpointing_recomputes_through_remat():
    """A Llama built from a config (no download) after gradient_checkpointing_enable(): the eager step's update
    equals the one without checkpointing (1e-6), its attention ran twice per layer (forward and recomputation),
    and the model's own checkpoint function and input-grad hook are back in place after the step."""
    _, step, state, ids, _ = hf_step(False)
    ref, _ = step(state, ids)
    model, step, state, ids, calls = hf_step(True)
    funcs = [m._gradient_checkpointing_func for m in model.model.layers]
    hooks = dict(model.get_input_embeddings()._forward_hooks)
    assert hooks, "gradient_checkpointing_enable() hooks the input embeddings"
    new, _ = step(state, ids)
    assert max_diff(new.params, ref.params) <= 1e-6
    assert calls.count(1) == 2 and calls.count(2) == 4, calls  # 2 layers: each attention forward + recomputation
    assert [m._gradient_checkpointing_func for m in model.model.layers] == funcs
    assert dict(model.get_input_embeddings()._forward_hooks) == hooks


def test_hugging_face_offload_is_not_silently_dropped():
    """activation_checkpointing_enable(offload=True) wraps torch's checkpoint in save_on_cpu: functrain recomputes
    those layers itself and says once that the inputs stay where they are."""
    import functrain.core.remat as R

    R._warned_offload = False
    _, step, state, ids, _ = hf_step(False)
    ref, _ = step(state, ids)
    _, step, state, ids, _ = hf_step(True, offload=True)
    with pytest.warns(RuntimeWarning, match="no offloading to the host"):
        new, _ = step(state, ids)
    assert max_diff(new.params, ref.params) <= 1e-6
