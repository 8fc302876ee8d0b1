"""``ft.compile``: the whole step under ``torch.compile``, one graph, optional buffer donation."""
from __future__ import annotations

import itertools
import types
from typing import Any

import optree
import torch

from .state import TrainState
from .step import Step

__all__ = ["compile", "CompiledStep", "GraphBreakError"]


class GraphBreakError(RuntimeError):
    """The step cannot be captured as one graph under ``fullgraph=True``."""


class _CountingBackend:
    """A ``torch.compile`` backend that counts the graphs it compiles, then defers to the real one."""

    def __init__(self, backend: Any):
        self.backend = backend
        self.count = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Any:
        self.count += 1
        return self.backend(gm, example_inputs)

    def __getattr__(self, name: str) -> Any:  # get_compiler_config, reset, ... of the inductor wrapper
        return getattr(self.__dict__["backend"], name)


def _make_backend(backend: Any, mode: str | None, options: dict | None, dynamic: bool | None) -> _CountingBackend:
    if backend in (None, "inductor"):
        wrapper = getattr(torch, "_TorchCompileInductorWrapper", None)
        if wrapper is None:  # pragma: no cover - older torch: count through the registry's inductor
            from torch._dynamo.backends.registry import lookup_backend
            return _CountingBackend(lookup_backend("inductor"))
        return _CountingBackend(wrapper(mode, options, dynamic))
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
    """

    def __init__(self, step: Step, *, donate: bool = False, fullgraph: bool = True, backend: Any = None,
                 mode: str | None = None, options: dict | None = None, dynamic: bool | None = None,
                 **kwargs: Any):
        if not isinstance(step, Step):
            raise TypeError(f"ft.compile takes a functrain Step (from ft.train_step); got {type(step).__name__}")
        self.step = step
        self.donate = bool(donate)
        self.fullgraph = fullgraph
        self._backend = _make_backend(backend, mode, options, dynamic)
        fn = _own_code(self._donating if self.donate else _apply)
        fn.__defaults__ = (step,)
        self._compiled = torch.compile(fn, fullgraph=fullgraph, backend=self._backend, dynamic=dynamic, **kwargs)

    @property
    def compiles(self) -> int:
        return self._backend.count

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

    def _explain(self, error: Exception, state: TrainState, batch: Any) -> None:
        """Raise what the step itself says about ``error``, Dynamo's report of a failed capture.

        Dynamo reports an exception raised by the user's code while tracing (a bad
        loss, a batch of the wrong shape) as ``Unsupported`` or ``TorchRuntimeError``
        with pages of its own logs: running the step eagerly once raises the real
        error, which is raised instead (without Dynamo's chain). If the eager step
        runs, a graph break is a :class:`GraphBreakError`; anything else returns and
        the caller re-raises Dynamo's error as it is.
        """
        try:
            self.step.host_call(self.step.apply, state, batch)
        except Exception as real:  # noqa: BLE001 - surface whatever the step itself raises
            if hasattr(real, "add_note"):  # Python >= 3.11
                real.add_note(f"(raised by the step run eagerly: ft.compile could not trace it, "
                              f"torch._dynamo.exc.{type(error).__name__})")
            raise real from None
        if isinstance(error, (torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError)):
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise GraphBreakError(
                f"the step cannot be compiled as one graph (fullgraph=True): {first}. "
                f"A step must have no host sync (.item(), print, Python branches on tensor values) and call "
                f"only traceable code; fix the loss function, or pass fullgraph=False to ft.compile to allow "
                f"graph breaks (slower). Dynamo said:\n{error}") from error

    def __repr__(self) -> str:
        return f"compile({self.step!r}, donate={self.donate})"


def compile(step: Step, *, donate: bool = False, fullgraph: bool = True, **torch_compile_kwargs: Any) -> CompiledStep:
    """Compile the whole step with ``torch.compile`` (``fullgraph=True`` by default).

    The result is called like the step and gives the same results (to float
    rounding). Steps of the same shapes never recompile: the step counter and
    every per-step value are tensors. ``donate=True`` lets the new state reuse
    the input state's storage (peak memory near one state, as JAX's donation);
    the input state is invalid afterwards and passing it to a step raises.
    Other keyword arguments go to ``torch.compile`` (``mode``, ``options``,
    ``dynamic``, ``backend``).

    Example::

        import functrain as ft
        cstep = ft.compile(step)            # first call compiles (seconds), later calls are fast
        state, metrics = cstep(state, batch)
        cstep.compiles                      # 1
    """
    return CompiledStep(step, donate=donate, fullgraph=fullgraph, **torch_compile_kwargs)
