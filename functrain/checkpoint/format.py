"""The checkpoint format: file names, dtype codes, the allow-list of node types, and the state tree <-> JSON.

``tree.json`` holds the structure of a saved state: node types (by allow-listed
name), dict keys, NamedTuple fields, Python scalars inline, and each tensor by its
key in the safetensors file with its dtype and shape. Nothing here touches files.
"""
from __future__ import annotations

import collections
import json
from typing import Any

import optree
import torch

from ..core.tree import find_nodes
from ..core.validate import path_str
from ..core.registry import type_by_name, type_name

FORMAT = "functrain-checkpoint"
VERSION = 1
TENSORS, TREE, EXTRA, MARKER = "tensors.safetensors", "tree.json", "extra.json", "COMPLETE.json"

# torch dtype <-> safetensors dtype code (the ones both sides support)
ST_CODES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint64: "U64", torch.uint32: "U32", torch.uint16: "U16", torch.uint8: "U8",
    torch.bool: "BOOL", torch.complex64: "C64",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.float8_e4m3fnuz: "F8_E4M3FNUZ", torch.float8_e5m2fnuz: "F8_E5M2FNUZ",
}
_DTYPES = {str(d).removeprefix("torch."): d for d in ST_CODES}  # "float32" -> torch.float32 (allow-list)


class CheckpointError(ValueError):
    """A checkpoint that is incomplete, damaged, not a functrain checkpoint, or does not match the template.

    A ``ValueError``; the message names the file and what is wrong with it.

    Example::

        >>> import tempfile, functrain as ft
        >>> try:
        ...     ft.load(tempfile.mkdtemp())
        ... except ft.CheckpointError as e:
        ...     print("no completion mark" in str(e))
        True
    """

    __module__ = "functrain.checkpoint"  # its public home, in reprs and tracebacks


class CheckpointSpaceError(OSError):
    """A checkpoint that does not fit: the disk or quota is full (ENOSPC, EDQUOT), or a file would pass the
    process's file-size limit (EFBIG, ``RLIMIT_FSIZE``). An ``OSError`` with that errno.

    Nothing of the new checkpoint is left behind, and the older ones are intact. :func:`save`
    raises it; you catch it (``except OSError`` does too).

    Args:
        errno_: the ``errno`` (``errno.ENOSPC``, ``errno.EDQUOT`` or ``errno.EFBIG``).
        message: the error's text (its ``strerror`` and ``str``).
        path: the checkpoint, kept as the attribute ``path``.
        needed: the bytes it needs, kept as ``needed``.
        free: the bytes the file system (or the size limit) allows, or ``None`` if unknown; kept as ``free``.

    Example::

        >>> import errno
        >>> from functrain.checkpoint import CheckpointSpaceError
        >>> e = CheckpointSpaceError(errno.ENOSPC, "no space for ckpt", "/ckpt", needed=10, free=2)
        >>> isinstance(e, OSError), e.errno == errno.ENOSPC, e.needed, e.free, str(e)
        (True, True, 10, 2, 'no space for ckpt')
    """

    __module__ = "functrain.checkpoint"  # its public home, in reprs and tracebacks

    def __init__(self, errno_: int, message: str, path: str, needed: int, free: int | None):
        super().__init__(errno_, message)
        self.path, self.needed, self.free = path, needed, free

    def __str__(self) -> str:
        return self.strerror


def check_size(path: str, size: int, expect: dict) -> None:
    """Refuse a file whose size is not the one its completion-mark entry ``expect`` lists."""
    if size != expect.get("size"):
        raise CheckpointError(f"{path}: size {size} bytes, the completion mark says {expect.get('size')}: "
                              f"the file was truncated or changed")


def json_bytes(obj: Any) -> bytes:
    """The bytes of a JSON file (or header) of the format: compact, UTF-8."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


# -------------------------------------------------------------------------- tree <-> JSON
class TensorRef:
    """A tensor leaf of the structure read from tree.json, before its data is read."""

    __slots__ = ("key", "dtype", "shape")

    def __init__(self, key: str, dtype: torch.dtype, shape: tuple):
        self.key, self.dtype, self.shape = key, dtype, shape


def _scalar(value: Any, where: str) -> dict:
    if value is None:
        return {"t": "none"}
    if isinstance(value, bool):
        return {"t": "bool", "v": value}
    if type(value) is int:
        return {"t": "int", "v": value}
    if type(value) is float:
        return {"t": "float", "v": value.hex()}
    if type(value) is str:
        return {"t": "str", "v": value}
    raise TypeError(f"cannot checkpoint the leaf at {where!r}: {type(value).__name__} (a checkpoint holds tensors, "
                    f"dict/list/tuple/NamedTuple nodes, None, bool, int, float and str)")


def encode(tree: Any) -> tuple[dict, list[tuple[str, torch.Tensor]]]:
    """tree.json's node for ``tree`` and the tensor leaves as ``[(key, tensor)]`` in tree order."""
    tensors: list[tuple[str, torch.Tensor]] = []
    used: set[str] = {"__metadata__"}  # reserved by safetensors headers

    def key_for(path: list[str]) -> str:
        key = path_str(path)
        base, n = key, 0
        while key in used:
            n += 1
            key = f"{base}~{n}"
        used.add(key)
        return key

    def enc(x: Any, path: list[str]) -> dict:
        where = path_str(path)
        if torch.is_tensor(x):
            if x.layout != torch.strided or x.is_quantized or x.is_nested or x.device.type == "meta":
                raise TypeError(f"cannot checkpoint the tensor at {where!r}: only dense (strided) tensors with "
                                f"data; this one is {x.layout}{' quantized' if x.is_quantized else ''} on {x.device}")
            if x.dtype not in ST_CODES:
                raise TypeError(f"cannot checkpoint the tensor at {where!r}: dtype {x.dtype} has no safetensors "
                                f"code; supported: {', '.join(sorted(_DTYPES))}")
            key = key_for(path)
            tensors.append((key, x))
            return {"t": "tensor", "key": key, "dtype": str(x.dtype).removeprefix("torch."),
                    "shape": list(x.shape), "device": str(x.device)}
        cls = type(x)
        if cls is dict or cls is collections.OrderedDict:
            keys = list(x)
            return {"t": "dict" if cls is dict else "odict",
                    "keys": [_key(k, where) for k in keys],
                    "children": [enc(x[k], path + [str(k)]) for k in keys]}
        if cls is list or cls is tuple:
            return {"t": cls.__name__, "children": [enc(c, path + [str(i)]) for i, c in enumerate(x)]}
        if isinstance(x, tuple) and hasattr(cls, "_fields"):
            name = type_name(cls)
            if name is None:
                raise TypeError(f"cannot checkpoint the {cls.__module__}.{cls.__qualname__} at {where!r}: not an "
                                f"allowed node type; register it with ft.register_checkpoint_type({cls.__name__})")
            return {"t": "namedtuple", "type": name, "fields": list(cls._fields),
                    "children": [enc(c, path + [f]) for f, c in zip(cls._fields, x)]}
        if x is None or isinstance(x, (bool, int, float, str)):
            return _scalar(x, where)
        raise TypeError(f"cannot checkpoint the {cls.__module__}.{cls.__qualname__} at {where!r}: a checkpoint holds "
                        f"tensors, dict/list/tuple/OrderedDict/registered NamedTuple nodes, None, bool, int, "
                        f"float and str")

    return enc(tree, []), tensors


def _key(k: Any, where: str) -> dict:
    if k is None or isinstance(k, (bool, int, str)):
        return _scalar(k, where)
    raise TypeError(f"cannot checkpoint the dict at {where!r}: key {k!r} is a {type(k).__name__} "
                    f"(keys must be str, int, bool or None)")


def decode(node: Any, file: str) -> Any:
    """Rebuild the tree from tree.json's node, with a :class:`TensorRef` for each tensor."""

    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{file}: invalid structure ({what})")

    def fields(n: dict, *names: str) -> list:
        if set(n) != {"t", *names}:
            raise bad(f"a {n.get('t')!r} node has keys {sorted(n)}, expected {sorted({'t', *names})}")
        return [n[k] for k in names]

    def children(n: Any) -> list:
        if not isinstance(n, list):
            raise bad("children must be a list")
        return [dec(c) for c in n]

    def scalar(n: dict) -> Any:
        t = n["t"]
        if t == "none":
            fields(n)
            return None
        (v,) = fields(n, "v")
        if t == "bool" and isinstance(v, bool):
            return v
        if t == "int" and type(v) is int:
            return v
        if t == "str" and isinstance(v, str):
            return v
        if t == "float" and isinstance(v, str):
            try:
                return float.fromhex(v)
            except (ValueError, OverflowError):
                pass
        raise bad(f"bad {t!r} value {v!r}")

    def dec(n: Any) -> Any:
        if not isinstance(n, dict) or not isinstance(n.get("t"), str):
            raise bad("a node must be an object with a string 't'")
        t = n["t"]
        if t == "tensor":
            key, dtype, shape, _device = fields(n, "key", "dtype", "shape", "device")
            if not isinstance(key, str) or dtype not in _DTYPES or not isinstance(shape, list) or \
                    not all(type(s) is int and s >= 0 for s in shape):
                raise bad(f"bad tensor entry {n!r}")
            return TensorRef(key, _DTYPES[dtype], tuple(shape))
        if t in ("dict", "odict"):
            keys, kids = fields(n, "keys", "children")
            if not isinstance(keys, list) or not isinstance(kids, list) or len(keys) != len(kids):
                raise bad("a dict needs keys and children lists of the same length")
            if not all(isinstance(k, dict) and k.get("t") in ("none", "bool", "int", "str") for k in keys):
                raise bad("dict keys must be str, int, bool or None")
            ks = [scalar(k) for k in keys]
            cls = dict if t == "dict" else collections.OrderedDict
            out = cls(zip(ks, children(kids)))
            if len(out) != len(ks):
                raise bad("dict keys must be distinct")
            return out
        if t in ("list", "tuple"):
            (kids,) = fields(n, "children")
            out = children(kids)
            return out if t == "list" else tuple(out)
        if t == "namedtuple":
            name, names, kids = fields(n, "type", "fields", "children")
            cls = type_by_name(name) if isinstance(name, str) else None
            if cls is None:
                raise CheckpointError(f"{file}: node type {name!r} is not an allowed checkpoint type; if it is "
                                      f"yours, call ft.register_checkpoint_type(<the class>, name={name!r}) first")
            known, defaults = list(cls._fields), cls._field_defaults
            # a type that gained fields with defaults since the file was written (e.g. an optimizer state's
            # ``hyper``): the file's fields are a prefix; the new ones take their defaults here, the template's
            # values in complete()
            if names != known and not (names == known[:len(names)] and all(f in defaults for f in known[len(names):])):
                raise bad(f"{name} has fields {names}, the registered class has {list(cls._fields)}")
            out = children(kids)
            if len(out) != len(names):
                raise bad(f"{name} needs {len(names)} children")
            return cls._make(out + [defaults[f] for f in known[len(names):]])
        if t in ("none", "bool", "int", "float", "str"):
            return scalar(n)
        raise bad(f"unknown node type {t!r}")

    try:
        return dec(node)
    except RecursionError:
        raise bad("nested too deeply") from None


def complete(loaded: Any, template: Any) -> Any:
    """``loaded`` (a decoded tree) with what an older file lacks taken from ``template`` (e.g. ``step.init``'s state).

    Two things, both additions of a newer functrain that hold settings, not training progress: a ``NamedTuple``
    field that the class gives a default (``None``) and the loaded tree holds at that default, where the template
    holds a value (an optimizer state's ``hyper``, the hyper-parameters as data: the template's are the
    constructor's, what the old code used); and a dict entry (a transform's slot) only in the template whose value is
    a ``NamedTuple`` all of whose fields have defaults (a slot of settings only, such as ``clip``'s). The
    template's tensors are copied. Everything else is left for :func:`match` to compare.

    Example::

        >>> import torch
        >>> from functrain.optim import adam
        >>> state = adam(1e-3).init({"w": torch.ones(1)})
        >>> old = state._replace(hyper=None)            # what a checkpoint written before the field loads as
        >>> from functrain.core.hyper import get_hyper
        >>> float(get_hyper(complete(old, adam(3e-4).init({"w": torch.ones(1)})))["lr"])
        0.0003
    """
    def copy(x: Any) -> Any:
        return optree.tree_map(lambda t: t.detach().clone() if torch.is_tensor(t) else t, x)

    def walk(a: Any, b: Any) -> Any:
        cls = type(a)
        if isinstance(a, tuple) and hasattr(cls, "_fields") and type(b) is cls:
            defaults = cls._field_defaults
            return cls._make(copy(y) if f in defaults and x is defaults[f] and y is not defaults[f] else walk(x, y)
                             for f, x, y in zip(cls._fields, a, b))
        if isinstance(a, dict) and isinstance(b, dict):
            out = cls((k, walk(v, b[k]) if k in b else v) for k, v in a.items())
            for k, v in b.items():
                if k not in a and isinstance(v, tuple) and hasattr(type(v), "_fields") \
                        and len(type(v)._field_defaults) == len(type(v)._fields):
                    out[k] = copy(v)
            return out
        if isinstance(a, (list, tuple)) and not hasattr(cls, "_fields") and isinstance(b, (list, tuple)) \
                and len(a) == len(b):
            return cls(walk(x, y) for x, y in zip(a, b))
        return a

    return walk(loaded, template)


def tensor_refs(tree: Any) -> list[TensorRef]:
    """The tensor references of a structure read from tree.json, in tree order."""
    return find_nodes(tree, lambda x: isinstance(x, TensorRef))


def fill(tree: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """The structure with each tensor reference replaced by its tensor from ``tensors``."""
    if isinstance(tree, TensorRef):
        return tensors[tree.key]
    cls = type(tree)
    if cls is dict or cls is collections.OrderedDict:
        return cls((k, fill(v, tensors)) for k, v in tree.items())
    if cls is list:
        return [fill(v, tensors) for v in tree]
    if cls is tuple:
        return tuple(fill(v, tensors) for v in tree)
    if isinstance(tree, tuple):  # an allow-listed NamedTuple
        return cls._make(fill(v, tensors) for v in tree)
    return tree


def differences(loaded: Any, template: Any, limit: int = 8) -> tuple[list[tuple[str, str]], dict[str, Any]]:
    """Compare a decoded tree with a template: ``([(path, what differs)], {tensor key: template leaf})``.

    Every differing path is listed (up to ``limit``), in tree order: node types, dict keys, numbers of
    children, and each tensor's dtype and shape. Only the structure is compared, never tensor values.
    """
    targets: dict[str, Any] = {}
    found: list[tuple[str, str]] = []

    def kind(x: Any) -> str:
        if isinstance(x, TensorRef) or torch.is_tensor(x):
            return "tensor"
        if isinstance(x, tuple) and hasattr(type(x), "_fields"):
            return f"{type(x).__qualname__}"
        return type(x).__name__

    def walk(a: Any, b: Any, where: list[str]) -> None:
        if len(found) >= limit:
            return
        if isinstance(a, TensorRef):
            if not torch.is_tensor(b):
                found.append((path_str(where), f"a tensor in the checkpoint, {kind(b)} in the template"))
            elif a.dtype != b.dtype or a.shape != tuple(b.shape):
                found.append((path_str(where), f"tensor {tuple(a.shape)} {a.dtype} in the checkpoint, "
                                               f"{tuple(b.shape)} {b.dtype} in the template"))
            else:
                targets[a.key] = b
            return
        if type(a) is not type(b):
            found.append((path_str(where), f"{kind(a)} in the checkpoint, {kind(b)} in the template"))
            return
        if isinstance(a, dict):
            if set(a) != set(b):
                only_a = sorted(set(a) - set(b), key=repr)
                only_b = sorted(set(b) - set(a), key=repr)
                found.append((path_str(where), f"dict keys differ: only in the checkpoint {only_a}, only in the "
                                               f"template {only_b}"))
            for k in a:
                if k in b:
                    walk(a[k], b[k], where + [str(k)])
        elif isinstance(a, (list, tuple)):
            if len(a) != len(b):
                found.append((path_str(where), f"{len(a)} children in the checkpoint, {len(b)} in the template"))
                return
            names = type(a)._fields if hasattr(type(a), "_fields") else range(len(a))
            for n, x, y in zip(names, a, b):
                walk(x, y, where + [str(n)])

    walk(loaded, template, [])
    return found, targets


class StructureMismatch(CheckpointError):
    """A checkpoint whose state structure (node types, keys, tensor dtypes and shapes) differs from the template.

    A :class:`CheckpointError`, raised before any tensor is read. Unlike damage, it is never
    skipped by a fallback to an older checkpoint.

    Args:
        path: the checkpoint folder, kept as the attribute ``path``.
        differences: ``[(tree path, what differs)]``, kept as ``differences`` (the first one first).

    Example::

        >>> import tempfile, torch, functrain as ft
        >>> path = ft.save(tempfile.mkdtemp() + "/c", {"w": torch.ones(2)})
        >>> try:
        ...     ft.load(path, template={"w": torch.ones(3)})
        ... except ft.checkpoint.StructureMismatch as e:
        ...     print(e.differences)
        [('w', 'tensor (2,) torch.float32 in the checkpoint, (3,) torch.float32 in the template')]
    """

    __module__ = "functrain.checkpoint"  # its public home, in reprs and tracebacks

    def __init__(self, path: str, differences: list[tuple[str, str]]):
        self.path, self.differences = path, differences
        where = "; ".join(f"at {p!r}: {w}" for p, w in differences)
        super().__init__(f"checkpoint {path} does not match the template {where}")


def match(loaded: Any, template: Any, path: str) -> dict[str, Any]:
    """Check the decoded tree against the template; returns ``{tensor key: template leaf}``.

    Raises :class:`StructureMismatch` naming every differing path (the first one first).
    """
    found, targets = differences(loaded, template)
    if found:
        raise StructureMismatch(path, found)
    return targets
