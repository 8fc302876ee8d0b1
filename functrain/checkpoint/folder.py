"""The checkpoint folder: atomic save, verified load, and the cleanup of what a killed save left behind.

A folder holds ``tensors.safetensors``, ``tree.json``, ``extra.json`` and, written
last, ``COMPLETE.json`` (the completion mark: each file's size and checksum).
:func:`save` builds it in a hidden temporary folder beside the target and renames
it into place; :func:`load` checks every file against the mark before using it.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil
from typing import Any

import torch

from .format import (EXTRA, FORMAT, MARKER, TENSORS, TREE, VERSION, CheckpointError, _check_size, _decode, _encode,
                     _fill, _json_bytes, _match, _walk_refs)
from .tensorfile import _check_checksum, _load_tensors, _pwrite_all, _write_tensors

_MAX_JSON = 256 << 20   # refuse absurdly large JSON files before reading them


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


def _write_file(path: str, data: bytes, sync: bool) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        _pwrite_all(fd, memoryview(data), 0)
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# -------------------------------------------------------------------------- the completion mark
def _read_json(path: str, expect: dict | None) -> Any:
    try:
        size = os.stat(path).st_size
        if expect is not None:
            _check_size(path, size, expect)
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


def _is_complete(path: str) -> bool:
    """Whether ``path`` is a complete checkpoint: a valid completion mark and every listed file at its size
    (the files' contents are checked only when loaded)."""
    try:
        return _sizes_ok(path, _read_marker(path))
    except CheckpointError:
        return False


# -------------------------------------------------------------------------- save
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
        if m.group("kind") == "old" and not os.path.lexists(target) and _is_complete(p):
            try:
                os.rename(p, target)
                continue
            except OSError:
                pass
        shutil.rmtree(p, ignore_errors=True)


def _check_replaceable(path: str) -> None:
    """Refuse to replace anything at ``path`` but a functrain checkpoint folder (complete or not)."""
    if not os.path.lexists(path):
        return
    ours = {TENSORS, TREE, EXTRA, MARKER}
    if os.path.islink(path) or not os.path.isdir(path) or not set(os.listdir(path)) <= ours:
        raise FileExistsError(f"{path} exists and is not a functrain checkpoint folder; not replacing it "
                              f"(a checkpoint folder holds only {', '.join(sorted(ours))})")


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
    _check_checksum(checksum)
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


# -------------------------------------------------------------------------- load
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
    tree_file = os.path.join(path, TREE)
    doc = _read_json(tree_file, files[TREE])
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
