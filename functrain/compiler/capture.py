"""Capture: trace the step once over the flat leaves of ``(state, batch)`` into one aten graph.

``make_fx`` traces ``step.apply`` with fake tensors, so a host sync or a Python branch on
a tensor value fails the trace instead of being baked in. The step computes its gradients
inside (``torch.func.grad_and_value``, traced down to aten ops; ``is_compiling()`` is
true while tracing, as under ``torch.compile``), so the graph is forward-only from the
outside: the backend sees an inference graph with no autograd at its boundary. Tensor
constants become trailing graph inputs (read at call time). The :class:`Signature`
records what the graph was built for; the graph's :class:`Captured` record is what the
runtime (:mod:`functrain.compiler.runtime`) calls. Where the new state goes (fresh memory,
recycled buffers, the donated input) is the capture's :class:`~functrain.compiler.memory.Memory`.

Randomness: the capture records whether the graph draws random numbers (aten ops tagged
``nondeterministic_seeded``). When it does not, a call only advances the state's RNG
counter (no generator save/restore).
"""
from __future__ import annotations

import contextlib
import importlib
import operator
import sys
import threading
from typing import Any, Callable, Iterator

import optree
import torch

from ..core import regions
from ..core.rng import HostRandomError, host_random_refused
from .host_draws import RECORDER_CODES, recording
from .fx_tracing import FX_TRACING
from .host_sync import HostSync, data_dependent, no_print, users_frame
from .memory import Memory, Written
from .rewrites import own_small_views, reshape_views

__all__ = ["Captured", "Signature", "CaptureError", "trace", "draws_random", "flatten", "tensor_metas", "preload",
           "importing", "wait_for_imports"]


class CaptureError(RuntimeError):
    """The step could not be traced as one graph (wraps the tracer's own error)."""


# -- the signature: what a captured graph was built for -------------------------------------------
class Signature:
    """The input signature of one capture: treespec, per-tensor metadata, non-tensor values.

    ``tensors(leaves, trusted)`` is the per-call check: it is exact (a differing stride
    counts, because the compiled kernels index with the strides they were built for).
    The first ``n_state`` tensors are the state's; when they are the very tensor objects
    the previous call returned (``trusted``, whose metadata was checked once against
    this signature), only the batch's tensors are checked.
    """

    __slots__ = ("spec", "tensor_pos", "metas", "consts", "key", "n_state", "batch_metas")

    def __init__(self, spec: Any, leaves: list, n_state_leaves: int):
        self.spec = spec
        self.tensor_pos = tuple(i for i, x in enumerate(leaves) if torch.is_tensor(x))
        self.metas = tuple(_meta(leaves[i]) for i in self.tensor_pos)
        self.n_state = sum(1 for i in self.tensor_pos if i < n_state_leaves)
        self.batch_metas = self.metas[self.n_state:]
        tensor_pos = set(self.tensor_pos)
        self.consts = tuple((i, type(x), x) for i, x in enumerate(leaves) if i not in tensor_pos)
        self.key = (spec, self.metas, tuple((i, t, _hashable(v)) for i, t, v in self.consts))

    def tensors(self, leaves: list, trusted: list | None = None) -> list | None:
        """The tensor leaves if ``leaves`` (flattened with ``spec``) match this signature, else ``None``."""
        try:
            tensors = [leaves[i] for i in self.tensor_pos]
        except IndexError:
            return None
        if trusted is not None and all(map(operator.is_, trusted, tensors)):
            check, metas = tensors[self.n_state:], self.batch_metas
        else:
            check, metas = tensors, self.metas
        for x, (shape, stride, dtype, device) in zip(check, metas):
            if not isinstance(x, torch.Tensor) or x.shape != shape or x.dtype != dtype or x.stride() != stride \
                    or x.device != device:
                return None
        for i, typ, value in self.consts:
            v = leaves[i]
            if type(v) is not typ or v != value:
                return None
        return tensors

    def state_matches(self, tensors: list) -> bool:
        """Whether ``tensors`` (a new state's tensor leaves) have this signature's state metadata."""
        return len(tensors) == self.n_state and all(
            isinstance(x, torch.Tensor) and _meta(x) == m for x, m in zip(tensors, self.metas[:self.n_state]))


def _meta(x: torch.Tensor) -> tuple:
    return (x.shape, x.stride(), x.dtype, x.device)


def tensor_metas(tensors: list) -> tuple:
    """``(shape, stride, dtype, device)`` of each tensor: what a graph is compiled for, and all that a process
    without the tensors (a background worker) needs to compile it."""
    return tuple((tuple(t.shape), tuple(t.stride()), t.dtype, t.device) for t in tensors)


def _hashable(v: Any) -> Any:
    try:
        hash(v)
    except TypeError:
        return repr(v)
    return v


def flatten(spec: Any, tree: Any) -> list | None:
    """The leaves of ``tree`` under ``spec``, or ``None`` if its structure differs (types, keys, arity)."""
    try:
        return spec.flatten_up_to(tree)
    except (ValueError, TypeError):
        return None


# -- randomness -----------------------------------------------------------------------------------
_RNG_NAMES = ("rng", "seed", "philox")


def draws_random(gm: torch.fx.GraphModule) -> bool:
    """Whether a traced graph draws random numbers (or touches generator state), its subgraphs included
    (a reused block region draws inside its own graph)."""
    tag = torch.Tag.nondeterministic_seeded
    for module in gm.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        for node in module.graph.nodes:
            if node.op != "call_function":
                continue
            target = node.target
            if tag in getattr(target, "tags", ()):
                return True
            name = str(getattr(target, "__name__", target)).lower()
            if any(s in name for s in _RNG_NAMES):
                return True
    return False


# -- the record of one capture ----------------------------------------------------------------------
class Captured:
    """One traced graph for one :class:`Signature`, and (once compiled) the code that runs it.

    Attributes:
        signature:  what it was built for.
        gm:         the traced aten graph (constants lifted to trailing inputs).
        inputs:     its example inputs (``tensors + recycled buffers + constants``), for packages.
        metas:      their ``(shape, stride, dtype, device)``: what the backend compiles the graph for.
        fn:         the compiled callable over ``tensors + buffers + constants`` (``None`` until compiled;
                    a mode such as CUDA graphs wraps it, keeping its calling convention).
        constants:  tensors the step closes over (lifted from the trace to graph inputs).
        memory:     where the new state goes (:class:`~functrain.compiler.memory.Memory`).
        out_spec:   treespec of what the graph gives back (``(new_state, metrics)``, or the metrics when donating).
        out_plan:   per output leaf: ``None`` (the next graph output), a :class:`Written` buffer, or ``("const", v)``.
        random:     whether the graph draws random numbers.
        step_index: where the state's step counter sits among the tensors (``None``: not a TrainState).
        stable:     ``None`` until the first call, then whether the outputs have the inputs' signature.
        walk_gm:    the traced graph, kept after compiling (which drops ``gm``) for :func:`functrain.memory`'s walk
                    until it takes it (:meth:`take_walk`): the Trainer's memory line never traces again.
        draws:      the Python draws the step branched on while traced (a
                    :class:`~functrain.compiler.host_draws.DrawPlan`: the capture holds one outcome), or ``None``.
        warm:       ``(pre-trace key, output treespec's text)`` for a capture rebuilt from a warm entry whose first
                    call has not been checked yet (:mod:`functrain.compiler.warm`; its ``out_spec`` is set then),
                    else ``None``.
    """

    __slots__ = ("signature", "gm", "inputs", "metas", "fn", "constants", "memory", "out_spec", "out_plan", "random",
                 "n_state", "state_spec", "trivial_out", "stable", "step_index", "draws", "walk_gm", "warm")

    def __init__(self, **kw: Any):
        for k, v in kw.items():
            setattr(self, k, v)

    def take_walk(self) -> torch.fx.GraphModule | None:
        """The traced graph for a memory estimate (``gm``, or the one kept after compiling), released here."""
        gm, self.walk_gm = self.gm if self.gm is not None else self.walk_gm, None
        return gm

    @property
    def recycle(self) -> tuple:
        """The state tensors offered a recycled buffer (see :class:`~functrain.compiler.memory.Memory`)."""
        return self.memory.recycle

    @property
    def recycled(self) -> tuple:
        """The recycled buffers the graph writes (see :class:`~functrain.compiler.memory.Memory`)."""
        return self.memory.recycled

    @property
    def graphed(self) -> Any:
        """The CUDA graph replaying :attr:`fn`, or ``None``."""
        from .cudagraph import GraphedCall
        return self.fn if isinstance(self.fn, GraphedCall) else None

    def outputs(self, graph_out: list, written: list = ()) -> list:
        """The output leaves from the graph's outputs (and ``written``: the caller's tensors on the recycled
        buffers, in buffer order)."""
        if self.trivial_out:
            return graph_out
        it = iter(graph_out)
        return [next(it) if p is None else written[p.j] if isinstance(p, Written) else p[1] for p in self.out_plan]


_preloading: threading.Thread | None = None


def preload() -> None:
    """Import what a trace needs (Dynamo and inductor's config: seconds on a small CPU) in a daemon thread, once per
    process, so that a background-compiled step's first trace need not wait for it while eager calls run."""
    global _preloading
    if _preloading is None:
        def run() -> None:
            for name in ("torch._dynamo", "torch._inductor.config", "torch._inductor.compile_fx"):
                try:
                    importlib.import_module(name)
                except Exception:  # noqa: BLE001 - the trace imports it again and reports what fails
                    return

        _preloading = threading.Thread(target=run, name="functrain-compile-import", daemon=True)
        _preloading.start()


def importing() -> bool:
    """Whether :func:`preload`'s thread is still importing."""
    return _preloading is not None and _preloading.is_alive()


def wait_for_imports() -> None:
    """Wait for :func:`preload`'s imports: every trace does, as two threads importing ``torch._dynamo`` at once
    deadlock in Python's import lock (``_DeadlockError``)."""
    if _preloading is not None:
        _preloading.join()


def trace(apply: Callable, state: Any, batch: Any, memory_kind: str, reuse_blocks: bool = False,
          host_seed: int | None = None) -> Captured:
    """Trace ``apply(state, batch) -> (new_state, metrics)`` over flat leaves (not compiled yet: ``fn`` is ``None``).

    ``state`` must have ``rng=None`` (the caller handles the RNG on the host); ``memory_kind`` is one
    of :data:`functrain.compiler.memory.KINDS`. ``reuse_blocks``: the repeated blocks of functionalized
    modules become one region each (:mod:`functrain.core.regions`); a step whose blocks cannot be traced
    that way is traced flat. ``host_seed``: the seed of Python's ``random`` for the traced step
    (:func:`functrain.core.rng.host_seed` of the state's key): the step's draws from it are recorded and the
    capture holds the branch they decide (:mod:`functrain.compiler.host_draws`); ``None``: a draw is refused.
    """
    wait_for_imports()
    with FX_TRACING:  # (torch's tracer is one per process: another thread's trace or compile waits)
        if reuse_blocks and regions.wanted():
            try:
                return _trace(apply, state, batch, memory_kind, True, host_seed)
            except CaptureError:
                pass  # (a block that is not a region: flat; a step that is not one graph fails again below)
        return _trace(apply, state, batch, memory_kind, False, host_seed)


def _trace(apply: Callable, state: Any, batch: Any, memory_kind: str, reuse: bool,
           host_seed: int | None) -> Captured:
    from torch.fx.experimental.proxy_tensor import make_fx

    leaves, spec = optree.tree_flatten((state, batch))
    n_state = len(optree.tree_leaves(state))
    sig = Signature(spec, leaves, n_state)
    state_spec = optree.tree_structure(state)
    n_in = len(sig.tensor_pos)
    memory = Memory(memory_kind, [leaves[i] for i in sig.tensor_pos[:sig.n_state]])
    record: dict = {}

    def flat(*tensors: torch.Tensor) -> list:
        tensors, buffers = list(tensors[:n_in]), list(tensors[n_in:])
        full = list(leaves)
        for i, t in zip(sig.tensor_pos, tensors):
            full[i] = t
        s, b = optree.tree_unflatten(spec, full)
        new, metrics = apply(s, b)
        out = memory.in_graph(s, new, metrics, tensors, buffers)
        out_leaves, record["spec"] = optree.tree_flatten(out)
        record["plan"] = [x if isinstance(x, Written) else None if torch.is_tensor(x) else ("const", x)
                          for x in out_leaves]
        return [x for x in out_leaves if torch.is_tensor(x)]

    example = [leaves[i].detach() for i in sig.tensor_pos] + memory.example_buffers()

    plans: list = []

    def make(name_calls: bool) -> torch.fx.GraphModule:
        # a draw from random/numpy would be frozen into the graph: refused, but for Python's random with a seed:
        # recorded, the capture holding the branch the draws decide (host_draws)
        draws = recording(host_seed) if host_seed is not None else contextlib.nullcontext()
        with _compiling(), _regions(reuse), host_random_refused("ft.compile", name_calls=name_calls,
                                                                recorded_by=RECORDER_CODES), \
                draws as plan, no_print(), _trace_mode():
            plans[:] = [plan]
            return make_fx(flat, tracing_mode="fake", _allow_non_fake_inputs=True)(*example)

    try:
        try:
            gm = make(False)  # without the profile hook that names a draw: it doubles the trace's time
        except HostRandomError as e:
            if not e.unnamed:
                raise
            make(True)  # something drew from Python's random: trace again to name the call (raises)
            raise e  # (the second trace drew nothing: refuse it unnamed)
    except HostRandomError:
        raise
    except Exception as e:  # noqa: BLE001 - the caller re-runs eagerly to tell a user error from a graph break
        raise CaptureError(f"{type(e).__name__}: {e}") from e
    op = data_dependent(gm)  # traced, but not one graph inductor can compile: a host read, a data-dependent size
    if op is not None:
        raise CaptureError(f"the trace holds {op}, whose value or size depends on the data") \
            from HostSync(op)
    constants = _lift_constants(gm)
    reshape_views(gm)
    own_small_views(gm)
    plan = record["plan"]
    step_t = getattr(state, "step", None)  # a TrainState's step counter (an owned donation re-homes only it)
    step_index = next((k for k, i in enumerate(sig.tensor_pos) if leaves[i] is step_t), None)
    return Captured(signature=sig, gm=gm, inputs=example + constants, metas=tensor_metas(example + constants),
                    fn=None, constants=constants, memory=memory,
                    out_spec=record["spec"], out_plan=plan, random=draws_random(gm), n_state=n_state,
                    state_spec=state_spec, trivial_out=all(p is None for p in plan), stable=None,
                    step_index=step_index, walk_gm=gm, warm=None, draws=plans[0] if plans and plans[0] is not None and plans[0].draws
                    else None)


class _TraceMode(torch.overrides.TorchFunctionMode):
    """While the step is traced: each node gets the model's line that made it, and CPU dropout draws its mask as
    eager's kernel does.

    Lines: ``make_fx`` keeps only the frames of ``forward`` methods in a node's ``stack_trace`` (its nodes made in
    a function, like transformers' ``eager_attention_forward``, are placed at the ``forward`` that called it): the
    innermost frame of the user's code at each torch call is added to the nodes the call made, so that a backend
    that fails on a node names that line (:func:`functrain.compiler.errors.backend_failed`; the stack survives
    AOTAutograd into inductor's nodes).

    Dropout: the trace runs under ``torch.func.grad``, whose dropout (functorch's) draws the mask as a new
    contiguous tensor, while eager's CPU dropout draws it into ``empty_like(input)``, in the input's memory order:
    on a transposed input (Whisper's encoder, after its convolutions) the masks differ (torch 2.13 and 2.14).
    Here ``F.dropout`` on a CPU tensor is eager's own formula, ``input * empty_like(input).bernoulli_(1 - p) /
    (1 - p)``, its mask drawn in eager's order (:func:`_mask_in_memory_order`); elsewhere (CUDA, where eager
    fuses dropout), in place, and ``p`` of 0 or 1, it is left as it is."""

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        from torch.fx.experimental.proxy_tensor import get_proxy_mode

        kwargs = kwargs or {}
        mode = get_proxy_mode()  # (the graph being traced now: a reused block's region has its own)
        graph = mode.tracer.graph if mode is not None else None
        last = next(reversed(graph.nodes), None) if graph is not None else None
        out = _dropout(func, args, kwargs)  # (this mode is off in here: the calls it makes are not seen)
        if graph is not None and next(reversed(graph.nodes), None) is not last:
            where = users_frame(sys._getframe(1))
            if where is not None:
                frame = f'File "{where.file}", line {where.line}, in {where.function}\n    {where.text}'
                for node in reversed(graph.nodes):
                    if node is last:
                        break
                    stack = node.meta.get("stack_trace")
                    node.meta["stack_trace"] = f"{stack}\n  {frame}" if stack else frame
        return out


def _dropout(func: Callable, args: tuple, kwargs: dict) -> Any:
    if func is torch.nn.functional.dropout or func is torch.dropout:
        names = ("input", "p", "training", "inplace") if func is torch.nn.functional.dropout \
            else ("input", "p", "train")
        bound = dict(zip(names, args), **kwargs)
        x, p = bound.get("input"), bound.get("p", 0.5)
        train = bound.get("training", bound.get("train", True))
        # (p a plain number: a drawn one goes to dropout itself, whose use of it is refused there by name)
        if torch.is_tensor(x) and x.device.type == "cpu" and train and type(p) in (int, float) and 0 < p < 1 \
                and not bound.get("inplace"):
            return x * _mask_in_memory_order(x, p)
    return func(*args, **kwargs)


def _mask_in_memory_order(x: torch.Tensor, p: float) -> torch.Tensor:
    """Eager's CPU dropout mask of ``x``: drawn (``bernoulli_``) into ``empty_like(x)``, i.e. in ``x``'s memory
    order. Drawn here into a contiguous tensor of ``x``'s dimensions in memory order, then permuted back: the
    functionalised graph (``bernoulli`` out of place, which draws in logical order) keeps that order."""
    order = sorted(range(x.dim()), key=lambda d: -x.stride(d))
    expected, dense = 1, True
    for d in reversed(order):  # innermost first: each stride is the product of the sizes inside it
        if x.shape[d] != 1:
            dense, expected = dense and x.stride(d) == expected, expected * x.shape[d]
    dims = order if dense else list(range(x.dim()))  # (not dense: empty_like is contiguous, logical order)
    back = sorted(range(len(dims)), key=dims.__getitem__)
    # x.new_empty, not torch.empty: under torch.func.vmap (ft.population) a factory makes an unbatched tensor,
    # and vmap(randomness="different") refuses an in-place draw into it; new_empty of a batched x is batched
    noise = x.new_empty([x.shape[d] for d in dims])
    return noise.bernoulli_(1 - p).div_(1 - p).permute(back)


@contextlib.contextmanager
def _trace_mode() -> Iterator[None]:
    with _TraceMode():
        yield


@contextlib.contextmanager
def _regions(reuse: bool) -> Iterator[None]:
    """Repeated blocks as reused regions while tracing (a tracing context holds the regions' trace cache)."""
    if not reuse:
        yield
        return
    from torch._guards import TracingContext, tracing
    from torch._subclasses.fake_tensor import FakeTensorMode

    with tracing(TracingContext(FakeTensorMode())), regions.reuse_blocks():
        yield


@contextlib.contextmanager
def _compiling() -> Iterator[None]:
    """``torch.compiler.is_compiling()`` is true while the step is traced, as under
    ``torch.compile`` and ``torch.export``: code that branches on it (the step's grad
    stage, user transforms) takes its compiled branch."""
    session = getattr(torch.compiler, "_compile_session_context", None)
    if session is not None:
        with session():
            yield
        return
    old = torch.compiler._is_compiling_flag  # pragma: no cover - older torch
    torch.compiler._is_compiling_flag = True
    try:
        yield
    finally:
        torch.compiler._is_compiling_flag = old


def _lift_constants(gm: torch.fx.GraphModule) -> list:
    """Turn the trace's tensor constants (``get_attr``) into trailing graph inputs.

    The backend then sees a graph whose inputs are exactly what the call passes,
    and a tensor the step closes over is read at call time, not copied at capture.
    """
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    constants = []
    anchor = placeholders[-1] if placeholders else None
    lifted: dict = {}  # attribute name -> its placeholder (several get_attr nodes may read one constant)
    for node in list(graph.nodes):
        if node.op != "get_attr":
            continue
        value = getattr(gm, node.target, None)
        if not torch.is_tensor(value):
            continue
        ph = lifted.get(node.target)
        if ph is None:
            if anchor is None:
                with graph.inserting_before(next(iter(graph.nodes))):
                    ph = graph.placeholder(f"const_{len(constants)}")
            else:
                with graph.inserting_after(anchor):
                    ph = graph.placeholder(f"const_{len(constants)}")
            ph.meta.update(node.meta)
            anchor = lifted[node.target] = ph
            constants.append(value)
        node.replace_all_uses_with(ph)
        graph.erase_node(node)
    for name in lifted:
        delattr(gm, name)
    if constants:
        graph.lint()
        gm.recompile()
    return constants
