"""Shared test settings, and the problems, batches and small transforms the transform tests share.

The transform law tests (one file per transform: test_accumulate.py, test_clip.py,
test_ema.py, test_mixed_precision.py, test_skip_nonfinite.py; test_composition.py
for the built-ins together, test_compiled_transforms.py for compiled == eager,
test_testing_kit.py for functrain.testing) import these helpers with
``from conftest import ...``.

Tolerances used across them (see each test for the reasoning):

* fp32 laws (accumulation, streaming, item counts): rtol = atol = 1e-6. Summing
  micro-batch gradients reorders fp32 sums: a few ulps (2**-23 ~ 1.2e-7) of O(1)
  gradients, times lr <= 0.1, so ~1e-8 in the params; 1e-6 leaves margin yet
  fails for any real mistake (a wrong divisor is off by a factor, a mean of
  micro-batch token means by O(1e-2): see test_num_items_reference_discriminates).
* wrapping order, mixed_precision("no"), clip with a huge max_norm, skip_nonfinite
  vs the plain step on the finite batches: bitwise (same operations in the same order).
* bf16/fp16 vs fp32: the update's relative error (norm-wise) <= 8 * eps of the
  compute dtype (eps = 2**-7 for bf16, 2**-10 for fp16), see test_low_precision_close_to_fp32.
* compiled vs eager: allclose 1e-5 (aot_eager runs eager's kernels; inductor's
  fused fp32 kernels differ in the last bits); fp16 compute under inductor: see
  test_compiled_inductor_all_four_fp16.
"""
from __future__ import annotations

import os
import warnings

import optree
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

import functrain as ft
from functrain import tree as T

# A background compile still running when a test's run ends normally would go on after the test (ft.run lets it
# finish, for the next run: functrain.compiler.jobs.finish_after_exit_allowed); the suite's many short runs would
# leave compile workers loading the machine, so the suite stops them at exit. Subprocesses inherit it;
# tests/compiler/test_background.py::test_a_run_shorter_than_its_compile_leaves_the_next_run_compiled sets it to 1.
os.environ.setdefault("FUNCTRAIN_COMPILE_FINISH", "0")
# The compile policy (functrain.compiler.policy) would train the suite's many short runs eagerly (a compile never
# pays in 10 steps): the suite tests what compiling does, so it compiles unless a test asks for the policy
# (tests/compiler/test_compile_policy.py sets FUNCTRAIN_COMPILE_POLICY=auto). Subprocesses inherit it.
os.environ.setdefault("FUNCTRAIN_COMPILE_POLICY", "always")

settings.register_profile("functrain", deadline=None, suppress_health_check=[HealthCheck.too_slow],
                          derandomize=os.environ.get("CI") == "true")
settings.load_profile("functrain")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


# -- shared by the transform tests ----------------------------------------------------------
EPS = {"bf16": 2.0**-7, "fp16": 2.0**-10}  # machine epsilon of the compute dtype


OPTIMIZERS = {
    "sgd": lambda: ft.optim.sgd(0.1),
    "nesterov": lambda: ft.optim.sgd(0.05, momentum=0.9, nesterov=True),
    "adamw": lambda: ft.optim.adamw(1e-2, weight_decay=0.1),
}


optimizers = st.sampled_from(sorted(OPTIMIZERS))


FAST = settings(deadline=None, max_examples=25, suppress_health_check=[HealthCheck.too_slow])


def two_nodes_on_loopback(script, cwd, env: dict, timeout: float, *script_args) -> list[tuple[int, str, str]]:
    """Run ``script`` as a 2-node job on 127.0.0.1 (``python -m functrain.launch --nnodes 2 --nproc 1``, one
    process per node, started together); returns ``(returncode, stdout, stderr)`` per node. Bounded: each node
    gets ``timeout`` seconds, and any node still running afterwards is killed."""
    import subprocess
    import sys

    from functrain.distributed import free_port

    common = ("--nnodes", 2, "--nproc", 1, "--master-addr", "127.0.0.1", "--master-port", free_port(),
              "--join-timeout", 60, "--dist-timeout", 60)
    procs = [subprocess.Popen([sys.executable, "-m", "functrain.launch", *map(str, common), "--node-rank",
                               str(node), str(script), *map(str, script_args)], cwd=cwd, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for node in (0, 1)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    return [(p.returncode, out, err) for p, (out, err) in zip(procs, outs)]


def kill_when_running(argv: list, delay: float, start_timeout: float = 120.0) -> tuple[int, list]:
    """Start ``argv``, wait for its first output line (it is running), SIGKILL it ``delay`` seconds later.

    Returns ``(returncode, lines)``: every complete line it printed, split into words (a line the kill cut short
    is left out: with ``PYTHONUNBUFFERED=1`` one ``print`` is several writes, and the kill can land between
    them). Bounded: a child that never prints fails the test after ``start_timeout`` seconds, and a child left
    running is killed.
    """
    import signal
    import subprocess
    import threading
    import time

    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    lines: list = []
    ready = threading.Event()

    def reader():
        for line in proc.stdout:
            if line.endswith("\n"):
                lines.append(line.split())
            ready.set()

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    try:
        assert ready.wait(start_timeout), "the child did not start"
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        t.join(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, lines


def donating_loop(run, state, batches, *, refused_by=(), leaves=lambda s: s.params, emptied=False):
    """Step ``run`` (a donating compiled step) over ``batches`` from a copy of ``state``; returns the final state.

    After every step the state passed in must be refused ("donated") by ``run`` and by each of ``refused_by``
    (``emptied``: its ``leaves`` hold no data any more), and the final state's ``leaves`` must be the very storage
    the first copy had (the update went into the donated buffers, never a fresh allocation).
    """
    s = ft.tree.tree_map(torch.clone, state)
    ptrs = [x.data_ptr() for x in ft.tree.tree_leaves(leaves(s))]
    for b in batches:
        old = s
        s, _ = run(s, b)
        for call in (run, *refused_by):
            with pytest.raises(RuntimeError, match="donated"):
                call(old, b)
        if emptied:
            assert all(t.numel() == 0 for t in ft.tree.tree_leaves(leaves(old))), "a donated leaf still holds data"
    assert [x.data_ptr() for x in ft.tree.tree_leaves(leaves(s))] == ptrs, "the new state did not reuse the storage"
    return s


def vec(tree) -> torch.Tensor:
    """All leaves of a tree as one float64 vector."""
    return torch.cat([x.detach().double().flatten() for x in optree.tree_leaves(tree)])


def update_of(new_params, old_params) -> torch.Tensor:
    return vec(new_params) - vec(old_params)


def train_state_parts(state):
    """What an update changes: params, optimizer state and the EMA (if any)."""
    return state.params, state.opt_state, state.slots.get("ema")


class Probe(ft.Transform):
    """Records the gradients as they are at its place in the ``transform`` stage."""

    def __init__(self, name="probe", order=1000):
        self.name, self.order = name, order

    def transform(self, ctx):
        ctx.metrics[self.name] = ctx.grads


class ScaleGrads(ft.Transform):
    """A user transform: multiply the gradients by a constant (stage ``transform``)."""

    name = "scale_grads"

    def __init__(self, factor, order=50):
        self.factor, self.order = factor, order

    def transform(self, ctx):
        ctx.grads = ft.tree.tree_scale(ctx.grads, self.factor)


class GradNoise(ft.Transform):
    """The Transform docstring's example: Gaussian gradient noise, with a count in its slot."""

    name = "grad_noise"
    order = 50

    def __init__(self, std):
        self.std = std

    def init(self, params, buffers):
        return {"count": torch.zeros((), dtype=torch.int64)}

    def transform(self, ctx):
        ctx.grads = ft.tree.tree_map(lambda g: g + self.std * torch.randn_like(g), ctx.grads)
        ctx.set_slot(self, {"count": ctx.slot(self)["count"] + 1})


def shifted(batch, i):
    """The i-th of a sequence of distinct batches made from one."""
    x, y = batch
    return x + 0.1 * i, y - 0.05 * i


def with_value(batch, value, row=0, col=0):
    x, y = batch
    x = x.clone()
    x[row % x.shape[0], col % x.shape[1]] = value
    return x, y


def fixed_problem(seed=0):
    gen = torch.Generator().manual_seed(seed)
    params = {"w0": torch.randn(6, 8, generator=gen) / 6**0.5, "b0": torch.randn(8, generator=gen) * 0.1,
              "w1": torch.randn(8, 3, generator=gen) / 8**0.5, "b1": torch.zeros(3)}
    batches = [(torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)) for _ in range(10)]
    return params, batches

# -- shared by the remat tests (tests/core/test_remat.py, tests/compiler/test_compiled_remat.py) ---------------
aten = torch.ops.aten


class Block(torch.nn.Module):
    """A residual MLP block: norm, Linear, GELU, optional dropout, Linear. ``calls`` counts its forward runs."""

    def __init__(self, width: int, norm: str, dropout: bool):
        super().__init__()
        self.norm = {"ln": torch.nn.LayerNorm(width), "bn": torch.nn.BatchNorm1d(width), "none": torch.nn.Identity()}[norm]
        self.fc1 = torch.nn.Linear(width, 2 * width)
        self.fc2 = torch.nn.Linear(2 * width, width)
        self.drop = torch.nn.Dropout(0.3) if dropout else torch.nn.Identity()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return x + self.fc2(self.drop(torch.nn.functional.gelu(self.fc1(self.norm(x)))))


class Net(torch.nn.Module):
    def __init__(self, width=6, depth=2, norm="ln", dropout=False):
        super().__init__()
        self.blocks = torch.nn.Sequential(*[Block(width, norm, dropout) for _ in range(depth)])
        self.head = torch.nn.Linear(width, 1)

    def forward(self, x):
        return self.head(self.blocks(x))


def torch_policy(ctx, op, *args, **kwargs):
    """torch's selective-checkpoint policy form: keep the matmuls."""
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if op in (aten.mm.default, aten.addmm.default) else CheckpointPolicy.PREFER_RECOMPUTE


POLICIES = {"nothing_saveable": "nothing_saveable", "dots_saveable": "dots_saveable",
            "dots_with_no_batch_dims_saveable": "dots_with_no_batch_dims_saveable",
            "ops": {aten.addmm.default, aten.gelu}, "torch_policy": torch_policy}
TRANSFORMS = {"accumulate": lambda: ft.accumulate(2), "bf16": lambda: ft.mixed_precision("bf16"),
              "fp16": lambda: ft.mixed_precision("fp16", init_scale=2.0**8, growth_interval=2),
              "clip": lambda: ft.clip(0.05), "ema": lambda: ft.ema(0.5, warmup=False), "skip_nonfinite": lambda: ft.skip_nonfinite()}


def build(*, width=6, depth=2, norm="ln", dropout=False, policy=None, transforms=(), optimizer="adamw", seed=0):
    torch.manual_seed(seed)
    net = Net(width, depth, norm, dropout)
    if policy is not None:
        ft.remat(net.blocks, POLICIES.get(policy, policy) if isinstance(policy, str) else policy)
    apply_fn, params, buffers = ft.functionalize(net)

    def loss_fn(p, b, batch):
        x, y = batch
        return torch.nn.functional.mse_loss(apply_fn(p, b, x), y)

    step = ft.train_step(loss_fn, OPTIMIZERS[optimizer]())
    for name in transforms:
        step = TRANSFORMS[name]()(step)
    return net, step, step.init(params, buffers, seed=seed)


def batches(width, n=2, rows=8, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, width, generator=g), torch.randn(rows, 1, generator=g)) for _ in range(n)]


def run(step, state, data):
    for b in data:
        state, metrics = step(state, b)
    return state, metrics


def max_diff(a, b) -> float:
    return max((float((x.double() - y.double()).abs().max()) for x, y in zip(T.tree_leaves(a), T.tree_leaves(b))
                if torch.is_tensor(x) and x.is_floating_point() and x.numel()), default=0.0)


def hf_step(checkpointing: bool, offload: bool = False):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    model = transformers.LlamaForCausalLM(cfg)
    model.train()
    if checkpointing:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # the deprecated alias is what most scripts call
            if offload:
                model.activation_checkpointing_enable(offload=True)
            else:
                model.gradient_checkpointing_enable()
    calls = []
    for layer in model.model.layers:
        layer.register_forward_pre_hook(lambda m, a, k: calls.append(1), with_kwargs=True)
        layer.self_attn.register_forward_hook(lambda m, a, o: calls.append(2))  # inside the checkpointed forward
    apply_fn, params, buffers = ft.functionalize(model)

    def loss_fn(p, b, ids):
        return apply_fn(p, b, input_ids=ids, labels=ids).loss

    step = ft.train_step(loss_fn, ft.optim.sgd(1.0))
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    return model, step, step.init(params, buffers), ids, calls


class CountHostPulls(TorchDispatchMode):
    """Counts ``aten._local_scalar_dense``: what .item(), float(t), bool(t) and .tolist() run to read a value."""

    def __init__(self):
        super().__init__()
        self.pulls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.pulls += 1
        return func(*args, **(kwargs or {}))


# -- per-block gathering: the model and step its tests share (data_parallel(shard="params", blocks=model)) ------
class BlockwiseBlock(torch.nn.Module):
    def __init__(self, width: int, scaled: bool):
        super().__init__()
        self.lin = torch.nn.Linear(width, width)
        # a float64 parameter in one block: its pieces come from a second flat buffer
        self.scale = torch.nn.Parameter(torch.full((width,), 0.9, dtype=torch.float64)) if scaled else None

    def forward(self, x):
        y = torch.tanh(self.lin(x))
        return y * self.scale.to(y.dtype) if self.scale is not None else y


class BlockwiseNet(torch.nn.Module):
    """7 -> 5 wide, 3 blocks (odd sizes: a rank's shard ends inside a block), an input and an output layer."""

    def __init__(self, depth: int = 3, width: int = 5, scaled: int = 1):
        super().__init__()
        self.inp = torch.nn.Linear(7, width)
        self.blocks = torch.nn.ModuleList([BlockwiseBlock(width, i == scaled) for i in range(depth)])
        self.out = torch.nn.Linear(width, 3)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.out(x)


def _blockwise_transforms(config: str, micro: int) -> list:
    return {"plain": [], "accumulate": [ft.accumulate(micro)], "clip": [ft.clip(0.05)], "ema": [ft.ema(0.5, warmup=False)],
            # (fp16 rounding depends on the rows grouped: the reference accumulates the same micro-batches)
            "fp16": [ft.accumulate(micro), ft.mixed_precision("fp16", init_scale=256.0)],
            "all": [ft.accumulate(micro), ft.clip(0.05), ft.ema(0.5, warmup=False), ft.mixed_precision("bf16")]}[config]


def blockwise_problem(config: str, policies=("nothing_saveable", "everything_saveable", "dots_saveable"), micro: int = 2,
             depth: int = 3, seed: int = 0):
    """(model, step, params, buffers, batch): :class:`BlockwiseNet` with each block marked by ``ft.remat`` with the
    policy at its index (``None``: unmarked), its step with ``config``'s transforms (``micro`` micro-batches), and
    8 rows; tests/distributed/test_blockwise.py and the CUDA tests share it."""
    torch.manual_seed(seed)
    model = BlockwiseNet(depth, scaled=-1 if config in ("fp16", "all") else 1)  # (mixed precision takes fp32 params only)
    for block, policy in zip(model.blocks, policies):
        if policy is not None:
            ft.remat(block, policy)
    apply_fn, params, buffers = ft.functionalize(model)
    g = torch.Generator().manual_seed(seed + 1)
    batch = (torch.randn(8, 7, generator=g), torch.randn(8, 3, generator=g))

    def loss(params, buffers, batch):
        return torch.nn.functional.mse_loss(apply_fn(params, buffers, batch[0]).float(), batch[1])

    step = ft.train_step(loss, ft.optim.adamw(1e-2))
    for t in _blockwise_transforms(config, micro):
        step = t(step)
    return model, step, params, buffers, batch
