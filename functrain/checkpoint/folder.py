"""The checkpoint folder: atomic save, verified load, and the cleanup of what a killed save left behind.

A folder holds ``tensors.safetensors``, ``tree.json``, ``extra.json`` and, written
last, ``COMPLETE.json`` (the completion mark: each file's size and checksum).
:func:`save` builds it in a hidden temporary folder beside the target and renames
it into place; :func:`load` checks every file against the mark before using it.
"""
from __future__ import annotations

import errno
import hashlib
import os
import re
import secrets
import shutil
from typing import Any

import torch

from ..core.flat import reflat, unflat
from .format import EXTRA, FORMAT, MARKER, TENSORS, TREE, VERSION, CheckpointError, CheckpointSpaceError, check_size, complete, decode, encode, fill, json_bytes, match, tensor_refs
from .bounded import TREE_FACTOR, loads_json
from .lock import hold_dir, try_hold_dir
from .safe_io import LinkRefused, open_fd
from .tensorfile import check_checksum, load_tensors, pwrite_all, tensor_file_size, write_tensors

# Each JSON file of a checkpoint is refused above its size cap before it is read, and parsed under the memory
# bound of functrain.checkpoint.bounded: (cap, memory factor). tree.json's own format costs ~8x its size.
_JSON_LIMITS = {EXTRA: (256 << 20, None), TREE: (64 << 20, TREE_FACTOR)}
_SMALL_JSON = (16 << 20, None)  # the completion marks (COMPLETE.json, SHARDED.json)


# -------------------------------------------------------------------------- small file helpers
def fsync_dir(path: str) -> None:
    """fsync a folder (so a rename or new file in it survives a crash); a no-op where that is impossible."""
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


def write_file(path: str, data: bytes, sync: bool, dir_fd: int | None = None) -> None:
    """Write ``data`` to a new file (never an existing one, never through a link), fsynced when ``sync``.

    With ``dir_fd`` (an open folder) ``path`` is a name in that folder.
    """
    fd = open_fd(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644, dir_fd=dir_fd,
                 what="a checkpoint file")
    try:
        pwrite_all(fd, memoryview(data), 0)
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)


def sha256(data: bytes) -> str:
    """The hex sha256 of ``data``."""
    return hashlib.sha256(data).hexdigest()


# -------------------------------------------------------------------------- the completion mark
def read_json(path: str, expect: dict | None) -> Any:
    """A JSON file of a checkpoint, checked against its completion-mark entry ``expect`` (size, checksum).

    Refused unread above its size cap (256 MiB for ``extra.json``, 64 MiB for ``tree.json``, 16 MiB for a
    completion mark), and parsed under :func:`functrain.checkpoint.bounded.loads_json`'s memory bound.
    """
    cap, factor = _JSON_LIMITS.get(os.path.basename(path), _SMALL_JSON)
    try:
        size = os.stat(path).st_size
        if expect is not None:
            check_size(path, size, expect)
        if size > cap:
            raise CheckpointError(f"{path}: {size} bytes is too large for a checkpoint JSON file (at most {cap})")
        with open(path, "rb") as f:
            data = f.read(cap + 1)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read it ({e})") from None
    if len(data) > cap:
        raise CheckpointError(f"{path}: more than {cap} bytes: too large for a checkpoint JSON file")
    if expect is not None and sha256(data) != expect.get("sha256"):
        raise CheckpointError(f"{path}: its sha256 does not match the completion mark: the file was edited or "
                              f"replaced")
    return loads_json(data, path, factor=factor, error=CheckpointError)


def read_marker(path: str) -> dict:
    """The completion mark (``COMPLETE.json``) of the checkpoint folder ``path``; CheckpointError if absent or bad."""
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no such checkpoint folder")
    mpath = os.path.join(path, MARKER)
    if not os.path.isfile(mpath):
        raise CheckpointError(f"{path}: no completion mark {MARKER}: the checkpoint is incomplete (its save was "
                              f"interrupted) or this is not a functrain checkpoint")
    marker = read_json(mpath, None)
    files = marker.get("files") if isinstance(marker, dict) else None
    if not isinstance(files, dict) or marker.get("format") != FORMAT:
        raise CheckpointError(f"{mpath}: not a functrain checkpoint mark")
    if marker.get("version") != VERSION:
        raise CheckpointError(f"{mpath}: checkpoint format version {marker.get('version')!r}; this functrain reads "
                              f"version {VERSION}")
    if set(files) != {TENSORS, TREE, EXTRA} or not all(isinstance(v, dict) for v in files.values()):
        raise CheckpointError(f"{mpath}: must list exactly {TENSORS}, {TREE} and {EXTRA}; lists {sorted(files)}")
    return files


def check_complete(path: str) -> dict:
    """The completion mark's file list, after checking that every listed file has the size it lists
    (the files' contents are checked only when loaded); a :class:`CheckpointError` says what is wrong."""
    files = read_marker(path)
    for f, meta in files.items():
        fpath = os.path.join(path, f)
        try:
            size = os.stat(fpath).st_size
        except OSError as e:
            raise CheckpointError(f"{fpath}: cannot read it ({e})") from None
        check_size(fpath, size, meta)
    return files


def is_complete(path: str) -> bool:
    """Whether ``path`` is a complete checkpoint (see :func:`check_complete`)."""
    try:
        check_complete(path)
        return True
    except CheckpointError:
        return False


def read_marks(path: str) -> dict:
    """The marks a writer attached to the checkpoint at ``path`` (``{}`` if none), e.g. ``{"finite": True}``."""
    try:
        marker = read_json(os.path.join(path, MARKER), None)
    except CheckpointError:
        return {}
    marks = marker.get("marks") if isinstance(marker, dict) else None
    return marks if isinstance(marks, dict) else {}


# -------------------------------------------------------------------------- save
_LEFTOVER = re.compile(r"\.(?P<name>.+)\.(?P<kind>tmp|old|del)-[0-9a-f]{12}$")


def tidy(parent: str, keep_name: Any) -> None:
    """Clean what a killed save or removal left in ``parent`` for the names ``keep_name(name)`` accepts.

    ``.<name>.tmp-*`` (an unfinished save) and ``.<name>.del-*`` (an unfinished
    removal) are deleted. ``.<name>.old-*`` is a complete checkpoint that a
    replacing save renamed aside: it is renamed back when ``<name>`` is missing
    (the kill came between the two renames), deleted otherwise. A folder that a
    live process is still writing or removing (it holds the folder's in-use mark,
    :func:`~functrain.checkpoint.lock.hold_dir`) is left alone: only what a dead
    process left is tidied.
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
        fd = try_hold_dir(p)
        if fd is None:  # in use by a live writer (or already gone)
            continue
        try:
            if m.group("kind") == "old" and not os.path.lexists(target) and is_complete(p):
                try:
                    os.rename(p, target)
                    continue
                except OSError:
                    pass
            shutil.rmtree(p, ignore_errors=True)
        finally:
            os.close(fd)


def check_replaceable(path: str) -> None:
    """Refuse to replace anything at ``path`` but a functrain checkpoint folder (complete or not)."""
    if not os.path.lexists(path):
        return
    ours = {TENSORS, TREE, EXTRA, MARKER}
    if os.path.islink(path):
        raise LinkRefused(path, "a checkpoint folder")
    if not os.path.isdir(path) or not set(os.listdir(path)) <= ours:
        raise FileExistsError(f"{path} exists and is not a functrain checkpoint folder; not replacing it "
                              f"(a checkpoint folder holds only {', '.join(sorted(ours))})")


def _free_bytes(folder: str) -> int | None:
    """Bytes an unprivileged writer may still use in ``folder``'s file system (``None`` if unknown)."""
    try:
        st = os.statvfs(folder)
    except (OSError, AttributeError):
        return None
    return st.f_bavail * st.f_frsize if st.f_blocks else None


def _size_limit() -> int | None:
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    except (ImportError, OSError, ValueError):
        return None
    return None if soft == resource.RLIM_INFINITY else int(soft)


def _mib(n: int | None) -> str:
    return "unknown" if n is None else f"{n} bytes ({n / 2**20:.1f} MiB)"


def _space_error(e: OSError | None, path: str, needed: int, largest: int) -> CheckpointSpaceError:
    parent = os.path.dirname(path)
    free, limit = _free_bytes(parent), _size_limit()
    if e is not None and e.errno == errno.EFBIG or e is None and limit is not None and largest > limit:
        return CheckpointSpaceError(
            errno.EFBIG, f"cannot save checkpoint {path}: it needs {_mib(needed)} in files of up to "
                         f"{_mib(largest)}, and this process may write files of at most {_mib(limit)} "
                         f"(the file-size limit, RLIMIT_FSIZE / ulimit -f); {_mib(free)} are free in {parent}. "
                         f"Nothing was written and the older checkpoints are intact", path, needed, limit)
    code = e.errno if e is not None else errno.ENOSPC
    return CheckpointSpaceError(
        code, f"cannot save checkpoint {path}: it needs {_mib(needed)} and {parent} has {_mib(free)} free "
              f"({errno.errorcode.get(code, code)}: {'disk quota exceeded' if code == errno.EDQUOT else 'no space left on the device'}). "
              f"Nothing was written and the older checkpoints are intact; free some space (or keep fewer "
              f"checkpoints)", path, needed, free)


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
    anything is written. A checkpoint that does not fit (the free space, checked
    before writing, or the file-size limit; or ENOSPC/EFBIG while writing) raises
    :class:`CheckpointSpaceError` (an ``OSError``) naming the path, the bytes
    needed and the bytes free; the older checkpoints stay intact.

    Example::

        >>> import tempfile, torch, functrain as ft
        >>> path = ft.save(tempfile.mkdtemp() + "/ckpt", {"w": torch.ones(2)}, extra={"epoch": 1})
        >>> ft.load_extra(path)
        {'epoch': 1}
    """
    return write_checkpoint(path, state, extra, checksum=checksum, fsync=fsync)


def write_checkpoint(path: str | os.PathLike, state: Any, extra: Any = None, *, checksum: str = "crc32",
                     fsync: bool = True, marks: dict | None = None) -> str:
    """:func:`save`, with ``marks`` (a small JSON dict, e.g. ``{"finite": True}``) recorded in the completion
    mark, where :func:`read_marks` finds them without reading the other files."""
    check_checksum(checksum)
    path = os.path.abspath(os.fspath(path))
    parent, name = os.path.split(path)
    if not name:
        raise ValueError(f"save needs a folder path with a name; got {path!r}")
    node, tensors = encode(unflat(state))  # a flat state is saved by name, as the plain one
    tree_bytes = json_bytes({"format": FORMAT, "version": VERSION, "tree": node})
    try:
        extra_bytes = json_bytes(extra)
    except (TypeError, ValueError) as e:
        raise TypeError(f"extra must be JSON-serialisable (dicts, lists, str, numbers, bool, None): {e}") from None
    marker: dict = {"format": FORMAT, "version": VERSION}
    if marks:
        try:
            json_bytes(marks)
        except (TypeError, ValueError) as e:
            raise TypeError(f"marks must be a JSON-serialisable dict: {e}") from None
        marker["marks"] = dict(marks)
    tensor_bytes = tensor_file_size(tensors)  # the data and the safetensors header
    needed = tensor_bytes + len(tree_bytes) + len(extra_bytes)
    largest = max(tensor_bytes, len(tree_bytes), len(extra_bytes))

    os.makedirs(parent, exist_ok=True)
    tidy(parent, lambda n: n == name)
    check_replaceable(path)
    free, limit = _free_bytes(parent), _size_limit()
    if (free is not None and needed > free) or (limit is not None and largest > limit):
        raise _space_error(None, path, needed, largest)
    tmp, held = _new_tmp(parent, name)
    old = old_fd = None
    try:
        # every file is created by name in the open temporary folder (held): a folder renamed or replaced by a
        # link under us cannot redirect a write outside
        files = {TENSORS: write_tensors(TENSORS, tensors, checksum, fsync, dir_fd=held)}
        for fname, data in ((TREE, tree_bytes), (EXTRA, extra_bytes)):
            write_file(fname, data, fsync, dir_fd=held)
            files[fname] = {"size": len(data), "sha256": sha256(data)}
        # the completion mark, written last: a folder without it is never loaded
        write_file(MARKER, json_bytes({**marker, "files": files}), fsync, dir_fd=held)
        if fsync:
            fsync_dir(tmp)
        if os.path.lexists(path):
            check_replaceable(path)
            old_fd = hold_dir(path)  # the aside folder is in use until this save ends: never tidied meanwhile
            old = os.path.join(parent, f".{name}.old-{secrets.token_hex(6)}")
            os.rename(path, old)
        os.rename(tmp, path)
        if fsync:
            fsync_dir(parent)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and not os.path.lexists(path):
            os.rename(old, path)  # put the previous checkpoint back
        for fd in (held, old_fd):
            if fd is not None:
                os.close(fd)
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT) \
                and not isinstance(e, CheckpointSpaceError):
            raise _space_error(e, path, needed, largest) from e
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    os.close(held)
    if old_fd is not None:
        os.close(old_fd)
    return path


def _new_tmp(parent: str, name: str) -> tuple[str, int]:
    """A new temporary folder for ``name`` and the fd that marks it in use (so no other save tidies it)."""
    for _ in range(8):
        tmp = os.path.join(parent, f".{name}.tmp-{secrets.token_hex(6)}")
        os.mkdir(tmp)
        fd = hold_dir(tmp)
        try:  # a tidier may have taken it between mkdir and the mark: then it is gone, take another name
            if os.stat(tmp).st_ino == os.fstat(fd).st_ino:
                return tmp, fd
        except FileNotFoundError:
            pass
        os.close(fd)
    raise RuntimeError(f"cannot create a temporary folder in {parent}: another process keeps removing them")


# -------------------------------------------------------------------------- load
def _device(d: Any) -> torch.device | None:
    return None if d is None else torch.device(d)


def _read_structure(path: str, files: dict) -> tuple[Any, list]:
    """The decoded tree.json of ``path`` (checked against the mark) and its tensor references."""
    tree_file = os.path.join(path, TREE)
    doc = read_json(tree_file, files[TREE])
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or set(doc) != {"format", "version", "tree"}:
        raise CheckpointError(f"{tree_file}: not a functrain checkpoint structure")
    tree = decode(doc["tree"], tree_file)
    refs = tensor_refs(tree)
    if len({r.key for r in refs}) != len(refs):
        raise CheckpointError(f"{tree_file}: a tensor key appears twice")
    return tree, refs


def check_structure(path: str | os.PathLike, template: Any) -> None:
    """Refuse the checkpoint at ``path`` unless its saved structure is the template's, before any tensor is read.

    The structure is ``tree.json``: node types, keys, each tensor's dtype and shape.

    Args:
        path: the checkpoint folder (unsharded).
        template: the state it should match (e.g. from ``step.init``); a flat template
            (``ft.flat``) is compared by name.

    Returns:
        ``None`` when the structures match.

    Raises:
        StructureMismatch: naming every differing path (e.g. ``'slots'``: a transform's slot only in
            the checkpoint).
        CheckpointError: ``tree.json`` is missing or damaged.

    Example::

        >>> import tempfile, torch, functrain as ft
        >>> path = ft.save(tempfile.mkdtemp() + "/c", {"w": torch.ones(2)})
        >>> ft.checkpoint.check_structure(path, {"w": torch.zeros(2)})
        >>> ft.checkpoint.check_structure(path, {"w": torch.zeros(3)})
        Traceback (most recent call last):
        ...
        functrain.checkpoint.StructureMismatch: checkpoint ... at 'w': tensor (2,) torch.float32 in the checkpoint, (3,) torch.float32 in the template
    """
    path = os.path.abspath(os.fspath(path))
    tree, _ = _read_structure(path, read_marker(path))
    match(complete(tree, unflat(template)), unflat(template), path)


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
    files = read_marker(path)
    tree, refs = _read_structure(path, files)
    if template is not None:  # what an older checkpoint lacks (hyper-parameters as data): the template's
        tree = complete(tree, unflat(template))
    targets = match(tree, unflat(template), path) if template is not None else {}
    tensors = load_tensors(os.path.join(path, TENSORS), files[TENSORS], refs, bool(mmap))
    dev = _device(device)
    for key, t in tensors.items():
        target = dev if dev is not None else (targets[key].device if key in targets else None)
        if target is not None and t.device != target:
            tensors[key] = t.to(target)
    loaded = fill(tree, tensors)
    return reflat(loaded, template) if template is not None else loaded  # flat where the template is


def load_extra(path: str | os.PathLike) -> Any:
    """The ``extra`` JSON value saved with the checkpoint at ``path`` (checked against the completion mark)."""
    path = os.path.abspath(os.fspath(path))
    files = read_marker(path)
    return read_json(os.path.join(path, EXTRA), files[EXTRA])
