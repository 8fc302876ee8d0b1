"""What a failed capture means: the user's own error, an empty batch, or a step that is not one graph.

A tracer (make_fx on the direct path, Dynamo on the other) reports an exception raised by
the user's code while tracing (a bad loss, a batch of the wrong shape) wrapped in pages of
its own logs. :func:`explain` runs the step eagerly once: if that raises, the user's error
is raised instead (without the tracer's chain); if it runs, the step cannot be captured as
one graph and :class:`GraphBreakError` says so, quoting the tracer.
"""
from __future__ import annotations

from typing import Any

import optree
import torch

from ..core.step import Step
from ..core.validate import path_str
from .host_sync import HostSync, describe, locate

__all__ = ["GraphBreakError", "explain"]


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
            cause = _first_line(error)
        hook = found.where.hook if found is not None else None
        fix = "the loss function" if hook is None else f"the transform {hook}"
        e = GraphBreakError(
            f"the step cannot be compiled as one graph (fullgraph=True): {cause}. "
            f"A step must have no host sync (.item(), print, Python branches on tensor values, data-dependent "
            f"shapes) and call only traceable code; fix {fix}, or pass fullgraph=False to ft.compile "
            f"to allow graph breaks (slower). The tracer ({tracer}) said:\n{error}")
        if found is not None:
            e.what, e.where = found.what, found.where
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
