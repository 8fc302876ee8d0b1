"""Checkpoints of a whole training state: safe to load, atomic to write, bit-exact.

A checkpoint is a folder::

    step_00001000/
        tensors.safetensors   every tensor leaf, keyed by its tree path ("params/fc.weight", ...)
        tree.json             the structure: node types, keys and fields; each tensor by key with its
                              dtype and shape; Python scalars, strings and None inline
        extra.json            your JSON metadata (data position, config, ...), or null
        COMPLETE.json         written last: the size and checksum of each file above

* **Safe to load**: nothing in the folder is unpickled. Tensors are read from the
  safetensors file (its header is validated by the ``safetensors`` library), the
  structure is JSON, and node types are rebuilt from an *allow-list* (dict, list,
  tuple, ``OrderedDict``, ``None``, :class:`~functrain.TrainState` and functrain's
  own ``NamedTuple`` states, plus what you :func:`register_checkpoint_type`);
  a type name in the file never causes an import. A file that is missing,
  truncated, edited or replaced (by a pickle, say) is refused with a
  :class:`CheckpointError` naming it.
* **Atomic**: :func:`save` writes into a temporary folder beside the target
  (``.<name>.tmp-<random>``), fsyncs every file and the folder, writes the
  completion mark, renames the folder into place and fsyncs the parent. A folder
  without a valid mark is never loaded, so killing the process at any moment
  leaves the previous checkpoints intact and loadable.
* **Bit-exact**: ``load(save(state))`` equals ``state`` bitwise
  (:func:`functrain.tree.tree_equal`): int64 step counters, RNG states,
  bf16/fp16 tensors, 0-dim and empty tensors, non-contiguous tensors and tensors
  that share storage (each leaf is written on its own; sharing is not restored),
  empty containers, ``None`` and Python scalars (floats exactly, via
  ``float.hex``).

Checksums: the marker holds the sha256 of each JSON file and, for the tensor
file, a checksum of every 16 MiB block of it: ``crc32`` by default (zlib,
~3 GB/s per core), computed on each piece just before it is written and
verified as it is read, with the blocks spread over a few threads; or
``checksum="sha256"`` (~4x slower). Any change to any byte (header or data) is
detected; neither checksum authenticates, since whoever can edit the files can
rewrite the marker too: safety against a hostile file comes from the format (no
pickle, a header validated by safetensors, allow-listed types), not from the
checksum.

Loading maps rather than copies: by default each CPU tensor of 1 MiB or more is
a private copy-on-write mapping of its bytes in the file (as
``safetensors.torch.load_file`` does), so a load costs about one checksum pass
over the page cache; ``load(..., mmap=False)`` copies every tensor into memory
of its own. See :func:`load`.

``safetensors`` (the ``checkpoint`` extra) is needed to load; it is imported
when :func:`load` runs, never when functrain is imported.

Example::

    import functrain as ft

    ft.save("ckpt/final", state, extra={"epoch": 3})
    state = ft.load("ckpt/final", template=state)   # same structure, shapes, dtypes, devices
    ft.load_extra("ckpt/final")                     # {'epoch': 3}

    manager = ft.CheckpointManager("ckpt", keep=3)  # ckpt/step_00001000, ...
    manager.save(int(state.step), state, extra={"batches_seen": n})
    restored = manager.load_latest(template=state)  # None when there is no checkpoint yet
    if restored is not None:
        state, extra = restored.state, restored.extra
"""
from __future__ import annotations

import collections
import functools
import hashlib
import json
import mmap as _mmap
import os
import re
import secrets
import shutil
import struct
import sys
import threading
import warnings
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import torch

__all__ = [
    "save",
    "load",
    "load_extra",
    "CheckpointManager",
    "CheckpointError",
    "Restored",
    "register_checkpoint_type",
]

FORMAT = "functrain-checkpoint"
VERSION = 1
TENSORS, TREE, EXTRA, MARKER = "tensors.safetensors", "tree.json", "extra.json", "COMPLETE.json"
CHUNK_BYTES = 16 << 20  # checksum block of the tensor file
_THREADS = max(1, min(4, os.cpu_count() or 1))  # chunks written/read and checksummed at once
_MAP_MIN = 1 << 20   # tensors of at least this many bytes are loaded as copy-on-write file mappings
_PIECE = 1 << 20        # bytes hashed then written (or read then hashed) at a time: stays in cache
_MAX_JSON = 256 << 20   # refuse absurdly large JSON files before reading them
_CHECKSUMS = ("crc32", "sha256")

# torch dtype <-> safetensors dtype code (the ones both sides support)
_ST_CODES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint64: "U64", torch.uint32: "U32", torch.uint16: "U16", torch.uint8: "U8",
    torch.bool: "BOOL", torch.complex64: "C64",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.float8_e4m3fnuz: "F8_E4M3FNUZ", torch.float8_e5m2fnuz: "F8_E5M2FNUZ",
}
_DTYPES = {str(d).removeprefix("torch."): d for d in _ST_CODES}  # "float32" -> torch.float32 (allow-list)


class CheckpointError(ValueError):
    """A checkpoint that is incomplete, damaged, not a functrain checkpoint, or does not match the template."""


class Restored(NamedTuple):
    """What :meth:`CheckpointManager.load_latest` returns."""

    state: Any
    extra: Any
    step: int
    path: str


# -------------------------------------------------------------------------- allow-listed node types
_TYPES: dict[str, type] = {}      # name in tree.json -> NamedTuple class
_NAMES: dict[type, str] = {}      # class -> name


def register_checkpoint_type(cls: type, name: str | None = None) -> type:
    """Allow a ``NamedTuple`` class as a node of saved states (usable as a class decorator).

    functrain's own state types (``TrainState``, ``AdamState``, ``SGDState``,
    ``EmaState``, ``LossScaleState``, ...) are allowed already. ``name`` (default
    ``"<module>.<qualname>"``) is what ``tree.json`` records; loading looks it up
    among the registered classes and never imports anything named in a file.
    """
    if not (isinstance(cls, type) and issubclass(cls, tuple) and isinstance(getattr(cls, "_fields", None), tuple)):
        raise TypeError(f"register_checkpoint_type takes a NamedTuple class; got {cls!r}")
    name = f"{cls.__module__}.{cls.__qualname__}" if name is None else name
    if not isinstance(name, str) or not name:
        raise TypeError(f"the registered name must be a non-empty str; got {name!r}")
    if _TYPES.get(name, cls) is not cls:
        raise ValueError(f"checkpoint type name {name!r} is already registered for {_TYPES[name]!r}")
    _TYPES[name] = cls
    _NAMES.setdefault(cls, name)
    return cls


def _discover_functrain_types() -> None:
    """Allow functrain's own state types: the core ones under stable names, and every other public
    NamedTuple class defined in a functrain module that is already imported (nothing is imported here)."""
    from .optim import AdamState, SGDState
    from .state import TrainState
    from .transforms import EmaState, LossScaleState

    for cls, name in ((TrainState, "functrain.TrainState"), (AdamState, "functrain.optim.AdamState"),
                      (SGDState, "functrain.optim.SGDState"), (EmaState, "functrain.EmaState"),
                      (LossScaleState, "functrain.LossScaleState")):
        if cls not in _NAMES:
            register_checkpoint_type(cls, name)
    for modname, mod in list(sys.modules.items()):
        if mod is None or not (modname == "functrain" or modname.startswith("functrain.")):
            continue
        for obj in list(vars(mod).values()):
            if (isinstance(obj, type) and issubclass(obj, tuple) and obj is not tuple
                    and isinstance(getattr(obj, "_fields", None), tuple) and obj.__module__ == modname
                    and not obj.__name__.startswith("_") and obj not in _NAMES):
                register_checkpoint_type(obj)


def _type_name(cls: type) -> str | None:
    if cls not in _NAMES:
        _discover_functrain_types()
    return _NAMES.get(cls)


def _type_by_name(name: str) -> type | None:
    if name not in _TYPES:
        _discover_functrain_types()
    return _TYPES.get(name)


# -------------------------------------------------------------------------- checksums
class _Digests:
    """Checksums of consecutive ``chunk``-byte blocks of a byte stream fed in pieces."""

    def __init__(self, algo: str, chunk: int):
        self.algo, self.chunk, self.digests, self.filled = algo, chunk, [], 0
        self._reset()

    def _reset(self) -> None:
        self.state = 0 if self.algo == "crc32" else hashlib.sha256()

    def _digest(self) -> str:
        return f"{self.state:08x}" if self.algo == "crc32" else self.state.hexdigest()

    def update(self, data: Any) -> None:
        data = memoryview(data).cast("B")
        while len(data):
            n = min(len(data), self.chunk - self.filled)
            if self.algo == "crc32":
                self.state = zlib.crc32(data[:n], self.state)
            else:
                self.state.update(data[:n])
            self.filled += n
            data = data[n:]
            if self.filled == self.chunk:
                self.digests.append(self._digest())
                self.filled = 0
                self._reset()

    def finish(self) -> list[str]:
        if self.filled or not self.digests:
            self.digests.append(self._digest())
            self.filled = 0
            self._reset()
        return self.digests


def _digest_file(path: str, algo: str = "crc32", chunk: int = CHUNK_BYTES) -> list[str]:
    """The block checksums of a file as the marker records them (for tools and tests)."""
    d = _Digests(algo, chunk)
    with open(path, "rb") as f:
        while block := f.read(8 << 20):
            d.update(block)
    return d.finish()


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# -------------------------------------------------------------------------- tree <-> JSON
class _Ref:
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


def _encode(tree: Any) -> tuple[dict, list[tuple[str, torch.Tensor]]]:
    """tree.json's node for ``tree`` and the tensor leaves as ``[(key, tensor)]`` in tree order."""
    tensors: list[tuple[str, torch.Tensor]] = []
    used: set[str] = {"__metadata__"}  # reserved by safetensors headers

    def key_for(path: list[str]) -> str:
        key = "/".join(path) or "<root>"
        base, n = key, 0
        while key in used:
            n += 1
            key = f"{base}~{n}"
        used.add(key)
        return key

    def enc(x: Any, path: list[str]) -> dict:
        where = "/".join(path) or "<root>"
        if torch.is_tensor(x):
            if x.layout != torch.strided or x.is_quantized or x.is_nested or x.device.type == "meta":
                raise TypeError(f"cannot checkpoint the tensor at {where!r}: only dense (strided) tensors with "
                                f"data; this one is {x.layout}{' quantized' if x.is_quantized else ''} on {x.device}")
            if x.dtype not in _ST_CODES:
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
            name = _type_name(cls)
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


def _decode(node: Any, file: str) -> Any:
    """Rebuild the tree from tree.json's node, with a :class:`_Ref` for each tensor."""

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
            return _Ref(key, _DTYPES[dtype], tuple(shape))
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
            cls = _type_by_name(name) if isinstance(name, str) else None
            if cls is None:
                raise CheckpointError(f"{file}: node type {name!r} is not an allowed checkpoint type; if it is "
                                      f"yours, call ft.register_checkpoint_type(<the class>, name={name!r}) first")
            if names != list(cls._fields):
                raise bad(f"{name} has fields {names}, the registered class has {list(cls._fields)}")
            out = children(kids)
            if len(out) != len(names):
                raise bad(f"{name} needs {len(names)} children")
            return cls._make(out)
        if t in ("none", "bool", "int", "float", "str"):
            return scalar(n)
        raise bad(f"unknown node type {t!r}")

    try:
        return dec(node)
    except RecursionError:
        raise bad("nested too deeply") from None


def _walk_refs(tree: Any) -> list[_Ref]:
    out: list[_Ref] = []

    def walk(x: Any) -> None:
        if isinstance(x, _Ref):
            out.append(x)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    walk(tree)
    return out


def _fill(tree: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(tree, _Ref):
        return tensors[tree.key]
    cls = type(tree)
    if cls is dict or cls is collections.OrderedDict:
        return cls((k, _fill(v, tensors)) for k, v in tree.items())
    if cls is list:
        return [_fill(v, tensors) for v in tree]
    if cls is tuple:
        return tuple(_fill(v, tensors) for v in tree)
    if isinstance(tree, tuple):  # an allow-listed NamedTuple
        return cls._make(_fill(v, tensors) for v in tree)
    return tree


def _match(loaded: Any, template: Any, path: str, file: str) -> dict[str, Any]:
    """Check the decoded tree against the template; returns ``{tensor key: template leaf}``."""
    targets: dict[str, Any] = {}

    def fail(where: list[str], what: str) -> CheckpointError:
        p = "/".join(where) or "<root>"
        return CheckpointError(f"checkpoint {path} does not match the template at {p!r}: {what}")

    def kind(x: Any) -> str:
        if isinstance(x, _Ref) or torch.is_tensor(x):
            return "tensor"
        if isinstance(x, tuple) and hasattr(type(x), "_fields"):
            return f"{type(x).__qualname__}"
        return type(x).__name__

    def walk(a: Any, b: Any, where: list[str]) -> None:
        if isinstance(a, _Ref):
            if not torch.is_tensor(b):
                raise fail(where, f"a tensor in the checkpoint, {kind(b)} in the template")
            if a.dtype != b.dtype or a.shape != tuple(b.shape):
                raise fail(where, f"tensor {tuple(a.shape)} {a.dtype} in the checkpoint, "
                                  f"{tuple(b.shape)} {b.dtype} in the template")
            targets[a.key] = b
            return
        if type(a) is not type(b):
            raise fail(where, f"{kind(a)} in the checkpoint, {kind(b)} in the template")
        if isinstance(a, dict):
            if set(a) != set(b):
                only_a = sorted(set(a) - set(b), key=repr)
                only_b = sorted(set(b) - set(a), key=repr)
                raise fail(where, f"dict keys differ: only in the checkpoint {only_a}, only in the template {only_b}")
            for k in a:
                walk(a[k], b[k], where + [str(k)])
        elif isinstance(a, (list, tuple)):
            if len(a) != len(b):
                raise fail(where, f"{len(a)} children in the checkpoint, {len(b)} in the template")
            names = type(a)._fields if hasattr(type(a), "_fields") else range(len(a))
            for n, x, y in zip(names, a, b):
                walk(x, y, where + [str(n)])

    walk(loaded, template, [])
    return targets


# -------------------------------------------------------------------------- small file helpers
def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # platforms where a directory cannot be fsynced
        pass
    finally:
        os.close(fd)


def _write_all(fd: int, data: Any) -> None:
    data = memoryview(data).cast("B")
    while len(data):
        n = os.write(fd, data)
        data = data[n:]


def _write_file(path: str, data: bytes, sync: bool) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        _write_all(fd, data)
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)


def _json_bytes(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def _host_bytes(t: torch.Tensor) -> tuple[torch.Tensor, memoryview]:
    """The tensor's bytes in C order as a memoryview (a copy only for non-CPU or non-contiguous tensors)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.resolve_conj().resolve_neg().contiguous()
    flat = t.reshape(-1)
    if flat.numel() <= 1:  # "contiguous" whatever its stride: give it the unit stride a dtype view needs
        flat = flat.as_strided((flat.numel(),), (1,))
    return t, memoryview(flat.view(torch.uint8).numpy()).cast("B")


# -------------------------------------------------------------------------- the tensor file, in checksum chunks
def _plan(segments: list[tuple[int, int]], chunk: int) -> list[list[tuple[int, int, int, int]]]:
    """Split the file's segments ``[(file_offset, length)]`` (in file order) at checksum-chunk boundaries.

    Returns, per chunk, ``[(segment index, start, stop, file_offset)]`` with
    ``start:stop`` a byte range within the segment.
    """
    total = segments[-1][0] + segments[-1][1] if segments else 0
    plans: list[list[tuple[int, int, int, int]]] = [[] for _ in range(max(1, -(-total // chunk)))]
    for i, (start, length) in enumerate(segments):
        pos, end = start, start + length
        while pos < end:
            stop = min(end, (pos // chunk + 1) * chunk)
            plans[pos // chunk].append((i, pos - start, stop - start, pos))
            pos = stop
    return plans


def _hasher(algo: str) -> Any:
    return _Digests(algo, 1 << 62)


def _run(tasks: list) -> list:
    """Run the chunk tasks, on a few threads when there are several (file I/O, zlib and hashlib release the GIL)."""
    workers = min(_THREADS, len(tasks))
    if workers <= 1:
        return [task() for task in tasks]
    with ThreadPoolExecutor(workers, thread_name_prefix="functrain-checkpoint") as pool:
        return list(pool.map(lambda task: task(), tasks))


class _HostBytes:
    """Each tensor's host bytes, made once (a host copy only for GPU or non-contiguous tensors) and dropped
    as soon as the last chunk that needs it is written, so at most a few copies are alive at a time."""

    def __init__(self, tensors: list[torch.Tensor], uses: list[int]):
        self.tensors, self.uses, self.live, self.lock = tensors, uses, {}, threading.Lock()

    def get(self, i: int) -> memoryview:
        with self.lock:
            if i not in self.live:
                self.live[i] = _host_bytes(self.tensors[i])
            return self.live[i][1]

    def done(self, i: int) -> None:
        with self.lock:
            self.uses[i] -= 1
            if self.uses[i] == 0:
                self.live.pop(i, None)


def _write_tensors(path: str, tensors: list[tuple[str, torch.Tensor]], algo: str, sync: bool) -> dict:
    """Write a safetensors file; each piece is checksummed just before it is written (while it is in cache)."""
    # Largest element size first and the header padded to 8 bytes: every tensor's data is aligned.
    order = sorted(range(len(tensors)), key=lambda i: (-tensors[i][1].element_size(), tensors[i][0]))
    header: dict[str, Any] = {"__metadata__": {"format": "pt", "producer": FORMAT}}
    offset = 0
    for i in order:
        key, t = tensors[i]
        n = t.numel() * t.element_size()
        header[key] = {"dtype": _ST_CODES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    hb = _json_bytes(header)
    hb += b" " * (-len(hb) % 8)
    prefix = struct.pack("<Q", len(hb)) + hb
    # segment 0 is the prefix (length + header), segment k >= 1 the tensor order[k - 1]
    segments, pos = [(0, len(prefix))], len(prefix)
    for i in order:
        n = tensors[i][1].numel() * tensors[i][1].element_size()
        segments.append((pos, n))
        pos += n
    plans = _plan(segments, CHUNK_BYTES)
    uses = [0] * len(segments)
    for plan in plans:
        for seg, *_ in plan:
            uses[seg] += 1
    sources = _HostBytes([torch.empty(0)] + [tensors[i][1] for i in order], uses)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)

    def write_chunk(plan: list) -> str:
        h = _hasher(algo)
        for seg, start, stop, at in plan:
            mv = memoryview(prefix) if seg == 0 else sources.get(seg)
            for s in range(start, stop, _PIECE):
                piece = mv[s:min(stop, s + _PIECE)]
                h.update(piece)
                _pwrite_all(fd, piece, at + s - start)
            del mv
            if seg:
                sources.done(seg)
        return h.finish()[0]

    try:
        chunks = _run([functools.partial(write_chunk, plan) for plan in plans])
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)
    return {"size": pos, "checksum": algo, "chunk_bytes": CHUNK_BYTES, "chunks": chunks}


def _pwrite_all(fd: int, data: memoryview, at: int) -> None:
    while len(data):
        n = os.pwrite(fd, data, at)
        data, at = data[n:], at + n


_LEFTOVER = re.compile(r"\.(?P<name>.+)\.(?P<kind>tmp|old|del)-[0-9a-f]{12}$")


def _tidy(parent: str, keep_name: Any) -> None:
    """Clean what a killed save or removal left in ``parent`` for the names ``keep_name(name)`` accepts.

    ``.<name>.tmp-*`` (an unfinished save) and ``.<name>.del-*`` (an unfinished
    removal) are deleted. ``.<name>.old-*`` is a complete checkpoint that a
    replacing save renamed aside: it is renamed back when ``<name>`` is missing
    (the kill came between the two renames), deleted otherwise.
    """
    try:
        entries = sorted(os.listdir(parent))
    except FileNotFoundError:
        return
    for entry in entries:
        m = _LEFTOVER.match(entry)
        if not m or not keep_name(m.group("name")):
            continue
        p, target = os.path.join(parent, entry), os.path.join(parent, m.group("name"))
        if m.group("kind") == "old" and not os.path.lexists(target):
            try:
                if _sizes_ok(p, _read_marker(p)):
                    os.rename(p, target)
                    continue
            except (CheckpointError, OSError):
                pass
        shutil.rmtree(p, ignore_errors=True)


def save(path: str | os.PathLike, state: Any, extra: Any = None, *, checksum: str = "crc32",
         fsync: bool = True) -> str:
    """Save ``state`` (any pytree of tensors, e.g. a :class:`~functrain.TrainState`) as a checkpoint folder.

    ``extra`` is any JSON-serialisable value saved beside it (read it back with
    :func:`load_extra`). The folder appears at ``path`` complete or not at all; an
    existing checkpoint at ``path`` is replaced (old one renamed aside, new one
    renamed in, old one removed); anything else at ``path`` raises
    ``FileExistsError``. ``checksum`` is ``"crc32"`` (fast) or ``"sha256"``;
    ``fsync=False`` skips the fsyncs (faster, still atomic against a killed
    process, but not against a power loss). Returns the path.

    Everything that could make the state unsavable (an unsupported leaf or node
    type, an unregistered NamedTuple, ``extra`` that is not JSON) raises before
    anything is written.
    """
    if checksum not in _CHECKSUMS:
        raise ValueError(f"checksum must be one of {_CHECKSUMS}; got {checksum!r}")
    path = os.path.abspath(os.fspath(path))
    parent, name = os.path.split(path)
    if not name:
        raise ValueError(f"save needs a folder path with a name; got {path!r}")
    node, tensors = _encode(state)
    tree_bytes = _json_bytes({"format": FORMAT, "version": VERSION, "tree": node})
    try:
        extra_bytes = _json_bytes(extra)
    except (TypeError, ValueError) as e:
        raise TypeError(f"extra must be JSON-serialisable (dicts, lists, str, numbers, bool, None): {e}") from None

    os.makedirs(parent, exist_ok=True)
    _tidy(parent, lambda n: n == name)
    _check_replaceable(path)
    tmp = os.path.join(parent, f".{name}.tmp-{secrets.token_hex(6)}")
    old = None
    os.mkdir(tmp)
    try:
        files = {TENSORS: _write_tensors(os.path.join(tmp, TENSORS), tensors, checksum, fsync)}
        for fname, data in ((TREE, tree_bytes), (EXTRA, extra_bytes)):
            _write_file(os.path.join(tmp, fname), data, fsync)
            files[fname] = {"size": len(data), "sha256": _sha256(data)}
        # the completion mark, written last: a folder without it is never loaded
        _write_file(os.path.join(tmp, MARKER), _json_bytes({"format": FORMAT, "version": VERSION, "files": files}),
                    fsync)
        if fsync:
            _fsync_dir(tmp)
        if os.path.lexists(path):
            _check_replaceable(path)
            old = os.path.join(parent, f".{name}.old-{secrets.token_hex(6)}")
            os.rename(path, old)
        os.rename(tmp, path)
        if fsync:
            _fsync_dir(parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and not os.path.lexists(path):
            os.rename(old, path)  # put the previous checkpoint back
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return path


def _check_replaceable(path: str) -> None:
    """Refuse to replace anything at ``path`` but a functrain checkpoint folder (complete or not)."""
    if not os.path.lexists(path):
        return
    ours = {TENSORS, TREE, EXTRA, MARKER}
    if os.path.islink(path) or not os.path.isdir(path) or not set(os.listdir(path)) <= ours:
        raise FileExistsError(f"{path} exists and is not a functrain checkpoint folder; not replacing it "
                              f"(a checkpoint folder holds only {', '.join(sorted(ours))})")


# -------------------------------------------------------------------------- load
def _read_json(path: str, expect: dict | None) -> Any:
    try:
        size = os.stat(path).st_size
        if expect is not None and size != expect.get("size"):
            raise CheckpointError(f"{path}: size {size} bytes, the completion mark says {expect.get('size')}: "
                                  f"the file was truncated or changed")
        if size > _MAX_JSON:
            raise CheckpointError(f"{path}: {size} bytes is too large for a checkpoint JSON file")
        with open(path, "rb") as f:
            data = f.read(_MAX_JSON + 1)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read it ({e})") from None
    if expect is not None and _sha256(data) != expect.get("sha256"):
        raise CheckpointError(f"{path}: its sha256 does not match the completion mark: the file was edited or "
                              f"replaced")
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({type(e).__name__}: {e})") from None


def _read_marker(path: str) -> dict:
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no such checkpoint folder")
    mpath = os.path.join(path, MARKER)
    if not os.path.isfile(mpath):
        raise CheckpointError(f"{path}: no completion mark {MARKER}: the checkpoint is incomplete (its save was "
                              f"interrupted) or this is not a functrain checkpoint")
    marker = _read_json(mpath, None)
    files = marker.get("files") if isinstance(marker, dict) else None
    if not isinstance(files, dict) or marker.get("format") != FORMAT:
        raise CheckpointError(f"{mpath}: not a functrain checkpoint mark")
    if marker.get("version") != VERSION:
        raise CheckpointError(f"{mpath}: checkpoint format version {marker.get('version')!r}; this functrain reads "
                              f"version {VERSION}")
    if set(files) != {TENSORS, TREE, EXTRA} or not all(isinstance(v, dict) for v in files.values()):
        raise CheckpointError(f"{mpath}: must list exactly {TENSORS}, {TREE} and {EXTRA}; lists {sorted(files)}")
    return files


def _sizes_ok(path: str, files: dict) -> bool:
    try:
        return all(os.stat(os.path.join(path, f)).st_size == meta.get("size") for f, meta in files.items())
    except OSError:
        return False


def _read_into(fd: int, mv: memoryview, pos: int, file: str) -> None:
    while len(mv):
        n = os.preadv(fd, [mv], pos)
        if n <= 0:
            raise CheckpointError(f"{file}: ended early (truncated)")
        mv, pos = mv[n:], pos + n


def _load_tensors(file: str, meta: dict, refs: list[_Ref], map_file: bool) -> dict[str, torch.Tensor]:
    try:
        from safetensors import SafetensorError, safe_open
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("loading a checkpoint needs safetensors: pip install 'functrain[checkpoint]'") from e

    size = os.stat(file).st_size
    if size != meta.get("size"):
        raise CheckpointError(f"{file}: size {size} bytes, the completion mark says {meta.get('size')}: the file "
                              f"was truncated or changed")
    algo, chunk, expected = meta.get("checksum"), meta.get("chunk_bytes"), meta.get("chunks")
    if (algo not in _CHECKSUMS or type(chunk) is not int or chunk < (1 << 16) or not isinstance(expected, list)
            or len(expected) != max(1, -(-size // chunk))):
        raise CheckpointError(f"{file}: the completion mark's checksum entry is invalid")
    # The safetensors library validates the header (JSON, dtypes, shapes, offsets, file length).
    try:
        with safe_open(file, framework="pt") as f:
            st_keys = set(f.keys())
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{file}: refused by safetensors: {e}") from None

    wanted = {r.key: r for r in refs}
    if st_keys != set(wanted):
        missing, unknown = sorted(set(wanted) - st_keys)[:5], sorted(st_keys - set(wanted))[:5]
        raise CheckpointError(f"{file}: its tensors do not match {TREE} (missing {missing}, unexpected {unknown})")
    fd = os.open(file, os.O_RDONLY)
    try:
        head = bytearray(8)
        _read_into(fd, memoryview(head), 0, file)
        (n,) = struct.unpack("<Q", head)
        hb = bytearray(n)
        _read_into(fd, memoryview(hb), 8, file)
        prefix = bytes(head + hb)
        try:  # already validated by safetensors; any surprise is still refused, never trusted
            header = json.loads(hb.decode("utf-8"))
            header.pop("__metadata__", None)
            entries = sorted(header.items(), key=lambda kv: int(kv[1]["data_offsets"][0]))
            for _, h in entries:
                if set(h) != {"dtype", "shape", "data_offsets"}:
                    raise ValueError(f"unexpected header entry {h}")
        except (ValueError, KeyError, TypeError, AttributeError, IndexError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{file}: invalid safetensors header ({e})") from None
        out: dict[str, torch.Tensor] = {}
        views: list[memoryview] = [memoryview(prefix)]
        mapped: set[int] = {0}  # segments already in memory (the prefix was read above)
        segments, pos = [(0, len(prefix))], len(prefix)
        for key, h in entries:
            ref = wanted[key]
            start, end = h["data_offsets"]
            if h["dtype"] != _ST_CODES[ref.dtype] or tuple(h["shape"]) != ref.shape or len(prefix) + start != pos:
                raise CheckpointError(f"{file}: tensor {key!r} is {h['dtype']} {tuple(h['shape'])} in the file, "
                                      f"{ref.dtype} {ref.shape} in {TREE}")
            numel = 1
            for d in ref.shape:
                numel *= d
            nbytes = numel * ref.dtype.itemsize
            if nbytes != end - start:
                raise CheckpointError(f"{file}: tensor {key!r} has {end - start} bytes, expected {nbytes}")
            if map_file and nbytes >= _MAP_MIN:
                # a private (copy-on-write) mapping of the tensor's pages: no copy, and writes never reach the file
                base = pos - pos % _mmap.ALLOCATIONGRANULARITY
                mm = _mmap.mmap(fd, pos + nbytes - base, access=_mmap.ACCESS_COPY, offset=base)
                t = torch.frombuffer(mm, dtype=ref.dtype, count=numel, offset=pos - base).view(ref.shape)
                mv = memoryview(mm)[pos - base:pos - base + nbytes]
                mapped.add(len(views))
            else:
                t = torch.empty(ref.shape, dtype=ref.dtype)
                _, mv = _host_bytes(t)  # a view of t's own memory, filled below
            out[key] = t
            views.append(mv)
            segments.append((pos, nbytes))
            pos += nbytes
        if pos != size:
            raise CheckpointError(f"{file}: {size} bytes, its header describes {pos}")
        plans = _plan(segments, chunk)

        def read_chunk(plan: list) -> str:
            h = _hasher(algo)
            for seg, start, stop, at in plan:
                mv = views[seg]
                for s in range(start, stop, _PIECE):
                    piece = mv[s:min(stop, s + _PIECE)]
                    if seg not in mapped:
                        _read_into(fd, piece, at + s - start, file)
                    h.update(piece)
            return h.finish()[0]

        got = _run([functools.partial(read_chunk, plan) for plan in plans])
        del views
    finally:
        os.close(fd)
    if got != expected:
        bad = next(i for i, (a, b) in enumerate(zip(got, expected)) if a != b)
        raise CheckpointError(f"{file}: {algo} checksum mismatch in bytes [{bad * chunk}, {(bad + 1) * chunk}): "
                              f"the file was edited or damaged")
    return out


def _device(d: Any) -> torch.device | None:
    return None if d is None else torch.device(d)


def load(path: str | os.PathLike, template: Any = None, *, device: Any = None, mmap: bool = True) -> Any:
    """Load the state saved at ``path``.

    Without ``template`` the tensors are placed on ``device`` (default CPU). With
    ``template`` (e.g. a state from ``step.init``) the checkpoint must have its
    structure, shapes and dtypes (a :class:`CheckpointError` names the first
    difference) and each tensor goes to the device of the template's leaf, or to
    ``device`` when that is given. Every file is checked against the completion
    mark before its contents are used; a damaged or incomplete checkpoint raises
    :class:`CheckpointError` naming the file. Nothing is unpickled.

    With ``mmap=True`` (the default, as ``safetensors.torch.load_file``) each CPU
    tensor of 1 MiB or more is a private copy-on-write mapping of its bytes in
    the file: no copy is made, writing to the tensor never changes the file, and
    the file's pages are shared with the page cache until written. Such a tensor
    is backed by the file while it lives (a rotated-out checkpoint's disk space
    is freed when the state is dropped, usually after the next step); checkpoints
    are never modified in place, but if something else rewrites the file in place
    the mapped pages may change. ``mmap=False`` copies every tensor into memory of
    its own. Tensors bound for another device (``device``/``template``) are
    copied there from the mapping.
    """
    path = os.path.abspath(os.fspath(path))
    files = _read_marker(path)
    doc = _read_json(os.path.join(path, TREE), files[TREE])
    tree_file = os.path.join(path, TREE)
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or set(doc) != {"format", "version", "tree"}:
        raise CheckpointError(f"{tree_file}: not a functrain checkpoint structure")
    tree = _decode(doc["tree"], tree_file)
    refs = _walk_refs(tree)
    if len({r.key for r in refs}) != len(refs):
        raise CheckpointError(f"{tree_file}: a tensor key appears twice")
    targets = _match(tree, template, path, tree_file) if template is not None else {}
    tensors = _load_tensors(os.path.join(path, TENSORS), files[TENSORS], refs, bool(mmap))
    dev = _device(device)
    for key, t in tensors.items():
        target = dev if dev is not None else (targets[key].device if key in targets else None)
        if target is not None and t.device != target:
            tensors[key] = t.to(target)
    return _fill(tree, tensors)


def load_extra(path: str | os.PathLike) -> Any:
    """The ``extra`` JSON value saved with the checkpoint at ``path`` (checked against the completion mark)."""
    path = os.path.abspath(os.fspath(path))
    files = _read_marker(path)
    return _read_json(os.path.join(path, EXTRA), files[EXTRA])


# -------------------------------------------------------------------------- rotation
class CheckpointManager:
    """Numbered checkpoints in one folder, keeping the newest ``keep``.

    ``save(step, state, extra)`` writes ``folder/step_{step:08d}`` with :func:`save`
    and, only after it is complete, removes the oldest complete checkpoints beyond
    ``keep`` (by step number: the one just saved and the ``keep - 1`` newest others
    stay). Temporary and half-removed folders (``.step_*.tmp-*``, ``.step_*.del-*``)
    left by a killed process are ignored, and cleaned up by the next save; a
    checkpoint that a replacing save had renamed aside (``.step_*.old-*``) is still
    found by :meth:`latest`, and renamed back. Removal renames a folder to a hidden
    name before deleting it, so a kill mid-removal never leaves a half-deleted
    folder under a checkpoint name. Only folders with a valid completion mark
    whose files have the sizes it lists count as checkpoints.

    One process should save into a folder at a time (rank 0 under data parallelism).
    """

    _NAME = re.compile(r"step_(\d+)$")
    _ASIDE = re.compile(r"\.step_(\d+)\.old-[0-9a-f]{12}$")

    def __init__(self, folder: str | os.PathLike, keep: int | None = 3, *, checksum: str = "crc32",
                 fsync: bool = True):
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
            raise ValueError(f"keep must be an int >= 1 or None (keep all); got {keep!r}")
        if checksum not in _CHECKSUMS:
            raise ValueError(f"checksum must be one of {_CHECKSUMS}; got {checksum!r}")
        self.folder = os.path.abspath(os.fspath(folder))
        self.keep, self.checksum, self.fsync = keep, checksum, fsync

    def __repr__(self) -> str:
        return f"CheckpointManager({self.folder!r}, keep={self.keep})"

    def path(self, step: int) -> str:
        """The folder of the checkpoint for ``step``."""
        return os.path.join(self.folder, f"step_{int(step):08d}")

    def _complete(self) -> dict[int, str]:
        """``{step: path}`` of the complete checkpoints (a valid mark and every listed file at its size)."""
        try:
            entries = os.listdir(self.folder)
        except FileNotFoundError:
            return {}
        found: dict[int, str] = {}
        asides: dict[int, str] = {}
        for entry in entries:
            m, a = self._NAME.match(entry), self._ASIDE.match(entry)
            if not (m or a):
                continue
            p = os.path.join(self.folder, entry)
            try:
                ok = _sizes_ok(p, _read_marker(p))
            except CheckpointError:
                ok = False
            if ok:
                (found if m else asides)[int((m or a).group(1))] = p
        # a replaced step's old folder, if the kill came between the two renames of a replacement
        for step, p in asides.items():
            found.setdefault(step, p)
        return found

    def steps(self) -> list[int]:
        """The steps of the complete checkpoints, oldest first."""
        return sorted(self._complete())

    def latest(self) -> str | None:
        """The path of the newest complete checkpoint, or ``None``."""
        found = self._complete()
        return found[max(found)] if found else None

    def save(self, step: int, state: Any, extra: Any = None) -> str:
        """Save ``state`` as the checkpoint of ``step``, then prune to the newest ``keep``. Returns its path."""
        if isinstance(step, torch.Tensor):
            step = int(step)
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an int >= 0; got {step!r}")
        os.makedirs(self.folder, exist_ok=True)
        _tidy(self.folder, lambda n: self._NAME.match(n) is not None)  # leftovers of killed saves and removals
        path = save(self.path(step), state, extra, checksum=self.checksum, fsync=self.fsync)
        if self.keep is not None:
            found = self._complete()
            others = sorted(s for s in found if s != step)  # the one just saved always stays
            for old in others[:max(0, len(others) - (self.keep - 1))]:
                self._remove(found[old])
        return path

    def _remove(self, path: str) -> None:
        m = self._NAME.match(os.path.basename(path)) or self._ASIDE.match(os.path.basename(path))
        doomed = os.path.join(self.folder, f".step_{m.group(1)}.del-{secrets.token_hex(6)}")
        try:
            os.rename(path, doomed)
        except OSError:
            return
        shutil.rmtree(doomed, ignore_errors=True)

    def load_latest(self, template: Any = None, *, device: Any = None, mmap: bool = True,
                    fallback: bool = True) -> Restored | None:
        """Load the newest complete checkpoint as a :class:`Restored` ``(state, extra, step, path)``.

        ``template``, ``device`` and ``mmap`` are :func:`load`'s. Returns ``None``
        when there is no checkpoint. If the newest fails to load (damaged on disk)
        and ``fallback`` is true, a warning names it and the next older one is
        tried; the error of the newest is raised if none loads.
        """
        found = self._complete()
        first: CheckpointError | None = None
        for step in sorted(found, reverse=True):
            p = found[step]
            try:
                return Restored(load(p, template, device=device, mmap=mmap), load_extra(p), step, p)
            except CheckpointError as e:
                if not fallback:
                    raise
                first = first or e
                warnings.warn(f"skipping checkpoint {p}: {e}", RuntimeWarning, stacklevel=2)
        if first is not None:
            raise first
        return None
