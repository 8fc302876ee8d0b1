"""``ft.memory``: what a step will hold and allocate on this rank, from its capture, before it runs.

The state's bytes are counted from the state itself (each storage once: the flat state's views of one buffer
count one buffer), by part. The step's peak comes from the graph ``ft.compile`` captures (the same trace, so
for a :class:`~functrain.CompiledStep` the first call compiles this very capture instead of tracing again),
walked as inductor will run it (:mod:`functrain.compiler.graph_peak`): composite ops decomposed, elementwise
values computed inside the kernels that read them, kernels fused, each buffer allocated by the kernel that
stores it and freed after its last reader; graph inputs (the state, the batch, donated buffers) exist already
and are never freed; a write into an input (donation, recycled buffers) allocates nothing. The largest sum of
live buffers is the step's peak above what exists before the call. Without donation the new state's large CPU
leaves go to recycled buffers (one more state-sized set held while the step runs); that set is reported apart
(``new_state``). Collectives' internal buffers (gloo's reduce-scatter copies its input) are outside any graph
and are added per collective (``graph_peak._COLLECTIVES``).

Why a walk and not inductor's own scheduler: it needs no compile (each composite op of the capture traced alone
through inductor's decompositions, once per op and shapes and kept for the next estimate: under a second, where
tracing the whole capture again took 1-5 s on a tiny BERT). The walk's peak is raised by 5%
(``graph_peak._MARGIN``): measured, it read 0.96-1.11 of the allocator's peak, and an estimate must not be under. Measured (tests/compiler/test_memory_estimate.py, each case a donated inductor step on the
CPU in a fresh process, without remat and with every block ``ft.remat``-ed "nothing_saveable"), the estimate
over the step's peak at torch's allocator (:func:`allocated_peak`) and over the RSS high-water mark:

=================================================  =============  =============
case                                               no remat       remat
=================================================  =============  =============
MLP stack: 4 x (Linear 64->512, GELU, 512->64)     1.10 / 1.10    0.99 / 1.00
MLP: 4 x (Linear 512->512, ReLU)                   1.00 / 1.01
attention, written out: 2 blocks, d 64, T 128      1.04 / 1.10    1.03 / 1.07
attention, scaled_dot_product_attention            1.03 / 1.04    1.08 / 1.09
conv net: 2 x (conv 3x3, BatchNorm, ReLU)          1.00 / 1.01    1.00 / 1.01
transformer LM: 4 layers, d 128, T 256             1.01 / 1.05    1.11 / 1.12
=================================================  =============  =============

These are the walk's ratios before its 5% margin (docs/compiling.md has the cases of issue 36 too: accumulation,
transformer blocks with the softmax written out). The test holds each within 0.9-1.2 of the allocator's peak and
0.8-1.2 of the RSS. The op-by-op walk this replaced
read 0.78 on the MLP stack with remat (the recomputed GELU is fused with GELU's backward, so both are computed, and
held, together), 0.90 on SDPA with remat and 0.83 on the conv net (its channels-last copies). An under-estimate is
the worse error (a run said to fit runs out of memory): what the walk leaves out, inductor writing an output into a
dying input's buffer and its reordering for peak memory, only lowers the real peak, so it errs high (the MLP stack's
1.10: inductor writes GELU's gradient into the matmul output it reads). On bench/remat.py's LMs (T4, T8, T4L) it is
1.01 without remat, 1.12-1.14 with "nothing_saveable", 0.95-0.98 with "dots_saveable" (docs/compiling.md). Not
measured: CUDA (the check in tests/compiler/test_cuda.py is written and skipped without a GPU) and ``reuse_blocks``
regions (the walk does not look inside them).

Allocation sizes are rounded as the device's allocator rounds them: 512 bytes on CUDA (the caching
allocator's block size, what ``torch.cuda.max_memory_allocated`` counts), 4 KiB pages on CPU for blocks of
64 KiB and up (glibc serves those with fresh pages; the bench and tests run with
``MALLOC_MMAP_THRESHOLD_=65536``, so RSS follows them), 16 bytes below.
"""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import optree
import torch

from ..core.rng import host_seed
from ..core.state import TrainState
from ..core.step import Step
from .graph_peak import _round, estimate_graph

__all__ = ["MemoryEstimate", "estimate_graph", "state_bytes", "device_memory", "memory", "allocated_peak", "prepare",
           "Prepared"]

_GiB = float(1 << 30)
_EAGER_NOTE = "the step's peak is estimated for a compiled step: TrainConfig(compile=True)"


def _fmt(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def _storage_key(t: torch.Tensor) -> Any:
    from torch.multiprocessing.reductions import StorageWeakRef
    return StorageWeakRef(t.untyped_storage())


def _tensors(value: Any) -> list:
    return [t for t in optree.tree_leaves(value) if isinstance(t, torch.Tensor)]


def state_bytes(state: Any) -> dict[str, int]:
    """The bytes a state holds on its device, by part: ``params``, ``optimizer``, ``buffers``, each slot by name
    (``slots/ema``), and ``other`` (step counter, RNG key); each storage counted once, in its first part.

    Example::

        >>> import torch
        >>> from functrain.compiler.estimate import state_bytes
        >>> import functrain as ft
        >>> step = ft.ema(0.9)(ft.train_step(lambda p, b, x: (p["w"] * x).sum(), ft.optim.adamw(1e-3)))
        >>> parts = state_bytes(step.init({"w": torch.zeros(1024)}))
        >>> parts["params"], parts["optimizer"] >= 8192, parts["slots/ema"]   # the EMA: params, a counter, 6 values
        (4096, True, 4152)
    """
    seen: set = set()

    def size(tree: Any) -> int:
        total = 0
        for t in _tensors(tree):
            if t.device.type == "meta":
                continue
            key = _storage_key(t)
            if key in seen:
                continue
            seen.add(key)
            total += t.untyped_storage().nbytes()
        return total

    if not isinstance(state, TrainState):
        return {"state": size(state)}
    out = {"params": size(state.params), "optimizer": size(state.opt_state), "buffers": size(state.buffers)}
    for name, slot in state.slots.items():
        out[f"slots/{name}"] = size(slot)
    out["other"] = size((state.step, state.rng))
    return out


def device_memory(device: torch.device) -> int | None:
    """The memory of ``device`` in bytes: a CUDA device's total, or this machine's RAM (capped by a cgroup
    limit, as in a container); ``None`` if unknown."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    if device.type != "cpu":
        return None
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        total = None
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit() and (total is None or int(text) < total):
            total = int(text)
    return total


@dataclass
class MemoryEstimate:
    """What one rank's step holds and allocates (bytes), from :func:`memory`.

    Attributes:
        device: where the state lives.
        state: the state's bytes by part (:func:`state_bytes`).
        batch: the batch's bytes on the device.
        step_peak: the most the compiled step allocates at once above what exists before the call.
        peak_at: the op at which that peak is reached.
        new_state: bytes of the new state's buffers held besides the input state (0 when donating).
        capacity: the device's memory (:func:`device_memory`), or ``None``.
        traced: whether the step was traced (``False``: the state only, ``step_peak`` unknown).
        untraced: why it was not (``None``: an eager step's ``TrainConfig(compile=True)`` hint).

    Args:
        (the attributes below, as :func:`memory` fills them; users read an estimate, they do not build one)

    Example::

        >>> import torch, functrain as ft
        >>> step = ft.train_step(lambda p, b, x: (p["w"] * x).sum(), ft.optim.adamw(1e-3))
        >>> state = step.init({"w": torch.zeros(1024)})
        >>> est = ft.memory(step, state, torch.ones(1024))
        >>> est.state["params"], est.state["optimizer"] >= 2 * 4096
        (4096, True)
    """

    device: torch.device
    state: dict = field(default_factory=dict)
    batch: int = 0
    step_peak: int = 0
    peak_at: str = ""
    new_state: int = 0
    capacity: int | None = None
    traced: bool = True
    untraced: str | None = None

    @property
    def state_total(self) -> int:
        return sum(self.state.values())

    @property
    def total(self) -> int:
        """State + batch + new state + the step's peak: the most this rank holds during a step."""
        return self.state_total + self.batch + self.new_state + self.step_peak

    def __str__(self) -> str:
        parts = ", ".join(f"{k.split('/')[-1]} {_fmt(v)}" for k, v in self.state.items() if v and k != "other")
        text = f"memory per rank on {self.device}: state {_fmt(self.state_total)} ({parts})"
        if not self.traced:
            text += f" ({self.untraced or _EAGER_NOTE})"
            return text
        text += f", step peak +{_fmt(self.step_peak)} (at {self.peak_at})"
        if self.new_state:
            text += f", new state +{_fmt(self.new_state)}"
        text += f", batch {_fmt(self.batch)}: about {_fmt(self.total)}"
        if self.capacity:
            text += f" of {_fmt(self.capacity)} ({100 * self.total / self.capacity:.0f}%)"
        return text

    def over(self) -> str | None:
        """A sentence naming the numbers if the estimate exceeds the device's memory, else ``None``."""
        if not self.capacity or self.total <= self.capacity:
            return None
        return (f"this step needs about {_fmt(self.total)} per rank on {self.device} (state "
                f"{_fmt(self.state_total)}, step peak {_fmt(self.step_peak)} at {self.peak_at}, batch "
                f"{_fmt(self.batch)}), but the device has {_fmt(self.capacity)}: use a smaller batch (or "
                f"ft.accumulate over micro-batches), mark blocks with ft.remat, or shard the state "
                f"(ft.data_parallel(shard='optimizer' or 'params') on several processes)")


def memory(step: Any, state: TrainState, batch: Any, *, donate: bool | None = None) -> MemoryEstimate:
    """Estimate, without running a training step, what ``step`` holds and allocates on this rank.

    The step is traced as :func:`functrain.compile` traces it (no compile, no step run); the state's bytes are
    counted by part and the graph's peak is a walk over its nodes (:mod:`functrain.compiler.estimate`). For a
    :class:`~functrain.CompiledStep` the capture is kept, so its first call compiles it without tracing again.
    Call it on every rank (each counts its own shard of a sharded state). If the total exceeds the device's
    memory it warns, naming the numbers.

    Args:
        step: a :class:`~functrain.Step`, a :class:`~functrain.CompiledStep`, or a runner of one
            (:meth:`~functrain.CompiledStep.runner`: the trace it keeps, or the one its background compile made, is
            the one estimated, and nothing is traced again).
        state: the state it will step (its shapes and devices are what count).
        batch: a batch of the size it will take.
        donate: whether the new state is written into the input's buffers (``ft.run`` donates; default: the
            compiled step's own ``donate``, ``False`` for a plain step).

    Returns:
        A :class:`MemoryEstimate` (``str()`` of it is one line).

    Example::

        >>> import torch, functrain as ft
        >>> step = ft.train_step(lambda p, b, x: (x @ p["w"]).square().mean(), ft.optim.sgd(0.1))
        >>> state = step.init({"w": torch.zeros(256, 256)})
        >>> est = ft.memory(step, state, torch.randn(4096, 256))
        >>> est.state["params"], est.step_peak > 0
        (262144, True)
    """
    est = prepare(step, state, batch, donate=donate).finish()
    message = est.over()
    if message:
        warnings.warn(message, RuntimeWarning, stacklevel=2)
    return est


@dataclass
class Prepared:
    """What :func:`memory` reads from the step and the state, read now (on the caller's thread: the state's bytes
    are its storages' sizes now, before a donating step empties them); :meth:`finish` walks the capture's graph,
    on any thread (the walk only reads the graph, which nothing changes: a compile leaves it as it is).

    Attributes:
        estimate: the :class:`MemoryEstimate` without the step's peak.
        gm: the capture's graph (``None``: not traced; ``estimate.traced`` is ``False``).
        backend: the process group's backend, for the collectives' buffers (``None``: none).
    """

    estimate: MemoryEstimate
    gm: Any = None
    backend: str | None = None

    def finish(self) -> MemoryEstimate:
        """The estimate, the graph walked (seconds on a large graph on a small CPU)."""
        est = self.estimate
        if self.gm is not None:
            est.step_peak, est.peak_at = estimate_graph(self.gm, est.device, self.backend)
        return est


def prepare(step: Any, state: TrainState, batch: Any, *, donate: bool | None = None, trace: bool = True) -> Prepared:
    """The part of :func:`memory` that reads the step and the state (see :class:`Prepared`); ``trace=False``: never
    trace: a runner's kept capture (the one its background compile traced) or, without one, the state's bytes
    alone (``traced=False``, saying so): what the Trainer's memory line uses after the first step."""
    from .api import CompiledStep
    from .capture import CaptureError, trace as trace_step
    from .dynamo_runner import DynamoRunner
    from .runtime import Runner

    runner = step if isinstance(step, (Runner, DynamoRunner)) else None
    if runner is not None:
        donate = (runner.memory != "fresh" if isinstance(runner, Runner) else runner.call.donate) \
            if donate is None else bool(donate)
        inner = runner.step
    elif isinstance(step, CompiledStep):
        donate = step.donate if donate is None else bool(donate)
        inner = step.step
    elif isinstance(step, Step):
        donate, inner = bool(donate), step
    else:
        raise TypeError(f"ft.memory takes a functrain Step, CompiledStep or runner; got {type(step).__name__}")
    if not isinstance(state, TrainState):
        raise TypeError(f"ft.memory takes the TrainState the step will run on; got {type(state).__name__}")
    inner.check_state(state)
    leaves = [t for t in optree.tree_leaves(state.params) if isinstance(t, torch.Tensor)]
    device = leaves[0].device if leaves else torch.device("cpu")
    kind = "owned" if donate else "fresh"
    direct = step.direct(donate) if isinstance(step, CompiledStep) else runner
    if not trace:
        cap = _kept(direct, state, batch) if isinstance(direct, Runner) else None
        if cap is None:
            return Prepared(MemoryEstimate(device=device, state=state_bytes(state), traced=False,
                                           capacity=device_memory(device),
                                           untraced="the step's peak unknown: no trace of it was kept"))
    else:
        cap = direct.traced(state, batch) if direct is not None else None  # (a Dynamo runner keeps none)
    if cap is None:
        from .errors import explain

        s = state._replace(rng=None)
        try:
            cap = trace_step(inner.apply, s, batch, kind, host_seed=host_seed(state.rng))
        except CaptureError as e:
            raise explain(inner, e.__cause__ or e, state, batch, tracer="make_fx") from e
    backend = None
    if inner._shards_state or any(t.name == "data_parallel" for t in inner.transforms):
        import torch.distributed as dist
        backend = dist.get_backend() if dist.is_available() and dist.is_initialized() else None
    recycled = 0
    if cap.memory.recycle:
        tensors = [t for t in optree.tree_leaves(state._replace(rng=None)) if isinstance(t, torch.Tensor)]
        recycled = sum(_round(tensors[k].untyped_storage().nbytes(), device) for k in cap.memory.recycle)
    elif not donate:  # the new state is fresh memory (no recycling off the CPU)
        recycled = sum(state_bytes(state).values())
    batch_bytes = sum(t.untyped_storage().nbytes() for t in _tensors(batch) if t.device == device)
    est = MemoryEstimate(device=device, state=state_bytes(state), batch=batch_bytes, new_state=recycled,
                         capacity=device_memory(device))
    return Prepared(est, cap.take_walk() if not trace else cap.gm, backend)


def _kept(runner: Any, state: TrainState, batch: Any) -> Any:
    """The capture a runner's background compile traced for ``(state, batch)`` (compiling, or compiled already:
    its graph kept for this walk), or ``None``."""
    from .host_draws import OutcomeKey
    from .runtime import signature_key

    key = signature_key(state._replace(rng=None), batch)[1]
    cap = runner.background.traced(key) if runner.background is not None else None
    if cap is not None:
        return cap
    for k, cap in runner.graphs.captures.items():  # (one capture per outcome of the step's Python draws)
        if (k == key or (isinstance(k, OutcomeKey) and k.base == key)) and (cap.gm is not None or
                                                                           cap.walk_gm is not None):
            return cap
    return None


def allocated_peak(fn: Callable[..., Any], *args: Any) -> tuple[int, Any]:
    """``(bytes, fn(*args))``: the most bytes the tensors ``fn`` creates hold at once, counted at torch's allocator.

    What :func:`memory`'s step peak is checked against (bench/remat.py, tests/compiler/test_memory_estimate.py):
    torch.profiler's memory profile of the call, every tensor's create and destroy (CPU included), so unlike a
    process's RSS it sees blocks malloc reuses without asking the system, and it does not count what malloc
    keeps. Tensors alive before the call are not counted. It runs ``fn`` once, under the profiler (slower).

    Example::

        >>> import torch
        >>> from functrain.compiler.estimate import allocated_peak
        >>> n, y = allocated_peak(lambda x: (x * 2).sum(), torch.ones(1024))
        >>> n >= 4096, float(y)
        (True, 2048.0)
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                 with_stack=True) as prof:
        out = fn(*args)
    live = peak = 0
    for _, action, _, size in prof._memory_profile().timeline:  # (torch's memory profile; a private API)
        name = getattr(action, "name", str(action))
        if name == "CREATE":
            live += size
        elif name == "DESTROY":
            live -= size
        peak = max(peak, live)
    return peak, out
