"""Backends: compile a captured graph (inductor by default), and the Dynamo path (``torch.compile`` per call).

:class:`CountingBackend` wraps any ``torch.compile`` backend and counts the graphs it
compiles (``CompiledStep.compiles``); inductor's graphs compile under a machine-wide lock
per graph with inductor's CPU probes memoized (:mod:`functrain.compiler.cache`).
:func:`compile_captured` turns a :class:`~functrain.compiler.capture.Captured` into code:
a package when asked for (:mod:`functrain.compiler.package`), else the backend, wrapped as
a CUDA graph when the options ask and the capture allows (:mod:`functrain.compiler.cudagraph`).
:class:`DynamoCall` is the other path: ``torch.compile`` of the step itself, with its
guards and frame on every call, for what only Dynamo does (graph breaks, dynamic shapes,
inductor's own CUDA graphs, extra ``torch.compile`` arguments).
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import sys
import types
import warnings
from typing import Any, Callable, Iterator

import optree
import torch

from . import cache
from .codegen import NotCached, refuse_codegen
from .fx_tracing import FX_TRACING
from .graph_lock import compile_lock, graph_key
from .cxx_units import entry_at_wrapper_level
from .probe_memo import probe_memo
from .rewrites import split_foreach_norms
from .capture import tensor_metas  # noqa: F401 - re-exported: what a graph is compiled for
from .memory import release, write_inputs
from .options import Options

__all__ = ["CountingBackend", "make_backend", "compile_captured", "compile_graph", "fake_inputs",
           "DynamoCall"]


class CountingBackend:
    """A ``torch.compile`` backend that counts the graphs it compiles, then defers to the real one.

    ``shared``: the real backend keeps an on-disk cache other processes read (inductor): each graph
    is compiled under its machine-wide lock (another process's compile of it waited for at most
    ``lock_timeout`` seconds), with inductor's CPU probes memoized. ``lock_held``: that lock is already held
    for this process's one graph (a compile worker whose parent holds it on its behalf)."""

    def __init__(self, backend: Any, shared: bool = False, lock_timeout: float = 600.0):
        self._backend = backend  # the backend, or a partial that makes it (inductor's: on first use, so
        self.count = 0           # that a process that only loads packages never imports inductor)
        self.shared = shared
        self.lock_timeout = lock_timeout
        self.lock_held = False

    @property
    def backend(self) -> Any:
        if isinstance(self._backend, functools.partial):
            self._backend = self._backend()
        return self._backend

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Any:
        self.count += 1
        if not self.shared:
            return self.backend(gm, example_inputs)
        cpu = all(t.device.type == "cpu" for t in example_inputs if torch.is_tensor(t))  # (CPU kernels: probed)
        if self.lock_held:
            with probe_memo(ahead=cpu):
                return self.backend(gm, example_inputs)
        key = graph_key(gm, [t for t in example_inputs if torch.is_tensor(t)])
        with probe_memo(ahead=cpu), compile_lock(key, self.lock_timeout):
            return self.backend(gm, example_inputs)

    def load(self, gm: torch.fx.GraphModule, metas: tuple) -> Callable:
        """The code another process (a background worker) compiled for ``gm`` into the shared caches, loaded
        here without generating any: raises :class:`~functrain.compiler.codegen.NotCached` (or the caches' own
        error) where inductor would have to compile. No lock: the entry is there, or this fails at once."""
        with probe_memo(), refuse_codegen():
            fn = compile_graph(self.backend, gm, metas)
        self.count += 1
        return fn

    def __getattr__(self, name: str) -> Any:  # get_compiler_config, reset, ... of the inductor wrapper
        if name.startswith("__") or "_backend" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.backend, name)


# Inductor's options for a graph whose inputs are all on the CPU, where ``options.options`` does not set them
# (make_backend says why each): torch's own random kernels, and the graph's kernels in one C++ translation unit.
CPU_GRAPH_OPTIONS: dict[str, Any] = {"fallback_random": True, "cpp_wrapper": True}


def make_backend(options: Options, lock_timeout: float = 600.0) -> CountingBackend:
    """The counting backend for ``options`` (inductor made lazily; on the direct path without its per-call
    size asserts, which the runtime's signature check makes redundant; CUDA graphs there are functrain's);
    ``lock_timeout``: see :class:`CountingBackend`.

    Random numbers, per graph: a graph whose inputs are all on the CPU compiles with inductor's
    ``fallback_random=True`` (its random ops call torch's own kernels, in program order, on the generator
    ``with_rng`` seeds), unless ``options.options`` sets ``fallback_random`` itself. On the CPU inductor's own
    generator is slow (``torch.randn_like`` of 83k floats: ~8 ms against ~0.2 ms eagerly) and torch's kernels
    are fast, and the compiled step then draws the eager step's numbers bit for bit (docs/randomness.md). A
    graph with an input on another device (CUDA) keeps inductor's generator, which is fast there and fuses
    with the ops around it. The choice is made from the inputs the backend is called with, so a compile
    worker (:mod:`functrain.compiler.worker`, which rebuilds this backend from the same ``Options`` and
    compiles fake inputs of the same devices) makes the same one, and the configuration both compile under,
    which keys inductor's caches, is the same.

    The C++ compiler, per graph: a graph whose inputs are all on the CPU compiles with inductor's
    ``cpp_wrapper=True`` (unless ``options.options`` sets it), so that its kernels and the code that calls them
    are one C++ translation unit, built by one compiler run. Inductor's default builds each kernel apart, and each
    build pays a fixed ~0.7 CPU seconds (loading the precompiled header of ATen's vector library, linking against
    libtorch) for ~0.1-0.2 s of the kernel's own code: W1's 8 kernels cost ~8 CPU s as 8 units and ~3 s as one
    (bench/compile_phases.py, bench/README.md "Issue 41"). The kernels are the same code, so the results are the
    same bit for bit (tests/compiler/test_cpp_units.py), and the C++ wrapper is faster per call than the Python one.
    A graph with reused block regions (``invoke_subgraph``) keeps inductor's default: torch 2.13's ``cpp_wrapper``
    has no code for them.

    The unit's entry function (the code that allocates the buffers and calls the kernels) is built at the level
    of a package's wrapper, inductor's ``aot_inductor.compile_wrapper_opt_level`` (``-O1`` unless ``options.options``
    or ``AOT_INDUCTOR_COMPILE_WRAPPER_OPT_LEVEL`` says otherwise), the kernels at ``-O3``
    (:func:`~functrain.compiler.cxx_units.entry_at_wrapper_level`): GCC's ``-O3`` of that function was most of a
    large graph's C++ time (the seed's ``Unet``: first call 229 s, 149 s at ``-O1``), for no per-call time
    measured at ``-O1`` (``-O0`` saves ~18 s more on the ``Unet``, and costs W1 ~4 % per call: bench/README.md,
    issue 41). ``"O3"`` gives inductor's own unit back."""
    backend, mode, extra = options.backend, options.mode, options.options
    direct = options.path == "direct"
    if backend in (None, "inductor"):
        if direct:
            extra = {"size_asserts": False, **(extra or {})}
            mode = None if options.cuda_graphs else mode
        wrapper = getattr(torch, "_TorchCompileInductorWrapper", None)
        if wrapper is None:  # pragma: no cover - older torch: count through the registry's inductor
            from torch._dynamo.backends.registry import lookup_backend
            return CountingBackend(lookup_backend("inductor"), shared=True, lock_timeout=lock_timeout)
        cpu_defaults = {k: v for k, v in CPU_GRAPH_OPTIONS.items() if k not in (extra or {})}

        class PerDevice(wrapper):  # type: ignore[misc, valid-type]
            """Inductor with :data:`CPU_GRAPH_OPTIONS` (those ``options`` does not set) for a graph whose inputs
            are all on the CPU, its entry function at the wrapper's level, its ``_foreach_norm`` as per-tensor
            norms (:func:`~functrain.compiler.rewrites.split_foreach_norms`: a C++ wrapper calls it through
            Python; done under the Python wrapper too, so that the two layouts compute the same bits)."""

            def __call__(self, model_: Any, inputs_: Any, *, config_patches: Any = None) -> Any:
                if any(torch.is_tensor(t) and t.device.type != "cpu" for t in inputs_):
                    return super().__call__(model_, inputs_, config_patches=config_patches)
                defaults = dict(cpu_defaults)
                if _has_regions(model_) or _returns_a_list_of_one(model_):  # (see each; the graph as traced)
                    defaults.pop("cpp_wrapper", None)
                if isinstance(model_, torch.fx.GraphModule):  # (a C++ wrapper would call it through Python: see
                    model_ = split_foreach_norms(model_)  # it; under either wrapper, so their numbers are the same)
                config_patches = {**defaults, **(config_patches or {})}
                with entry_at_wrapper_level():  # (the level: in config_patches or options, read at the unit's load)
                    return super().__call__(model_, inputs_, config_patches=config_patches)

        wrapper = PerDevice
        return CountingBackend(functools.partial(wrapper, mode, extra, options.dynamic), shared=True,
                               lock_timeout=lock_timeout)
    if isinstance(backend, str):
        from torch._dynamo.backends.registry import lookup_backend
        backend = lookup_backend(backend)
    return CountingBackend(backend)


def compile_captured(cap: Any, backend: CountingBackend, *, packages: Any = None, cuda_graphs: bool = False,
                     fn: Callable | None = None) -> None:
    """Compile ``cap`` (a traced :class:`~functrain.compiler.capture.Captured`) in place: set ``cap.fn``.

    ``fn``: the graph's code already compiled (or loaded) elsewhere (background compilation); only the
    mode wrappers are added then."""
    if fn is None and packages is not None:
        def count() -> None:
            backend.count += 1
        fn = packages(cap.gm, cap.inputs, count)
    if fn is None:
        fn = compile_graph(backend, cap.gm, cap.metas)
    if cuda_graphs:
        from .cudagraph import GraphedCall, why_not
        reason = why_not(fake_inputs(cap.metas[:cap.signature.n_state]), cap.constants,
                         donate=cap.memory.donates, random=cap.random)
        if reason is None:
            fn = GraphedCall(fn, cap.signature.n_state, len(cap.constants))
        else:
            warnings.warn(f"ft.compile(mode='reduce-overhead'): this step runs without CUDA graphs: {reason}",
                          stacklevel=6)
    cap.fn = fn
    cap.gm = cap.inputs = None  # the example inputs are the first state's tensors: do not keep them alive


def fake_inputs(metas: tuple, fake_mode: Any = None) -> list:
    """Fake tensors of ``metas`` (fresh storage, offset 0) in ``fake_mode`` (default: a new one without a shape
    environment): the example inputs every process builds alike, so that they key the caches alike."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    fake_mode = FakeTensorMode() if fake_mode is None else fake_mode
    with fake_mode:
        return [torch.empty_strided(shape, stride, dtype=dtype, device=device)
                for shape, stride, dtype, device in metas]


def compile_graph(backend: Callable, gm: torch.fx.GraphModule, metas: tuple, notes: list | None = None) -> Callable:
    """``backend(gm, inputs)`` for fake inputs of ``metas`` inside a tracing context with a shape
    environment, as Dynamo calls backends: without one, AOTAutograd's and inductor's FX-graph caches
    bypass the graph ("No shape env") and every process compiles it from scratch. The inputs are made
    from metadata alone (shape, stride, dtype, device), so a worker process that has no tensor of the
    step builds the same ones, and its compile keys the caches as this process's would.

    A compile that fails on a file of the cache (a damaged kernel source inductor would build again at every
    run) is retried once with that file moved aside (:func:`~functrain.compiler.cache.set_aside_damaged`); what
    was moved is said in a warning, or appended to ``notes`` (a worker: its parent says it). A second failure
    raises :class:`~functrain.compiler.cache.CacheDamaged`, naming the folder to delete. A compile that fails on
    one operation of the graph raises :class:`~functrain.compiler.errors.BackendError`, naming the operation and
    the model's line that made it (:func:`~functrain.compiler.errors.backend_failed`)."""
    with FX_TRACING:  # (torch's tracer is one per process: another thread's trace or graph walk waits)
        try:
            return _compile_graph(backend, gm, metas, notes)
        except (cache.CacheDamaged, NotCached):
            raise
        except Exception as error:  # noqa: BLE001 - a failure on one operation is named at the model's line
            from .errors import backend_failed
            named = backend_failed(error, gm)
            if named is None:
                raise
            raise named from error


def _compile_graph(backend: Callable, gm: torch.fx.GraphModule, metas: tuple, notes: list | None) -> Callable:
    try:
        return _compile_once(backend, gm, metas)
    except Exception as first:  # noqa: BLE001 - a damaged cache file, or the compile's own failure (re-raised)
        moved = cache.set_aside_damaged(first) if backend_is_shared(backend) else []
        if not moved:
            raise
        why = f"{type(first).__name__}: {_first_line(first)}"
        if isinstance(backend, CountingBackend):
            backend.count -= 1  # (the failed attempt built nothing)
        _forget_in_memory()  # (inductor remembers the failed build in this process too)
        try:
            fn = _compile_once(backend, gm, metas)
        except Exception as again:  # noqa: BLE001
            raise cache.CacheDamaged(
                f"the compile failed on cached file(s) {moved}, which were moved aside (renamed *.damaged), and "
                f"failed again ({type(again).__name__}: {_first_line(again)}): delete the compile cache folder "
                f"{cache.inductor_dir()} (it is rebuilt), then run again; the first failure was {why}") from again
    note = (f"a damaged compile cache file was moved aside and rebuilt: {', '.join(moved)} (renamed *.damaged; the "
            f"compile failed on it with {why})")
    if notes is None:
        warnings.warn(f"ft.compile: {note}", RuntimeWarning, stacklevel=3)
    else:
        notes.append(note)
    return fn


def _forget_in_memory() -> None:
    """Drop inductor's in-process code caches (a failed build is kept there, keyed like the file on disk)."""
    utils = sys.modules.get("torch._inductor.utils")
    if utils is not None and hasattr(utils, "clear_caches"):
        try:
            utils.clear_caches()
        except Exception:  # noqa: BLE001 - an older torch: the retry may fail again, and says what to delete
            pass


def backend_is_shared(backend: Any) -> bool:
    """Whether ``backend`` keeps an on-disk cache (inductor's): only then can a cache file be at fault."""
    return backend.shared if isinstance(backend, CountingBackend) else False


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:300] if text else type(error).__name__


def _compile_once(backend: Callable, gm: torch.fx.GraphModule, metas: tuple) -> Callable:
    from torch._guards import TracingContext, tracing
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    # A graph that reads a scalar out of a tensor (``.item()`` of a constant, traced as
    # ``_local_scalar_dense``) trips AOTAutograd's scalar pass under a shape environment
    # (torch 2.13): compile it without one (no cross-process cache for that graph).
    scalar_reads = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default}
    if any(n.op == "call_function" and n.target in scalar_reads for n in gm.graph.nodes):
        return backend(gm, fake_inputs(metas))
    fake_mode = FakeTensorMode(shape_env=ShapeEnv())
    fakes = fake_inputs(metas, fake_mode)  # static shapes, as captured: the signature check guarantees them
    for node, fake in zip(gm.graph.find_nodes(op="placeholder"), fakes):
        # inductor's cpp_wrapper compiles for the placeholders' recorded values when the graph has them (a traced
        # graph does, one rebuilt in a compile worker does not): the same ones in every process, so that the
        # worker's cache entry and the training process's load have one key
        node.meta["val"] = fake
    with tracing(TracingContext(fake_mode)), _no_reuse_across_regions(gm):
        return backend(gm, fakes)


def _has_regions(gm: Any) -> bool:
    """Whether ``gm`` calls reused block regions (``invoke_subgraph``: :mod:`functrain.core.regions`)."""
    graph = getattr(gm, "graph", None)
    return graph is not None and any(
        n.op == "call_function" and getattr(n.target, "__name__", "") == "invoke_subgraph" for n in graph.nodes)


def _returns_a_list_of_one(gm: Any) -> bool:
    """Whether ``gm`` calls an op that returns a list of one tensor (a ``_foreach_*`` op over one tensor: a flat
    state, a model of one parameter). torch 2.13's and 2.14's C++ wrapper reads the result of such an op, when it
    has no C shim (``_foreach_lerp``, ``_foreach_norm``) and is called through Python, as one tensor instead of a
    list of one, and the step crashes with a segmentation fault (tests/core/test_flat.py found it); a graph with
    one is compiled with inductor's Python wrapper."""
    graph = getattr(gm, "graph", None)
    if graph is None:
        return False
    from torch._inductor.decomposition import select_decomp_table
    from torch._inductor.lowering import fallbacks, lowerings  # (a fallback, once made, is in both)
    decomposed = select_decomp_table()
    for n in graph.nodes:
        value = n.meta.get("val", n.meta.get("example_value")) if n.op == "call_function" else None
        if not (isinstance(value, (list, tuple)) and len(value) == 1 and torch.is_tensor(value[0])):
            continue  # (a view that returns a tuple of one, e.g. unbind of a one-value hyper tensor, is lowered)
        if isinstance(n.target, torch._ops.OpOverload):  # an ATen graph: one that inductor runs as a fallback
            if n.target in fallbacks or (n.target not in lowerings and n.target not in decomposed):
                return True
        elif getattr(n.target, "__name__", "").startswith("_foreach_"):  # a Dynamo graph: torch's functions
            return True
    return False


@contextlib.contextmanager
def _no_reuse_across_regions(gm: torch.fx.GraphModule) -> Iterator[None]:
    """A graph with reused block regions (``invoke_subgraph``: :mod:`functrain.core.regions`) compiles without
    inductor's buffer reuse: torch 2.13's region code reuses the buffers of the graph's own inputs (the
    blocks' parameters) as scratch, writing into the caller's state (found by tests/compiler/test_regions.py).
    Buffer reuse only saves allocations: the numbers are the same."""
    if not any(n.op == "call_function" and getattr(n.target, "__name__", "") == "invoke_subgraph"
               for n in gm.graph.nodes):
        yield
        return
    import torch._inductor.config as inductor_config

    with inductor_config.patch(allow_buffer_reuse=False):
        yield


# -- the Dynamo path ------------------------------------------------------------------------------
_ids = itertools.count()


def _own_code(fn: Any) -> Any:
    """A copy of ``fn`` with its own code object and name.

    Dynamo keeps its compiled graphs, recompile limit and automatic-dynamic memory per code
    object, and its profile-guided state per (file, line, name): a fresh code object with a
    unique name per compiled step keeps steps from sharing, evicting, or turning dynamic each
    other's graphs (two steps whose optimizers differ in a float, say).
    """
    name = f"{fn.__name__}_{next(_ids)}"
    code = fn.__code__.replace(co_name=name)
    if hasattr(code, "co_qualname"):
        code = code.replace(co_qualname=name)
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)


def _leaves(tree: Any) -> list:
    """The tensor leaves of a state in a fixed order, traceable by Dynamo (its optree polyfill fails on the
    empty dicts states have whenever a model has no buffers; a state's containers are few and plain)."""
    if torch.is_tensor(tree):
        return [tree]
    if isinstance(tree, dict):
        return [x for k in tree for x in _leaves(tree[k])]
    if isinstance(tree, (list, tuple)):
        return [x for item in tree for x in _leaves(item)]
    return []


def _apply(state: Any, batch: Any, step: Any = None) -> tuple[Any, dict]:
    return step.apply(state, batch)


def _donating(state: Any, batch: Any, step: Any = None) -> tuple[Any, dict]:
    new, metrics = step.apply(state, batch)
    write_inputs(_leaves(state), _leaves(new))  # inductor writes each result straight into the donated buffer
    return state, metrics


def _once_logging_ignored() -> Any:
    """A context in which Dynamo skips the "once" logging methods Hugging Face libraries add to
    ``logging.Logger`` (``warning_once``, ``info_once``: ``functools.lru_cache`` wrappers, which Dynamo cannot
    trace): a model's advisory message would otherwise be a graph break (transformers' ``loss_function`` warns
    once about its ``loss_type``). The message was printed by the eager step, or is printed when the step is
    called eagerly; a compiled call does not print it. Nothing when no library added them."""
    import logging

    once = {getattr(logging.Logger, n) for n in ("warning_once", "info_once", "warning_advice")
            if hasattr(logging.Logger, n)}
    config = torch._dynamo.config
    if not once or not hasattr(config, "ignore_logger_methods"):
        return contextlib.nullcontext()
    return config.patch(ignore_logger_methods=set(config.ignore_logger_methods) | once)


class DynamoCall:
    """``torch.compile`` of ``step.apply`` (its own code object), called through the step's host work.

    With ``donate`` the compiled function writes the new state into the input's tensors and the
    call then releases the old ones (:func:`functrain.compiler.memory.release`)."""

    def __init__(self, step: Any, options: Options, backend: CountingBackend):
        self.step = step
        self.donate = options.donate
        fn = _own_code(_donating if options.donate else _apply)
        fn.__defaults__ = (step,)
        self.compiled = torch.compile(fn, fullgraph=options.fullgraph, backend=backend, dynamic=options.dynamic,
                                      **options.extra)
        self.quiet = _once_logging_ignored()

    def __call__(self, state: Any, batch: Any) -> tuple[Any, dict]:
        from .errors import explain
        try:
            with self.quiet:
                new, metrics = self.step.host_call(self.compiled, state, batch)
        except torch._dynamo.exc.TorchDynamoException as error:
            explain(self.step, error, state, batch, tracer="Dynamo", graph_break=False)
            raise
        if self.donate:
            leaves, spec = optree.tree_flatten(new)
            new = optree.tree_unflatten(spec, [t.detach() if torch.is_tensor(t) else t for t in leaves])
            release(optree.tree_leaves(state))
        return new, metrics
