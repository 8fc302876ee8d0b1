"""``ft.memory``: what a step will hold and allocate on this rank, from its capture, before it runs.

The state's bytes are counted from the state itself (each storage once: the flat state's views of one buffer
count one buffer), by part. The step's peak comes from the graph ``ft.compile`` captures (the same trace, so
for a :class:`~functrain.CompiledStep` the first call compiles this very capture instead of tracing again):
a walk over its nodes in order, each output that is not a view of a live tensor allocates its storage, and a
storage is freed after the last node that reads it; graph inputs (the state, the batch, donated buffers)
exist already and are never freed; an in-place write into an input (donation, recycled buffers) allocates
nothing. The largest sum of live allocations is the step's peak above what exists before the call. Without
donation the new state's large CPU leaves go to recycled buffers (one more state-sized set held while the
step runs); that set is reported apart (``new_state``).

Why this walk and not inductor's own scheduler estimate: it needs no compile (seconds, not minutes), and the
recomputation functrain's remat adds is tied to the backward (:func:`functrain.core.recompute.tie`), so inductor
runs the graph in an order of the same peak: fusion removes short-lived elementwise intermediates, which
rarely meet at the peak. Measured against donated inductor steps (bench/remat.py, tests/compiler/peak_job.py):
within 4% of the peak counted at torch's allocator (:func:`allocated_peak`) on the transformer workloads with
and without remat, and within 20% of the RSS high-water mark, which malloc's reuse of small blocks makes
scatter; collectives' internal buffers (gloo's reduce-scatter copies its input) are outside any graph and are
added per collective (see ``_COLLECTIVES``).

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

from ..core.state import TrainState
from ..core.step import Step

__all__ = ["MemoryEstimate", "estimate_graph", "state_bytes", "device_memory", "memory", "allocated_peak"]

_GiB = float(1 << 30)


def _fmt(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def _round(nbytes: int, device: torch.device) -> int:
    if device.type == "cuda":
        return (nbytes + 511) // 512 * 512
    if nbytes >= 1 << 16:
        return (nbytes + 4095) // 4096 * 4096
    return (nbytes + 15) // 16 * 16


def _storage_key(t: torch.Tensor) -> Any:
    from torch.multiprocessing.reductions import StorageWeakRef
    return StorageWeakRef(t.untyped_storage())


def _tensors(value: Any) -> list:
    return [t for t in optree.tree_leaves(value) if isinstance(t, torch.Tensor)]


# A collective whose backend copies its input into a buffer of its own (outside the graph): that many more
# bytes while it runs. gloo's reduce-scatter allocates a whole-size buffer inside (sharding.py's note: +358 MiB
# of peak for a 190 MiB input); NCCL's collectives work in place.
_COLLECTIVES = {"reduce_scatter_tensor": 1.0, "all_reduce": 0.0, "all_gather_into_tensor": 0.0}


# How inductor treats a node, as far as memory goes: elementwise ops (and casts, clones, the optimizers'
# _foreach_ lists) are fused into the kernel of their consumer when every consumer can take them in (another
# elementwise op, a reduction, an in-place write into an input); then their result is never a buffer.
# Anything else (matmuls, attention, embeddings, collectives, sorts, a graph output) reads materialized
# buffers, and a fused value read more than _REALIZE_READS times is materialized too (inductor's
# realize_reads_threshold).
_REALIZE_READS = 4
_aten = torch.ops.aten
_FUSED = {_aten._to_copy.default, _aten.clone.default}


def _op(n: Any) -> Any:
    return n.target if n.op == "call_function" else None


def _is_view(n: Any) -> bool:
    op = _op(n)
    return isinstance(op, torch._ops.OpOverload) and any(r.alias_info is not None and not r.alias_info.is_write
                                                         for r in op._schema.returns)


def _fusable(n: Any) -> bool:
    op = _op(n)
    if not isinstance(op, torch._ops.OpOverload):
        return False
    return torch.Tag.pointwise in op.tags or op in _FUSED or op._schema.name.startswith("aten::_foreach_")


def _absorbs(u: Any) -> bool:
    op = _op(u)
    if op is None:
        return False
    if _fusable(u) or op is _aten.copy_.default or (isinstance(op, torch._ops.OpOverload)
                                                    and torch.Tag.reduction in op.tags):
        return True
    if _is_getitem(u):  # a _foreach_ list's element
        return all(_absorbs(v) for v in u.users)
    return _is_view(u) and all(_absorbs(v) for v in u.users)


def _is_getitem(n: Any) -> bool:
    op = _op(n)
    return op is not None and getattr(op, "__module__", "") == "_operator" and op.__name__ == "getitem"


def _materialized(n: Any) -> bool:
    if n.op != "call_function":
        return n.op == "placeholder"
    if _is_getitem(n):  # an element of a _foreach_ list (or of a multi-output op): a buffer if its producer is
        return _materialized(n.args[0])
    if not _fusable(n):
        return True
    readers = [v for u in n.users for v in (u.users if _is_getitem(u) else (u,))]  # a list's: per element
    if len(readers) > _REALIZE_READS * (len(n.users) if any(map(_is_getitem, n.users)) else 1):
        return True
    return not all(_absorbs(u) for u in n.users)


def estimate_graph(gm: torch.fx.GraphModule, device: torch.device, backend: str | None = None) -> tuple[int, str]:
    """``(peak bytes, the op at the peak)`` a traced graph allocates above its inputs, walking its nodes in order
    with inductor's fusion in mind (an elementwise result its consumers take in is never a buffer).

    ``backend`` (a process group backend name, ``"gloo"``/``"nccl"``) adds the internal buffers of its
    collectives (see ``_COLLECTIVES``).

    Example::

        >>> import torch
        >>> from torch.fx.experimental.proxy_tensor import make_fx
        >>> from functrain.compiler.estimate import estimate_graph
        >>> gm = make_fx(lambda x: (x @ x).sin().sum(), tracing_mode="fake")(torch.ones(1024, 1024))
        >>> peak, at = estimate_graph(gm, torch.device("cpu"))
        >>> peak // 2**20, at          # x @ x: 4 MiB; its sine is fused into the sum (a scalar)
        (4, 'sum')
    """
    nodes = list(gm.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    real = {n: _materialized(n) for n in nodes}
    # when a node's value is read: at its own position if it is a buffer, else when its consumers' kernel runs
    when: dict = {}
    for n in reversed(nodes):
        if real.get(n, True) or not n.users:
            when[n] = index[n]
        else:
            when[n] = max(when.get(u, index[u]) for u in n.users)
    last: dict = {}
    for n in nodes:
        for a in n.all_input_nodes:
            last[a] = max(last.get(a, -1), when.get(n, index[n]))
    holders: dict = {}   # storage -> the nodes whose value lives on it and is still needed
    sizes: dict = {}     # storage -> bytes allocated for it (0: an input, or not a buffer)
    outputs: set = set()
    for n in nodes:
        if n.op == "output":
            outputs.update(id(t) for a in n.all_input_nodes for t in _tensors(a.meta.get("val")))
    live = peak = 0
    peak_at = "inputs"
    expiring: dict = {}  # position -> nodes whose last read is there
    for a, i in last.items():
        expiring.setdefault(i, []).append(a)
    for i, n in enumerate(nodes):
        value = n.meta.get("val")
        if n.op == "placeholder":
            for t in _tensors(value):
                sizes[_storage_key(t)] = 0
            continue
        if n.op == "output":
            break
        extra = 0
        for t in _tensors(value):
            key = _storage_key(t)
            if key not in sizes:  # a new storage (a view of a live one shares it)
                sizes[key] = _round(t.untyped_storage().nbytes(), device) if real[n] else 0
                live += sizes[key]
            holders.setdefault(key, set()).add(n)
        if backend == "gloo" and n.op == "call_function":
            name = getattr(n.target, "__name__", str(n.target)).split(".")[0]
            share = _COLLECTIVES.get(name, 0.0)
            if share:
                extra = int(share * sum(t.untyped_storage().nbytes() for a in n.all_input_nodes
                                        for t in _tensors(a.meta.get("val"))))
        if live + extra > peak:
            peak, peak_at = live + extra, getattr(n.target, "__name__", str(n.target))
        for a in (*expiring.get(i, ()), *([n] if n not in last else ())):  # free what no later node reads
            if a.op == "placeholder":
                continue
            for t in _tensors(a.meta.get("val")):
                if id(t) in outputs:
                    continue
                key = _storage_key(t)
                held = holders.get(key)
                if held is None:
                    continue
                held.discard(a)
                if not held:
                    del holders[key]
                    live -= sizes.get(key, 0)
                    sizes[key] = 0
    return peak, peak_at.split(".")[0]


def state_bytes(state: Any) -> dict[str, int]:
    """The bytes a state holds on its device, by part: ``params``, ``optimizer``, ``buffers``, each slot by name
    (``slots/ema``), and ``other`` (step counter, RNG key); each storage counted once, in its first part.

    Example::

        >>> import torch
        >>> from functrain.compiler.estimate import state_bytes
        >>> import functrain as ft
        >>> step = ft.ema(0.9)(ft.train_step(lambda p, b, x: (p["w"] * x).sum(), ft.optim.adamw(1e-3)))
        >>> parts = state_bytes(step.init({"w": torch.zeros(1024)}))
        >>> parts["params"], parts["optimizer"] >= 8192, parts["slots/ema"]   # the EMA: params and a counter
        (4096, True, 4104)
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
            text += " (the step's peak is estimated for a compiled step: TrainConfig(compile=True))"
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
    from .api import CompiledStep
    from .capture import CaptureError, trace
    from .runtime import DynamoRunner, Runner

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
    cap = direct.traced(state, batch) if direct is not None else None  # (a Dynamo runner keeps none)
    if cap is None:
        from .errors import explain

        s = state._replace(rng=None)
        try:
            cap = trace(inner.apply, s, batch, kind)
        except CaptureError as e:
            raise explain(inner, e.__cause__ or e, state, batch, tracer="make_fx") from e
    backend = None
    if inner._shards_state or any(t.name == "data_parallel" for t in inner.transforms):
        import torch.distributed as dist
        backend = dist.get_backend() if dist.is_available() and dist.is_initialized() else None
    peak, at = estimate_graph(cap.gm, device, backend)
    recycled = 0
    if cap.memory.recycle:
        tensors = [t for t in optree.tree_leaves(state._replace(rng=None)) if isinstance(t, torch.Tensor)]
        recycled = sum(_round(tensors[k].untyped_storage().nbytes(), device) for k in cap.memory.recycle)
    elif not donate:  # the new state is fresh memory (no recycling off the CPU)
        recycled = sum(state_bytes(state).values())
    batch_bytes = sum(t.untyped_storage().nbytes() for t in _tensors(batch) if t.device == device)
    est = MemoryEstimate(device=device, state=state_bytes(state), batch=batch_bytes, step_peak=peak, peak_at=at,
                         new_state=recycled, capacity=device_memory(device))
    message = est.over()
    if message:
        warnings.warn(message, RuntimeWarning, stacklevel=2)
    return est


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
