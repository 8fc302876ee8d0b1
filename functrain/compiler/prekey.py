"""The pre-trace key: what defines a step's graph, hashed before anything is traced.

A warm start (:mod:`functrain.compiler.warm`) looks its compiled code up by this key, so a later process runs
compiled code from its first call without importing the tracer or the compiler. The key hashes:

* the step's Python: the loss function and everything it reaches, walked — each function's code (bytecode,
  constants, names; not its file or line), its defaults, the values in its closure cells and the module globals
  its code reads; a class's methods and attributes (not ``__init__`` and the other construction and printing
  methods: the object's attributes are walked instead); an object's attributes (an ``nn.Module``'s non-tensor
  settings, its submodules, hooks); the optimizer's and each transform's settings;
* every tensor the walk meets by shape, stride, dtype, device and ``requires_grad`` (not its values: a tensor
  the step closes over is read at call time, and a capture that lifted one is never kept for a warm start);
* the input signature: the state's and batch's tree structure, each tensor's shape, stride, dtype and device, the
  non-tensor leaves' values;
* the memory kind and the compile options, the torch build, the Python, functrain's own source (all of it: a
  changed functrain is a new key), the machine (host, CPU features; :func:`~functrain.compiler.probe_memo.machine`).

Code of libraries is keyed by its name and its library's version, not walked: torch, optree, numpy, Python's
standard library, and any package whose top-level module has a ``__version__``; functrain's functions by name
with their closures walked (their settings), its code by the source digest.

Data is not structure. A value the state carries as a hyper-parameter (:mod:`functrain.core.hyper`: the learning
rate, a schedule's constants, betas, a clip's max norm, the EMA's decay, ...) is read by the graph as an input,
so it must not change the key: an object declares such fields by ``GRAPH_DATA`` (a tuple of attribute names;
an object with a ``hyper`` dict declares ``hyper`` by having it), and each value found in them (the very object,
wherever else the walk meets it, e.g. in a closure cell) is keyed by its type only. A memo declares
``GRAPH_CACHE = True``: its contents (filled by the first calls) are keyed by nothing but its type.

What a key cannot see — a function patched in a library, a global changed in place, an object the walk cannot
look into — is not trusted: the warm start checks the loaded code against one eager step before using it.
"""
from __future__ import annotations

import dis
import enum
import functools
import hashlib
import json
import os
import sys
import types
from typing import Any

import torch

from .probe_memo import machine

__all__ = ["pretrace_key", "step_digest", "KeyTooLarge"]

_FORMAT = 1
_MAX_OBJECTS = 200_000  # a walk past this many objects gives no key (the step is traced as before)
_LIBRARIES = frozenset({"torch", "optree", "numpy", "builtins", "typing_extensions"}) | frozenset(
    getattr(sys, "stdlib_module_names", ()))
_PRIMITIVES = (type(None), bool, int, float, complex, str, bytes)


class KeyTooLarge(Exception):
    """The walk met more objects than :data:`_MAX_OBJECTS`: no key."""


def pretrace_key(step: Any, spec: Any, metas: tuple, consts: tuple, structure: dict) -> str | None:
    """The pre-trace key of ``step`` for one input signature (``spec``: the treespec of ``(state, batch)``,
    ``metas``: each tensor's ``(shape, stride, dtype, device)``, ``consts``: the non-tensor leaves), compiled with
    ``structure`` (the memory kind and the compile options, JSON-able); ``None`` when the step cannot be keyed."""
    digest = step_digest(step)
    if digest is None:
        return None
    material = json.dumps({
        "format": _FORMAT,
        "step": digest,
        "spec": repr(spec),
        "metas": [[list(s), list(st), str(d), str(dev)] for s, st, d, dev in metas],
        "consts": [[i, t.__qualname__, repr(v)] for i, t, v in consts],
        "structure": structure,
        "functrain": _functrain_source(),
        "machine": machine(),
    }, sort_keys=True, default=repr)
    return hashlib.sha256(material.encode()).hexdigest()[:40]


def step_digest(step: Any) -> str | None:
    """The digest of the step's Python (its loss function, optimizer and transforms, walked); ``None`` when the
    walk met more than :data:`_MAX_OBJECTS` objects."""
    walker = _Walker()
    try:
        walker.visit(type(step))
        walker.visit(step.loss_fn)
        walker.visit(step.optimizer)
        walker.visit(step.transforms)
    except KeyTooLarge:
        return None
    return walker.hash.hexdigest()


@functools.lru_cache(maxsize=1)
def _functrain_source() -> str:
    """A digest of every Python file of the functrain package (functrain's code is keyed by it, not walked)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    h = hashlib.sha256()
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                h.update(os.path.relpath(path, root).encode())
                with open(path, "rb") as f:
                    h.update(hashlib.sha256(f.read()).digest())
    return h.hexdigest()


def _top(module_name: str | None) -> str:
    return (module_name or "").partition(".")[0]


def _library_version(module_name: str | None) -> str | None:
    """The version a library's code is keyed by, or ``None`` when the module is not a library's (walked)."""
    top = _top(module_name)
    if top in _LIBRARIES:
        return f"{top} {torch.__version__} {torch.version.git_version}" if top == "torch" else top
    if top == "functrain":
        return "functrain"  # (its source digest is part of the key)
    mod = sys.modules.get(top)
    version = getattr(mod, "__version__", None) if mod is not None else None
    return f"{top} {version}" if isinstance(version, str) else None


class _Walker:
    """One walk: every object visited once (a cycle is a back-reference), tokens into one SHA-256."""

    def __init__(self) -> None:
        self.hash = hashlib.sha256()
        self.seen: dict[int, int] = {}
        self.keep: list = []  # the objects seen, alive while walking (their ids stay theirs)
        self.data: set[int] = set()  # ids of values declared data (GRAPH_DATA)

    def token(self, *parts: Any) -> None:
        self.hash.update(repr(parts).encode())
        self.hash.update(b"\x00")

    def visit(self, x: Any) -> None:
        if isinstance(x, _PRIMITIVES):
            if id(x) in self.data and not _interned(x):
                self.token("data", type(x).__name__)
            else:
                self.token(type(x).__name__, x)
            return
        if isinstance(x, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
            self.token("torch", repr(x))
            return
        ref = self.seen.get(id(x))
        if ref is not None:
            self.token("ref", ref)
            return
        if len(self.seen) >= _MAX_OBJECTS:
            raise KeyTooLarge
        self.seen[id(x)] = len(self.seen)
        self.keep.append(x)
        if id(x) in self.data:
            self.data_value(x)
        elif isinstance(x, torch.Tensor):
            self.token("tensor", tuple(x.shape), x.stride() if x.layout == torch.strided else None, str(x.dtype),
                       str(x.device), x.requires_grad, type(x).__qualname__)
        elif isinstance(x, enum.Enum):
            self.token("enum", _name(type(x)), x.name)
        elif isinstance(x, types.FunctionType):
            self.function(x)
        elif isinstance(x, types.MethodType):
            self.token("method")
            self.visit(x.__func__)
            self.visit(x.__self__)
        elif isinstance(x, (types.BuiltinFunctionType, types.BuiltinMethodType, types.WrapperDescriptorType,
                            types.MethodWrapperType, types.MethodDescriptorType)):
            self.token("builtin", getattr(x, "__module__", None), getattr(x, "__qualname__", repr(x)))
        elif isinstance(x, functools.partial):
            self.token("partial")
            self.visit(x.func)
            self.visit(x.args)
            self.visit(x.keywords)
        elif isinstance(x, types.ModuleType):
            self.module(x)
        elif isinstance(x, type):
            self.cls(x)
        elif isinstance(x, (staticmethod, classmethod)):
            self.token(type(x).__name__)
            self.visit(x.__func__)
        elif isinstance(x, property):
            self.token("property")
            for f in (x.fget, x.fset, x.fdel):
                self.visit(f)
        elif isinstance(x, types.CodeType):
            self.code(x)
        elif isinstance(x, dict):
            self.token("dict", type(x).__qualname__, len(x))
            for k, v in x.items():
                self.visit(k)
                self.visit(v)
        elif isinstance(x, (list, tuple)) and not hasattr(x, "_fields"):
            self.token(type(x).__qualname__, len(x))
            for v in x:
                self.visit(v)
        elif isinstance(x, (set, frozenset)):
            self.token(type(x).__qualname__, sorted(repr(v) for v in x))
        elif _is_numpy(x):
            self.token("ndarray", x.shape, str(x.dtype), hashlib.sha256(x.tobytes()).hexdigest())
        else:
            self.instance(x)

    def data_value(self, x: Any) -> None:
        """A value declared data: its type and, for a container, its structure (keys), not its numbers."""
        if isinstance(x, dict):
            self.token("data-dict", sorted(map(str, x)))
            for v in x.values():
                if isinstance(v, dict):
                    self.visit(v)
                else:
                    self.token("data", type(v).__name__)
        elif isinstance(x, torch.Tensor):
            self.token("data-tensor", str(x.dtype), str(x.device), tuple(x.shape))
        elif isinstance(x, _PRIMITIVES):
            self.token("data", type(x).__name__)
        else:  # (a schedule: its kind and formula are structure, its constants data)
            self.data.discard(id(x))
            self.instance(x)

    def declare_data(self, x: Any) -> None:
        """Mark ``x`` and everything in it (dicts, lists, tuples) as data."""
        self.data.add(id(x))
        if isinstance(x, dict):
            for v in x.values():
                self.declare_data(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                self.declare_data(v)

    def function(self, fn: types.FunctionType) -> None:
        library = _library_version(fn.__module__)
        self.token("function", fn.__module__, fn.__qualname__, library)
        if library is None:
            self.code(fn.__code__)
        self.visit(fn.__defaults__)
        self.visit(fn.__kwdefaults__)
        for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
            self.token("cell", name)
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell (a name bound later)
                self.token("empty")
                continue
            self.visit(value)
        if library is None:  # the module globals its code reads
            g = fn.__globals__
            builtins = g.get("__builtins__", {})
            for name in sorted(_names(fn.__code__)):
                if name in g:
                    self.token("global", name)
                    self.visit(g[name])
                elif name in (builtins if isinstance(builtins, dict) else vars(builtins)):
                    self.token("builtin-name", name)

    def code(self, co: types.CodeType) -> None:
        self.token("code", co.co_code, co.co_names, co.co_varnames, co.co_freevars, co.co_cellvars, co.co_argcount,
                   co.co_kwonlyargcount, co.co_posonlyargcount, co.co_flags)
        for c in co.co_consts:
            if isinstance(c, types.CodeType):
                self.code(c)
            else:
                self.token("const", type(c).__name__, repr(c))

    def module(self, m: types.ModuleType) -> None:
        library = _library_version(m.__name__)
        if library is not None:
            self.token("module", m.__name__, library)
            return
        path = getattr(m, "__file__", None)
        if path and os.path.isfile(path):
            with open(path, "rb") as f:
                self.token("module", m.__name__, hashlib.sha256(f.read()).hexdigest())
        else:
            self.token("module", m.__name__, None)

    def cls(self, c: type) -> None:
        library = _library_version(c.__module__)
        self.token("class", c.__module__, c.__qualname__, library)
        if library is not None:
            return
        for base in c.__bases__:
            self.visit(base)
        for name, value in c.__dict__.items():
            if name in _NOT_RUN:
                continue
            self.token("attr", name)
            self.visit(value)

    def instance(self, x: Any) -> None:
        self.visit(type(x))
        if getattr(type(x), "GRAPH_CACHE", False) is True:  # a memo (declared): its contents are no structure
            self.token("cache")
            return
        fields = _fields(x)
        if fields is None:  # an object the walk cannot look into (a C object): its type only; the check covers it
            self.token("opaque")
            return
        declared = getattr(type(x), "GRAPH_DATA", None)
        names = set(declared) if isinstance(declared, tuple) else set()
        hyper = fields.get("hyper")
        if isinstance(hyper, dict):  # an object holding hyper-parameters: they, and its fields of their names
            names |= {"hyper", *map(str, hyper)}
        names &= fields.keys()
        for name in names:
            self.declare_data(fields[name])
        for name, value in fields.items():
            self.token("field", name)
            if name in names:
                self.seen_data(value)
            else:
                self.visit(value)

    def seen_data(self, value: Any) -> None:
        """A declared data field's value: keyed by its type and structure (a small int included)."""
        if isinstance(value, _PRIMITIVES):
            self.token("data", type(value).__name__)
        else:
            self.visit(value)


# a class's attributes a step does not run: bookkeeping, and construction and printing (an object's attributes are
# walked themselves: the code that set them is not what the graph runs, and it may read globals that change)
_NOT_RUN = frozenset({"__dict__", "__weakref__", "__doc__", "__module__", "__qualname__", "__annotations__",
                      "__init__", "__new__", "__init_subclass__", "__del__", "__repr__", "__str__", "extra_repr",
                      "__reduce__", "__reduce_ex__", "__getstate__", "__setstate__"})


def _fields(x: Any) -> dict | None:
    """An object's attributes by name: a named tuple's fields, its ``__dict__`` and ``__slots__``; ``None``:
    none to read."""
    if isinstance(x, tuple) and hasattr(type(x), "_fields"):
        return dict(zip(type(x)._fields, x))
    out: dict = {}
    d = getattr(x, "__dict__", None)
    if isinstance(d, dict):
        out.update(d)
    for klass in type(x).__mro__:
        for name in klass.__dict__.get("__slots__", ()):
            if name not in ("__dict__", "__weakref__") and hasattr(x, name):
                out[name] = getattr(x, name)
    if not out and d is None and not any("__slots__" in k.__dict__ for k in type(x).__mro__[:-1]):
        return None
    return out


def _names(co: types.CodeType) -> set:
    """The module globals the code (and the code nested in it) reads or writes (not its attribute names)."""
    names = {i.argval for i in dis.get_instructions(co) if i.opname in _GLOBAL_OPS}
    for c in co.co_consts:
        if isinstance(c, types.CodeType):
            names |= _names(c)
    return names


_GLOBAL_OPS = frozenset({"LOAD_GLOBAL", "LOAD_NAME", "STORE_GLOBAL", "DELETE_GLOBAL", "STORE_NAME", "DELETE_NAME"})


def _name(c: type) -> str:
    return f"{c.__module__}.{c.__qualname__}"


def _interned(x: Any) -> bool:
    """A value Python shares between unrelated uses (None, bools, small ints, short strings): its identity says
    nothing about where it came from."""
    return x is None or isinstance(x, bool) or (isinstance(x, int) and -5 <= x <= 256) or isinstance(x, str)


def _is_numpy(x: Any) -> bool:
    np = sys.modules.get("numpy")
    return np is not None and isinstance(x, np.ndarray)
