"""Graph breaks found where they are written: host reads, ``print`` and data-dependent shapes, named by line.

A compiled step is one graph with no host sync. ``make_fx`` traces a step with fake tensors, and some
host work does not fail that trace: ``y.item()`` becomes an unbacked scalar (a graph inductor then cannot
compile: torch's ``DataDependentOutputException`` minutes later, in a worker), ``x[mask]`` a tensor of
unbacked size, and ``print`` simply runs once, while tracing, and never again. This module finds them at the
trace, so that :func:`functrain.compiler.errors.explain` can raise :class:`~functrain.GraphBreakError`
naming the operation and the user's line, in the blocking and the background path alike:

* :func:`no_print` refuses ``print`` called from the user's code while the step is traced;
* :func:`data_dependent` finds, in a traced graph, the first node whose value or size depends on the data;
* :func:`locate` runs the step eagerly under a ``TorchFunctionMode`` that records the first host read
  (``.item()``, ``.tolist()``, ``bool()`` of a tensor: a Python ``if`` on it, ``x[mask]``, ``nonzero``, a
  tensor formatted for printing) made from the user's code: its line is what the error names.

"The user's code" is the innermost frame outside torch's and functrain's own packages. When that line runs in a
transform's hook (the hook's method, a function it calls, or a function defined in it: the wrapper ``wrap_loss``
returns, a lambda given to ``tree_map``), :attr:`Where.hook` names the transform's class and the hook, so that the
error says which transform to fix rather than the loss function.
"""
from __future__ import annotations

import builtins
import contextlib
import linecache
import os
import sys
from typing import Any, Callable, Iterator, NamedTuple

import torch

from ..core.transform import HOOKS, Transform

__all__ = ["HostSync", "Where", "no_print", "data_dependent", "locate", "describe"]

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_OWN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


class Where(NamedTuple):
    """A line of the user's code: file, line number, function and the line's text; ``hook``: ``"Name.hook"`` when
    the line runs in the hook of a transform (class ``Name``), else ``None``."""

    file: str
    line: int
    function: str
    text: str
    hook: str | None = None

    def __str__(self) -> str:
        return f"{self.file}:{self.line} in {self.function}" + (f": `{self.text}`" if self.text else "")


class HostSync(RuntimeError):
    """What a trace found that cannot be one graph: ``what`` (an operation, e.g. ``".item()"``, ``"print"``),
    and ``where`` (a :class:`Where` in the user's code, or ``None`` when the trace cannot tell)."""

    def __init__(self, what: str, where: Where | None = None):
        super().__init__(f"{what}" + (f" at {where}" if where is not None else ""))
        self.what, self.where = what, where


def is_users(filename: str) -> bool:
    """Whether ``filename`` is the user's code (a model's included): outside torch's and functrain's packages."""
    path = os.path.abspath(filename)
    return not (path.startswith(_TORCH_DIR) or path.startswith(_OWN_DIR) or filename.startswith("<"))


def users_frame(frame: Any) -> Where | None:
    """The innermost frame of the user's code at or above ``frame``, or ``None`` if that is functrain's (its
    own host work, not the user's) or there is none."""
    while frame is not None:
        filename = frame.f_code.co_filename
        path = os.path.abspath(filename)
        if not path.startswith(_TORCH_DIR) and not filename.startswith("<frozen"):
            if path.startswith(_OWN_DIR):
                return None
            text = linecache.getline(filename, frame.f_lineno).strip()
            return Where(filename, frame.f_lineno, frame.f_code.co_name, text[:200], _hook_of(frame))
        frame = frame.f_back
    return None


def _hook_of(frame: Any) -> str | None:
    """``"Name.hook"`` when the user's line at ``frame`` runs in a hook of a transform of class ``Name``: its function
    was defined in the hook (the code's qualified name is ``<class>.<hook>.<locals>...`` and that class is a
    Transform), or the hook's method (``self`` a Transform) is on the stack above it. A wrapper returned by
    ``wrap_loss`` that calls the loss function is not above the loss's line: that line stays the loss's."""
    qualname = getattr(frame.f_code, "co_qualname", "")  # (Python >= 3.11)
    for hook in HOOKS:
        marker = f".{hook}.<locals>."
        if marker in qualname:
            owner = qualname.split(marker)[0]
            module = frame.f_globals.get("__name__")
            if any(c.__qualname__ == owner and c.__module__ == module for c in _subclasses(Transform)):
                return f"{owner.rpartition('.')[2]}.{hook}"
    while frame is not None:
        if frame.f_code.co_name in HOOKS:
            owner = frame.f_locals.get("self")
            if isinstance(owner, Transform):
                return f"{type(owner).__name__}.{frame.f_code.co_name}"
        frame = frame.f_back
    return None


def _subclasses(cls: type) -> list[type]:
    out, todo = [], [cls]
    while todo:
        for sub in todo.pop().__subclasses__():
            out.append(sub)
            todo.append(sub)
    return out


@contextlib.contextmanager
def no_print() -> Iterator[None]:
    """While the step is traced: ``print`` from the user's code raises :class:`HostSync` (it would print once,
    at the trace, and never at a compiled step). ``print`` from torch or functrain passes."""
    real = builtins.print

    def refused(*args: Any, **kwargs: Any) -> None:
        where = users_frame(sys._getframe(1))
        if where is None:
            return real(*args, **kwargs)
        raise HostSync("print", where)

    builtins.print = refused
    try:
        yield
    finally:
        builtins.print = real


def data_dependent(gm: torch.fx.GraphModule) -> str | None:
    """The first node of ``gm`` whose value or size the data decides (an unbacked symbol: ``.item()`` of a
    traced tensor, ``nonzero``, ``x[mask]``), as ``"aten.<op>"``; ``None`` if there is none. A scalar read of a
    constant is a number in the graph, not a symbol: not one of these."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        val = node.meta.get("val")
        try:
            unbacked = bool(free_unbacked_symbols(val)) if val is not None else False
        except Exception:  # noqa: BLE001 - a value the walk does not know: not a symbol
            unbacked = False
        if unbacked:
            return str(node.target).split(".default")[0]
    return None


# the host reads the eager step is watched for, and what each means
_READS: dict[str, str] = {
    "item": "`.item()` reads a tensor's value on the host (a host sync)",
    "tolist": "`.tolist()` reads a tensor's values on the host (a host sync)",
    "numpy": "`.numpy()` reads a tensor's values on the host (a host sync)",
    "__float__": "`float(tensor)` reads a tensor's value on the host (a host sync)",
    "__int__": "`int(tensor)` reads a tensor's value on the host (a host sync)",
    "__index__": "a tensor used as a Python index reads its value on the host (a host sync)",
    "__bool__": "a Python branch on a tensor's value (`if`/`while`/`and`/`or` on a tensor calls bool(): a host sync)",
    "__format__": "a tensor formatted as text (print, an f-string) reads its values on the host",
    "__repr__": "a tensor formatted as text (print, repr) reads its values on the host",
    "__str__": "a tensor formatted as text (print, str) reads its values on the host",
    "nonzero": "`nonzero` makes a tensor whose size depends on the data (a data-dependent shape)",
    "argwhere": "`argwhere` makes a tensor whose size depends on the data (a data-dependent shape)",
    "masked_select": "`masked_select` makes a tensor whose size depends on the data (a data-dependent shape)",
    "unique": "`unique` makes a tensor whose size depends on the data (a data-dependent shape)",
    "__getitem__": "indexing with a boolean mask (`x[mask]`) makes a tensor whose size depends on the data "
                   "(a data-dependent shape)",
}


def describe(what: str) -> str:
    """What a found host read means, in words (``what``: a name of :data:`_READS`, or ``"print"``)."""
    if what == "print":
        return "`print` in the step runs once, while it is traced, never at a compiled step"
    return _READS.get(what, f"`{what}` cannot be part of one graph")


def _name(func: Callable) -> str:
    return getattr(func, "__name__", "") or ""


def _is_read(func: Callable, args: tuple) -> str | None:
    name = _name(func)
    if name not in _READS:
        return None
    if name == "__getitem__":  # only a boolean mask makes a data-dependent shape
        index = args[1] if len(args) > 1 else None
        items = index if isinstance(index, tuple) else (index,)
        if not any(torch.is_tensor(i) and i.dtype == torch.bool for i in items):
            return None
    return name


class _Recorder(torch.overrides.TorchFunctionMode):
    """Records the first host read made from the user's code (see :func:`locate`)."""

    def __init__(self) -> None:
        super().__init__()
        self.found: tuple[str, Where] | None = None

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        if self.found is None:
            name = _is_read(func, args)
            if name is not None:
                where = users_frame(sys._getframe(1))
                if where is not None:
                    self.found = (name, where)
        return func(*args, **(kwargs or {}))


def locate(run: Callable[[], Any]) -> tuple[str, Where] | None:
    """Run ``run()`` (the eager step) and return the first host read its user code made, as ``(name, where)``
    (``name``: a key of :data:`_READS`), or ``None``. ``run``'s exceptions propagate."""
    recorder = _Recorder()
    with recorder:
        run()
    return recorder.found
