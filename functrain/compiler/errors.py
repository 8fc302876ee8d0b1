"""What a failed capture or compile means: the user's own error, an empty batch, or a step that is not one graph.

A tracer (make_fx on the direct path, Dynamo on the other) reports an exception raised by
the user's code while tracing (a bad loss, a batch of the wrong shape) wrapped in pages of
its own logs. :func:`explain` runs the step eagerly once: if that raises, the user's error
is raised instead (without the tracer's chain); if it runs, the step cannot be captured as
one graph and :class:`GraphBreakError` says so, quoting the tracer. A graph that traced but that
the backend cannot compile (inductor's lowering of one operation) is :class:`BackendError`
(:func:`backend_failed`). Each names the operation and the model's line that made it (``what``, ``where``):
the host read found by watching the eager step, else the innermost frame outside torch and functrain in
the tracer's traceback (Dynamo's: the frame it was tracing), or for a backend the stack the trace
recorded for the failing node.
"""
from __future__ import annotations

from typing import Any

import re
import traceback
from typing import Iterable

import optree
import torch

from ..core.step import Step
from ..core.validate import path_str
from .host_sync import HostSync, Where, describe, is_users, locate

__all__ = ["GraphBreakError", "BackendError", "explain", "backend_failed"]


_SAVED_HOOKS = "don't yet support saved tensor hooks"  # torch.func's refusal (torch/_functorch/vmap.py)


class GraphBreakError(RuntimeError):
    """The step cannot be captured as one graph under ``fullgraph=True``.

    A ``RuntimeError`` raised by a :func:`functrain.compile`'d step's first call, after the
    step run eagerly succeeded (an error of the step itself is raised as it is). Its message
    names the cause (a host sync such as ``.item()``, a Python branch on a tensor value,
    untraceable code) and the user's line that does it, and the tracer's report; ``__cause__`` is the
    tracer's error. Fix the loss function (or the transform whose hook the line is in: the message names it,
    ``fix the transform Name.hook``), or pass ``fullgraph=False`` to allow graph breaks (slower).

    Attributes:
        what: the operation found (``"item"``, ``"__bool__"``: a Python ``if`` on a tensor, ``"print"``,
            ``"__getitem__"``: a boolean mask, ...), or ``None`` when only the tracer's report says why.
        where: the user's line (:class:`functrain.compiler.host_sync.Where`: file, line, function, text), or
            ``None``.

    Example::

        >>> import torch, functrain as ft
        >>> def loss(p, b, x):
        ...     y = (p["w"] * x).sum()
        ...     return y if y.item() > 0 else -y          # a Python branch on a tensor value
        >>> step = ft.train_step(loss, ft.optim.sgd(0.1))
        >>> try:
        ...     ft.compile(step)(step.init({"w": torch.ones(2)}), torch.ones(2))
        ... except ft.GraphBreakError as e:
        ...     print(str(e).split(":")[0])
        the step cannot be compiled as one graph (fullgraph=True)
    """

    what: str | None = None
    where: Any = None
    stage: str = "trace"


class BackendError(GraphBreakError):
    """The step traced as one graph, but the backend (inductor) could not compile an operation of it.

    Raised by a :func:`functrain.compile`'d step's first call (or said by ``ft.run``'s warning when a background
    compile fails). ``what`` is the operation (``"aten.view"``), ``where`` the model's line that made it (a
    :class:`functrain.compiler.host_sync.Where`, or ``None`` when the trace recorded no stack for it), ``stage``
    is ``"backend"``; ``__cause__`` is the backend's error. A subclass of :class:`GraphBreakError`: code that
    handles "this step cannot be compiled" handles both.

    Example::

        >>> import functrain as ft
        >>> issubclass(ft.compiler.errors.BackendError, ft.GraphBreakError)
        True
    """

    stage = "backend"


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:300] if text else type(error).__name__


def explain(step: Step, error: BaseException, state: Any, batch: Any, *, tracer: str,
            graph_break: bool = True) -> None:
    """Raise what ``error``, the tracer's report of a failed capture of ``step`` on ``(state, batch)``, means.

    ``tracer`` names the tracer for the note (``"make_fx"``, ``"Dynamo"``). Returns only when
    ``graph_break`` is false and the eager step runs (the caller re-raises the tracer's error).
    """
    found = error if isinstance(error, HostSync) and error.where is not None else None
    try:
        if found is None:  # the eager step, watched for the host read that broke the graph
            located = locate(lambda: step.host_call(step.apply, state, batch))
            found = HostSync(*located) if located is not None else None
        else:
            step.host_call(step.apply, state, batch)
    except Exception as real:  # noqa: BLE001 - surface whatever the step itself raises
        if hasattr(real, "add_note"):  # Python >= 3.11
            real.add_note(f"(raised by the step run eagerly after ft.compile's {tracer} trace of it failed with "
                          f"{_qualname(error)}: {_first_line(error)})")
        raise real from None
    empty = _empty_leaf(batch)
    if empty is not None:
        raise ValueError(f"ft.compile: batch leaf {empty[0]!r} is empty (shape {empty[1]}): the compiled step "
                         f"cannot trace a batch without rows (the eager step's loss over it is NaN). Skip empty "
                         f"batches (a data loader with drop_last=True never yields one)") from error
    if _SAVED_HOOKS in str(error):
        raise GraphBreakError(
            "the loss uses saved-tensor hooks (torch.utils.checkpoint.checkpoint(use_reentrant=False), "
            "torch.autograd.graph.save_on_cpu, ...): they run eagerly, but the compiled step takes its gradient "
            "with torch.func, which refuses them. For activation checkpointing mark the blocks with "
            "ft.remat(module) or call ft.remat(fn)(*args): the same recomputation, eager and compiled "
            "(Hugging Face models' gradient_checkpointing_enable() is routed there by ft.functionalize). The "
            f"tracer ({tracer}) said: {_first_line(error)}") from error
    if graph_break or isinstance(error, (torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError)):
        if found is not None:
            cause = f"{describe(found.what)}, at {found.where}"
        else:
            where = _tracer_where(error)
            what = _op_named(str(error)) or _qualname(error)
            found = HostSync(what, where) if where is not None else None
            cause = _first_line(error) + (f", at {where}" if where is not None else "")
        hook = found.where.hook if found is not None else None
        fix = "the loss function" if hook is None else f"the transform {hook}"
        e = GraphBreakError(
            f"the step cannot be compiled as one graph (fullgraph=True): {cause}. "
            f"A step must have no host sync (.item(), print, Python branches on tensor values, data-dependent "
            f"shapes) and call only traceable code; fix {fix}, or pass fullgraph=False to ft.compile "
            f"to allow graph breaks (slower). The tracer ({tracer}) said:\n{error}")
        if found is not None:
            e.what, e.where = found.what, found.where
        e.stage = "dynamo" if tracer == "Dynamo" else "trace"
        raise e from error


def _qualname(error: BaseException) -> str:
    """``AttributeError``, ``torch._dynamo.exc.Unsupported``: the error's class as its module names it."""
    cls = type(error)
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


def _empty_leaf(batch: Any) -> tuple[str, tuple] | None:
    paths, leaves, _ = optree.tree_flatten_with_path(batch)
    for path, leaf in zip(paths, leaves):
        if torch.is_tensor(leaf) and leaf.dim() > 0 and leaf.shape[0] == 0:
            return path_str(path), tuple(leaf.shape)
    return None


# -- where a tracer's or a backend's failure is in the model ------------------------------------------------
_EXECUTING = re.compile(r"While executing %(\w+)")
_TARGET = re.compile(r"target=((?:torch\.ops\.)?[\w.]+)")
_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)\n?(?:[ \t]+(.*))?')


def _op_named(text: str) -> str | None:
    """The first aten/custom operator named in ``text`` (``"aten.view"``, ``"mylib.op"``), or ``None``."""
    for m in re.finditer(r"(?:torch\.ops\.)?\b(aten|prims|[a-z_][a-z0-9_]*)(?:\.|::)([a-z_][a-z0-9_]*)(?:\.[a-z_]\w*)?",
                         text):
        namespace, name = m.group(1), m.group(2)
        if namespace in ("aten", "prims") or m.group(0).startswith("torch.ops.") or "::" in m.group(0):
            return f"{namespace}.{name}"
    return None


def _innermost(frames: Iterable[tuple[str, int, str, str]]) -> Where | None:
    """The innermost ``(file, line, function, text)`` of the user's (or the model's) code, outermost first."""
    found = None
    for file, line, function, text in frames:
        if is_users(file):
            found = Where(file, int(line), function, (text or "").strip()[:200])
    return found


def _tracer_where(error: BaseException) -> Where | None:
    """The model's line a tracer failed at: Dynamo's stack of the frame it traced, else the error's traceback
    (make_fx runs the model's Python, so its exception passes through the model's frames)."""
    stack = getattr(error, "real_stack", None)
    if stack:
        where = _innermost((f.filename, f.lineno, f.name, f.line or "") for f in stack)
        if where is not None:
            return where
    frames = []
    e: BaseException | None = error
    while e is not None and not frames:  # the traceback that reached the model (a wrapper may chain it)
        frames = [(f.filename, f.lineno, f.name, f.line or "") for f in traceback.extract_tb(e.__traceback__)]
        if _innermost(frames) is None:
            frames, e = [], e.__cause__ or e.__context__
    return _innermost(frames)


def _stack_where(stack: str | None) -> Where | None:
    if not stack:
        return None
    return _innermost(m.groups() for m in _FRAME.finditer(stack))


def backend_failed(error: BaseException, gm: torch.fx.GraphModule) -> BackendError | None:
    """What ``error``, raised by a backend compiling ``gm`` (a traced step), means: a :class:`BackendError` naming
    the operation it failed on and the model's line that made it (from the node's recorded stack), or ``None``
    when the error names no operation of the graph (it is then raised as it is)."""
    text = str(error)
    node = None
    m = _EXECUTING.search(text)
    if m is not None:
        node = next((n for n in gm.graph.nodes if n.name == m.group(1)), None)
    if node is not None and node.op == "call_function":
        what = str(getattr(node.target, "__name__", node.target)).split(".default")[0]
        what = f"aten.{what}" if isinstance(node.target, torch._ops.OpOverload) and \
            node.target.namespace == "aten" and not what.startswith("aten.") else what
        stack = node.meta.get("stack_trace")
    else:
        target = _TARGET.search(text)
        what = _op_named(target.group(1)) if target is not None else _op_named(text)
        stack = text.split("Original traceback:", 1)[1] if "Original traceback:" in text else None
    if what is None and node is None:
        return None
    where = _stack_where(stack)
    at = f" made at {where}" if where is not None else " (the trace recorded no model line for it)"
    e = BackendError(
        f"ft.compile: the backend could not compile the traced step: {what}{at} failed with "
        f"{_qualname(error)}: {_first_line(error)}. The step runs eagerly and traces as one graph; the backend's "
        f"lowering of this operation fails (torch {torch.__version__}). What to do: pass capture=\"dynamo\" to "
        f"ft.compile (torch.compile traces the step with the backend's own decompositions), or backend=\"aot_eager\" "
        f"(no code generation), or change the model's setting that makes the operation (for transformers models, "
        f"attn_implementation=\"eager\" or \"sdpa\"); see docs/models.md. The backend said:\n{text[:4000]}")
    e.what, e.where = what, where
    return e
