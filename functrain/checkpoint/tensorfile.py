"""The tensor file: every tensor leaf in one safetensors file, written and read in checksummed chunks.

The file is split into ``CHUNK_BYTES`` blocks, each with its own checksum (crc32
or sha256) in the completion mark. Writing checksums each piece just before it
is written; reading verifies each piece as it is read (or mapped), with the
chunks spread over a few threads. ``safetensors`` is imported only to read.
"""
from __future__ import annotations

import functools
import hashlib
import mmap as _mmap
import os
import struct
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from .format import FORMAT, TREE, ST_CODES, CheckpointError, check_size, json_bytes, TensorRef
from .bounded import TREE_FACTOR, loads_json
from .safe_io import open_fd

CHUNK_BYTES = 16 << 20  # checksum block of the tensor file
_THREADS = max(1, min(4, os.cpu_count() or 1))  # chunks written/read and checksummed at once
_MAP_MIN = 1 << 20   # tensors of at least this many bytes are loaded as copy-on-write file mappings
_PIECE = 1 << 20        # bytes hashed then written (or read then hashed) at a time: stays in cache
_CHECKSUMS = ("crc32", "sha256")


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


def digest_file(path: str, algo: str = "crc32", chunk: int = CHUNK_BYTES) -> list[str]:
    """The block checksums of a file as the marker records them. Used by the tests only, kept here: it reads a
    written file with the writer's own chunking (:class:`_Digests`), what a tool checking a checkpoint on disk
    needs too."""
    d = _Digests(algo, chunk)
    with open(path, "rb") as f:
        while block := f.read(8 << 20):
            d.update(block)
    return d.finish()


def _hasher(algo: str) -> Any:
    return _Digests(algo, 1 << 62)


def check_checksum(checksum: str) -> None:
    """Refuse an unknown checksum algorithm name."""
    if checksum not in _CHECKSUMS:
        raise ValueError(f"checksum must be one of {_CHECKSUMS}; got {checksum!r}")


# -------------------------------------------------------------------------- chunked, threaded I/O
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


def _run(tasks: list) -> list:
    """Run the chunk tasks, on a few threads when there are several (file I/O, zlib and hashlib release the GIL)."""
    workers = min(_THREADS, len(tasks))
    if workers <= 1:
        return [task() for task in tasks]
    with ThreadPoolExecutor(workers, thread_name_prefix="functrain-checkpoint") as pool:
        return list(pool.map(lambda task: task(), tasks))


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


def pwrite_all(fd: int, data: memoryview, at: int) -> None:
    """Write all of ``data`` at offset ``at`` (``os.pwrite`` may write less than asked)."""
    while len(data):
        n = os.pwrite(fd, data, at)
        data, at = data[n:], at + n


def _read_into(fd: int, mv: memoryview, pos: int, file: str) -> None:
    while len(mv):
        n = os.preadv(fd, [mv], pos)
        if n <= 0:
            raise CheckpointError(f"{file}: ended early (truncated)")
        mv, pos = mv[n:], pos + n


# -------------------------------------------------------------------------- write
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


def _layout(tensors: list[tuple[str, torch.Tensor]], metadata: dict | None = None) -> tuple[list[int], list[int], bytes]:
    """The order of the tensors in the file, their sizes in bytes, and the file's prefix (length + header)."""
    # Largest element size first and the header padded to 8 bytes: every tensor's data is aligned.
    order = sorted(range(len(tensors)), key=lambda i: (-tensors[i][1].element_size(), tensors[i][0]))
    header: dict[str, Any] = {"__metadata__": {"format": "pt", "producer": FORMAT} if metadata is None else metadata}
    sizes = [tensors[i][1].numel() * tensors[i][1].element_size() for i in order]
    offset = 0
    for i, n in zip(order, sizes):
        key, t = tensors[i]
        header[key] = {"dtype": ST_CODES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    hb = json_bytes(header)
    hb += b" " * (-len(hb) % 8)
    return order, sizes, struct.pack("<Q", len(hb)) + hb


def tensor_file_size(tensors: list[tuple[str, torch.Tensor]]) -> int:
    """The size in bytes of the tensor file :func:`write_tensors` writes for ``tensors``: data plus header."""
    _, sizes, prefix = _layout(tensors)
    return len(prefix) + sum(sizes)


def write_tensors(path: str, tensors: list[tuple[str, torch.Tensor]], algo: str, sync: bool,
                  dir_fd: int | None = None, metadata: dict | None = None) -> dict:
    """Write a safetensors file; each piece is checksummed just before it is written (while it is in cache).

    The file is new (``O_CREAT | O_EXCL``: never an existing name, never through a link); with ``dir_fd`` (an
    open folder) ``path`` is a name in that folder. ``metadata`` (str -> str) replaces the header's own.
    """
    order, sizes, prefix = _layout(tensors, metadata)
    # segment 0 is the prefix (length + header), segment k >= 1 the tensor order[k - 1]
    segments, pos = [(0, len(prefix))], len(prefix)
    for n in sizes:
        segments.append((pos, n))
        pos += n
    plans = _plan(segments, CHUNK_BYTES)
    uses = [0] * len(segments)
    for plan in plans:
        for seg, *_ in plan:
            uses[seg] += 1
    sources = _HostBytes([torch.empty(0)] + [tensors[i][1] for i in order], uses)
    fd = open_fd(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644, dir_fd=dir_fd, what="a checkpoint file")

    def write_chunk(plan: list) -> str:
        h = _hasher(algo)
        for seg, start, stop, at in plan:
            mv = memoryview(prefix) if seg == 0 else sources.get(seg)
            for s in range(start, stop, _PIECE):
                piece = mv[s:min(stop, s + _PIECE)]
                h.update(piece)
                pwrite_all(fd, piece, at + s - start)
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


# -------------------------------------------------------------------------- read
def load_tensors(file: str, meta: dict, refs: list[TensorRef], map_file: bool) -> dict[str, torch.Tensor]:
    """Read the tensors ``refs`` from a checkpoint tensor file, verifying its block checksums."""
    try:
        from safetensors import SafetensorError, safe_open
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("loading a checkpoint needs safetensors: pip install 'functrain[checkpoint]'") from e

    size = os.stat(file).st_size
    check_size(file, size, meta)
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
            header = loads_json(bytes(hb), file, factor=TREE_FACTOR)
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
            if h["dtype"] != ST_CODES[ref.dtype] or tuple(h["shape"]) != ref.shape or len(prefix) + start != pos:
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
