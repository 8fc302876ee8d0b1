"""``ft.compile``: the whole step under ``torch.compile``, one graph, optional buffer donation."""
from __future__ import annotations

import functools
import itertools
import os
import types
from typing import Any

import optree
import torch

from . import cache as compile_cache
from ..core.validate import check_choice
from .capture import FastPath
from ..core.checks import check_batch
from ..core.rng import with_rng
from ..core.state import TrainState
from ..core.step import Step

__all__ = ["compile", "CompiledStep", "GraphBreakError"]


class GraphBreakError(RuntimeError):
    """The step cannot be captured as one graph under ``fullgraph=True``."""


class _CountingBackend:
    """A ``torch.compile`` backend that counts the graphs it compiles, then defers to the real one.

    ``shared``: the real backend keeps an on-disk cache other processes read (inductor): each graph
    is compiled under its machine-wide lock, with inductor's CPU probes memoized
    (:mod:`functrain.compiler.cache`)."""

    def __init__(self, backend: Any, shared: bool = False):
        self._backend = backend  # the backend, or a function that makes it (inductor's: on first use, so
        self.count = 0           # that a process that only loads packages never imports inductor)
        self.shared = shared

    @property
    def backend(self) -> Any:
        if isinstance(self._backend, functools.partial):
            self._backend = self._backend()
        return self._backend

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Any:
        self.count += 1
        if not self.shared:
            return self.backend(gm, example_inputs)
        key = compile_cache.graph_key(gm, [t for t in example_inputs if torch.is_tensor(t)])
        with compile_cache.probe_memo(), compile_cache.compile_lock(key):
            return self.backend(gm, example_inputs)

    def __getattr__(self, name: str) -> Any:  # get_compiler_config, reset, ... of the inductor wrapper
        if name.startswith("__") or "_backend" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.backend, name)


def _make_backend(backend: Any, mode: str | None, options: dict | None, dynamic: bool | None) -> _CountingBackend:
    if backend in (None, "inductor"):
        wrapper = getattr(torch, "_TorchCompileInductorWrapper", None)
        if wrapper is None:  # pragma: no cover - older torch: count through the registry's inductor
            from torch._dynamo.backends.registry import lookup_backend
            return _CountingBackend(lookup_backend("inductor"), shared=True)
        return _CountingBackend(functools.partial(wrapper, mode, options, dynamic), shared=True)
    if mode is not None or options is not None:
        raise ValueError(f"ft.compile: mode/options apply to the inductor backend only; got backend={backend!r}")
    if isinstance(backend, str):
        from torch._dynamo.backends.registry import lookup_backend
        backend = lookup_backend(backend)
    return _CountingBackend(backend)


def _apply(state: TrainState, batch: Any, step: Step = None) -> tuple[TrainState, dict]:
    return step.apply(state, batch)


_ids = itertools.count()


def _own_code(fn: Any) -> Any:
    """A copy of ``fn`` with its own code object and name.

    Dynamo keeps its compiled graphs, recompile limit and automatic-dynamic
    memory per code object, and its profile-guided state per (file, line, name):
    a fresh code object with a unique name per compiled step keeps steps from
    sharing, evicting, or turning dynamic each other's graphs (two steps whose
    optimizers differ in a float, say).
    """
    name = f"{fn.__name__}_{next(_ids)}"
    code = fn.__code__.replace(co_name=name)
    if hasattr(code, "co_qualname"):
        code = code.replace(co_qualname=name)
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)


def _leaves(tree: Any) -> list:
    """The tensor leaves of a state, in a fixed order, traceable by Dynamo.

    (Dynamo's optree polyfill fails on empty dicts, which states have whenever
    a model has no buffers; the containers of a state are few and plain.)
    """
    if torch.is_tensor(tree):
        return [tree]
    if isinstance(tree, dict):
        return [x for k in tree for x in _leaves(tree[k])]
    if isinstance(tree, (list, tuple)):
        return [x for item in tree for x in _leaves(item)]
    return []


class CompiledStep:
    """A :class:`~functrain.Step` compiled whole by :func:`compile`; call it like the step.

    Attributes:
        step:      the eager step it compiles.
        compiles:  how many graphs ``torch.compile`` has built for it so far (a
                   recompile shows up as an increase after the first call).
        donate:    whether calls donate the input state's storage.
        cache_dir: the inductor cache folder in use when ``cache_dir=`` was given, else ``None``.
    """

    def __init__(self, step: Step, *, donate: bool = False, fullgraph: bool = True, backend: Any = None,
                 mode: str | None = None, options: dict | None = None, dynamic: bool | None = None,
                 capture: str = "auto", cache_dir: Any = None, package: bool = False, **kwargs: Any):
        if not isinstance(step, Step):
            raise TypeError(f"ft.compile takes a functrain Step (from ft.train_step); got {type(step).__name__}")
        self.cache_dir = None if cache_dir is None else compile_cache.use_cache_dir(cache_dir)
        self.step = step
        self.donate = bool(donate)
        self.fullgraph = fullgraph
        # The fast path (functrain/compiler/capture.py): trace once over flat leaves, call the compiled code
        # directly with functrain's own signature check. Dynamo's per-call frame remains for what
        # only it can do: graph breaks (fullgraph=False), dynamic shapes, CUDA graphs, extra options.
        self._fast: FastPath | None = None
        self._owned: Any = None  # the driver's donating call path, made on first use (see donating())
        self._packages: Any = None  # package=True: functrain.compiler.package.Packages
        self._config = dict(fullgraph=fullgraph, backend=backend, mode=mode, options=options, dynamic=dynamic,
                            capture=capture, cache_dir=cache_dir, package=package, **kwargs)
        check_choice("capture", capture, ("auto", "flat", "dynamo"))
        # CUDA graphs on the fast path replay the compiled code on the donated state's own buffers
        # (functrain/compiler/cudagraph.py); an undonated state takes inductor's CUDA graphs on the Dynamo path
        self._graphs = mode == "reduce-overhead"
        fast_ok = fullgraph and not dynamic and (self.donate or not self._graphs) and not kwargs
        if capture == "flat" and not fast_ok:
            raise ValueError("ft.compile: capture='flat' needs fullgraph=True, static shapes, donate=True with mode="
                             "'reduce-overhead', and no extra torch.compile arguments; got "
                             f"fullgraph={fullgraph!r}, dynamic={dynamic!r}, mode={mode!r}, donate={donate!r}, "
                             f"extra={sorted(kwargs)}")
        if fast_ok and capture != "dynamo":
            fast_options = options
            if backend in (None, "inductor"):
                # the signature check compares every input's strides: inductor's per-call asserts are redundant
                fast_options = {"size_asserts": False, **(options or {})}
            # (mode="reduce-overhead": the CUDA graph is functrain's, around inductor's default-mode code)
            self._backend = _make_backend(backend, None if self._graphs else mode, fast_options, dynamic)
            self._packages = self._make_packages(package, cache_dir, backend, mode, options)
            self._fast = self._fast_path(owned=False)
            return
        if package:
            raise ValueError("ft.compile(package=True) needs the flat capture (fullgraph=True, static shapes, "
                             "no extra torch.compile arguments, capture='auto' or 'flat'; with mode="
                             f"'reduce-overhead', donate=True); got capture={capture!r}, fullgraph={fullgraph!r}, "
                             f"dynamic={dynamic!r}, mode={mode!r}, donate={donate!r}, extra={sorted(kwargs)}")
        self._backend = _make_backend(backend, mode, options, dynamic)
        fn = _own_code(self._donating if self.donate else _apply)
        fn.__defaults__ = (step,)
        self._compiled = torch.compile(fn, fullgraph=fullgraph, backend=self._backend, dynamic=dynamic, **kwargs)

    def _make_packages(self, package: bool, cache_dir: Any, backend: Any, mode: str | None,
                       options: dict | None) -> Any:
        if not package:
            return None
        if cache_dir is None:
            raise ValueError("ft.compile(package=True) needs cache_dir=: the folder its packages are kept in")
        if backend not in (None, "inductor") or options or mode not in (None, "default", "reduce-overhead"):
            raise ValueError(f"ft.compile(package=True) compiles with AOTInductor's defaults: it takes no "
                             f"backend=, options= or mode= other than 'reduce-overhead'; got backend={backend!r}, "
                             f"options={options!r}, mode={mode!r}")
        from .package import Packages
        return Packages(os.fspath(cache_dir))

    def _count(self) -> None:
        self._backend.count += 1

    def _fast_path(self, owned: bool) -> FastPath:
        step = self.step
        packages = self._packages

        def package(gm: Any, inputs: list) -> Any:
            return packages(gm, inputs, self._count)

        def check(state: Any, batch: Any) -> None:  # what Step.host_call checks before running
            step.check_state(state)
            check_batch(batch)

        def explain(error: Exception, state: Any, batch: Any) -> None:  # always raises
            self._explain(error, state, batch, graph_break=True)

        return FastPath(step.apply, self._backend, donate=self.donate or owned, check=check,
                        with_rng=functools.partial(with_rng, host_generators=False),  # the graph cannot draw them
                        rank=step.rng_offset, explain=explain, owned=owned, cuda_graphs=self._graphs,
                        package=package if packages is not None else None)

    @property
    def compiles(self) -> int:
        twin = self._owned.compiles if isinstance(self._owned, CompiledStep) else 0  # the Dynamo path's donating twin
        return self._backend.count + twin

    def donating(self) -> Any:
        """This step as a call that donates its input state: what :func:`functrain.run` uses.

        For a caller that owns the state it passes from step to step and keeps no other
        reference to it: the new state is written into the input state's buffers (no
        allocation per step), and the input state cannot be stepped again (its step
        counter is emptied, so a step on it raises). Unlike ``donate=True``, the other
        leaves of the input state are not emptied: they *are* the new state's. Graphs it
        compiles count in :attr:`compiles`.

        Example::

            state = ft.tree.tree_map(torch.clone, state)   # own it
            run = cstep.donating()
            for batch in loader:
                state, metrics = run(state, batch)
        """
        if self.donate:
            return self
        if self._owned is None:
            if self._fast is not None:
                self._owned = self._fast_path(owned=True)
            else:
                self._owned = CompiledStep(self.step, donate=True, **self._config)
        return self._owned

    def init(self, params: Any, buffers: Any = None, **kwargs: Any) -> TrainState:
        """Same as :meth:`Step.init`."""
        return self.step.init(params, buffers, **kwargs)

    @staticmethod
    def _donating(state: TrainState, batch: Any, step: Step = None) -> tuple[TrainState, dict]:
        new, metrics = step.apply(state, batch)
        old_leaves, new_leaves = _leaves(state), _leaves(new)
        if len(old_leaves) != len(new_leaves):
            raise ValueError(f"donate=True needs the step to return a state of the input's structure; "
                             f"got {len(new_leaves)} leaves for {len(old_leaves)}")
        for old, value in zip(old_leaves, new_leaves):
            old.copy_(value)  # inductor writes the result straight into the donated buffer
        return state, metrics

    def __call__(self, state: TrainState, batch: Any) -> tuple[TrainState, dict]:
        if self._fast is not None:
            return self._fast(state, batch)
        try:
            new, metrics = self.step.host_call(self._compiled, state, batch)
        except torch._dynamo.exc.TorchDynamoException as error:
            self._explain(error, state, batch)
            raise
        if self.donate:
            new = optree.tree_map(lambda t: t.detach() if torch.is_tensor(t) else t, new)
            for leaf in optree.tree_leaves(state):
                if torch.is_tensor(leaf):
                    leaf.set_()  # the old state no longer owns storage: using it raises
        return new, metrics

    def _explain(self, error: Exception, state: TrainState, batch: Any, graph_break: bool = False) -> None:
        """Raise what the step itself says about ``error``, Dynamo's report of a failed capture.

        Dynamo reports an exception raised by the user's code while tracing (a bad
        loss, a batch of the wrong shape) as ``Unsupported`` or ``TorchRuntimeError``
        with pages of its own logs: running the step eagerly once raises the real
        error, which is raised instead (without Dynamo's chain). If the eager step
        runs, a graph break is a :class:`GraphBreakError` (any failed capture of the flat
        path, ``graph_break=True``); anything else returns and the caller re-raises
        Dynamo's error as it is.
        """
        try:
            self.step.host_call(self.step.apply, state, batch)
        except Exception as real:  # noqa: BLE001 - surface whatever the step itself raises
            if hasattr(real, "add_note"):  # Python >= 3.11
                real.add_note(f"(raised by the step run eagerly: ft.compile could not trace it; "
                              f"{'the capture (make_fx)' if graph_break else 'Dynamo'} raised {_qualname(error)})")
            raise real from None
        if graph_break or isinstance(error, (torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError)):
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise GraphBreakError(
                f"the step cannot be compiled as one graph (fullgraph=True): {first}. "
                f"A step must have no host sync (.item(), print, Python branches on tensor values) and call "
                f"only traceable code; fix the loss function, or pass fullgraph=False to ft.compile to allow "
                f"graph breaks (slower). The tracer said:\n{error}") from error

    def __repr__(self) -> str:
        return f"compile({self.step!r}, donate={self.donate})"


def _qualname(error: Exception) -> str:
    """``AttributeError``, ``torch._dynamo.exc.Unsupported``: the error's class as its module names it."""
    cls = type(error)
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


def compile(step: Step, *, donate: bool = False, fullgraph: bool = True, capture: str = "auto",
            cache_dir: str | os.PathLike | None = None, package: bool = False,
            **torch_compile_kwargs: Any) -> CompiledStep:
    """Compile the whole step with ``torch.compile`` (``fullgraph=True`` by default).

    The result is called like the step and gives the same results (to float
    rounding). Steps of the same shapes never recompile: the step counter and
    every per-step value are tensors. ``donate=True`` lets the new state reuse
    the input state's storage (peak memory near one state, as JAX's donation);
    the input state is invalid afterwards and passing it to a step raises.
    Other keyword arguments go to ``torch.compile`` (``mode``, ``options``,
    ``dynamic``, ``backend``).

    How it runs: by default (``capture="auto"``) the step is traced once per input
    signature over the flat leaves of ``(state, batch)`` and the backend's code is
    called directly on them (:mod:`functrain.compiler.capture`): no Dynamo frame per call, only
    functrain's check that the state's structure and every leaf's shape, stride, dtype
    and device match the capture (a change compiles again and counts in ``compiles``).
    Python values the step reads (closures, globals) are constants of the capture, as
    under ``jax.jit``. ``fullgraph=False``, ``dynamic=True`` or extra ``torch.compile``
    arguments use ``torch.compile`` per call instead, and ``capture="dynamo"`` asks for
    that path explicitly (``"flat"`` insists on the fast one).

    ``mode="reduce-overhead"`` (CUDA graphs): with ``donate=True`` (or through
    :meth:`CompiledStep.donating`, as ``ft.run`` calls it) the fast path replays the
    compiled step as one CUDA graph on the donated state's buffers, the batch copied in
    (:mod:`functrain.compiler.cudagraph`); a step it cannot graph (a CPU state, random numbers)
    warns and runs without. Undonated, it is inductor's CUDA graphs on the Dynamo path.

    A later process that traces the same graph (a resumed run, a second run, another
    rank) reuses AOTAutograd's and inductor's on-disk caches, keyed by torch on the graph,
    shapes, dtypes, devices, config and version (a changed loss is a new key, compiled
    afresh). ``cache_dir`` puts them in ``cache_dir/inductor`` (a folder of this user's,
    not world-writable; inductor's folder is process-wide, so the first one a process
    compiles with stays; default: ``TORCHINDUCTOR_CACHE_DIR`` or inductor's own). Ranks
    of one machine starting together compile each graph once: the first takes a lock
    on it, the others wait and load its entry. See :mod:`functrain.compiler.cache`.
    ``package=True`` (with ``cache_dir``) compiles each graph ahead of time into a package
    instead (AOTInductor: a slower first compile), which a later process tracing the same
    graph loads in milliseconds (:mod:`functrain.compiler.package`).

    Example::

        import functrain as ft
        cstep = ft.compile(step)            # first call compiles (seconds), later calls are fast
        state, metrics = cstep(state, batch)
        cstep.compiles                      # 1
        cstep = ft.compile(step, cache_dir="runs/a/compile_cache")   # a resumed run loads, not compiles
    """
    return CompiledStep(step, donate=donate, fullgraph=fullgraph, capture=capture, cache_dir=cache_dir,
                        package=package, **torch_compile_kwargs)
