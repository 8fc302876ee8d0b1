"""Checkpoints of sharded states: every rank writes its own shard, and loading reshards to any world size.

A sharded state (``ft.data_parallel(shard=...)``; it carries a
:class:`functrain.core.flat.ShardState` slot) is saved by *every* rank of its group
calling ``ft.save(path, state)`` together. The checkpoint is a folder::

    path/
        rank_00000/        rank 0's shard: an ordinary functrain checkpoint folder (safetensors + JSON,
        rank_00001/        its own completion mark), written by that rank, in parallel, no gather
        ...
        SHARDED.json       written last, by rank 0: the world size and the sha256 of each rank's mark

Atomic as a single checkpoint: the ranks write into one hidden temporary folder
beside ``path`` (``.<name>.stmp-<hex>``), a collective agrees that every rank
succeeded, then rank 0 writes ``SHARDED.json`` and renames the folder into
place (a replaced checkpoint is renamed aside first, to ``.<name>.sold-<hex>``,
and removed after). A killed save leaves the previous checkpoint loadable, and
a folder without a valid ``SHARDED.json`` naming every rank's mark is never
loaded. Nothing is unpickled (each rank folder is read by
:func:`functrain.checkpoint.folder.load`). The folder must be on a file system
every rank sees (as for any multi-node checkpoint).

Loading (``ft.load(path, template)``, on every rank of the new group, or in one process):

* same world size and sharding as the template: each rank reads only its own folder;
* otherwise (another world size, ``"optimizer"`` <-> ``"params"``, or an unsharded
  template): the shards are joined into the whole (logical) state, then cut for
  the template: a transient whole copy per loading process (mapped from the files);
* without a template: the whole state (what :func:`functrain.gather_state` gives);
* an unsharded checkpoint into a sharded template: cut for the template.

The logical state never depends on the world size it was saved on: 2 ranks save
-> 1 or 4 ranks load the same state.
"""
from __future__ import annotations

import os
import re
import secrets
import shutil
from typing import Any

import optree
import torch

from ..core.validate import path_str
from ..core.flat import SLOT, FlatLayout, ShardState, reflat, unflat
from ..distributed.faults import PeerFailed
from . import folder
from .format import FORMAT, MARKER, VERSION, CheckpointError, complete, json_bytes

__all__ = ["save", "load", "load_extra", "is_sharded", "is_sharded_checkpoint", "SHARDS_MARK"]

SHARDS_MARK = "SHARDED.json"
KIND = "sharded"
_RANK = re.compile(r"rank_\d{5}$")


def rank_dir(rank: int) -> str:
    """The name of rank ``rank``'s folder inside a sharded checkpoint (``rank_00000``, ...)."""
    return f"rank_{rank:05d}"


def is_sharded(state: Any) -> bool:
    """Whether ``state`` is a sharded training state (it has a :class:`ShardState` slot)."""
    slots = getattr(state, "slots", None)
    return isinstance(slots, dict) and isinstance(slots.get(SLOT), ShardState)


def is_sharded_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a sharded checkpoint folder (complete or not)."""
    return os.path.isfile(os.path.join(os.fspath(path), SHARDS_MARK))


# -------------------------------------------------------------------------- collectives (host side)
def _dist() -> Any:
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def _comm_device(dist: Any) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def _broadcast_int(value: int, world: int) -> int:
    if world == 1:
        return value
    dist = _dist()
    t = torch.tensor([value], dtype=torch.int64, device=_comm_device(dist))
    dist.broadcast(t, src=0)
    return int(t.item())


def all_ranks_agree(ok: bool, world: int) -> bool:
    """Whether ``ok`` holds on every rank (one all-reduce; ``ok`` itself on one process)."""
    if world == 1:
        return ok
    dist = _dist()
    t = torch.tensor([int(ok)], dtype=torch.int64, device=_comm_device(dist))
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


# -------------------------------------------------------------------------- the sharded mark
def _mark_bytes(tmp: str, world: int) -> bytes:
    ranks = {}
    for r in range(world):
        with open(os.path.join(tmp, rank_dir(r), MARKER), "rb") as f:
            ranks[rank_dir(r)] = folder.sha256(f.read())
    return json_bytes({"format": FORMAT, "version": VERSION, "kind": KIND, "world": world, "ranks": ranks})


def _read_mark(path: str) -> int:
    """The world size of the sharded checkpoint at ``path``, after checking its mark names every rank's."""
    mpath = os.path.join(path, SHARDS_MARK)
    mark = folder.read_json(mpath, None)
    world = mark.get("world") if isinstance(mark, dict) else None
    if (not isinstance(mark, dict) or mark.get("format") != FORMAT or mark.get("kind") != KIND
            or not isinstance(world, int) or isinstance(world, bool) or world < 1):
        raise CheckpointError(f"{mpath}: not a functrain sharded checkpoint mark")
    if mark.get("version") != VERSION:
        raise CheckpointError(f"{mpath}: format version {mark.get('version')!r}; this functrain reads {VERSION}")
    ranks = mark.get("ranks")
    expect = {rank_dir(r) for r in range(world)}
    if not isinstance(ranks, dict) or set(ranks) != expect:
        raise CheckpointError(f"{mpath}: must name the folders of ranks 0..{world - 1}; names "
                              f"{sorted(ranks) if isinstance(ranks, dict) else ranks!r}")
    for d, digest in ranks.items():
        try:
            with open(os.path.join(path, d, MARKER), "rb") as f:
                data = f.read(1 << 20)
        except OSError as e:
            raise CheckpointError(f"{path}: the shard of {d} is missing or unreadable ({e})") from None
        if folder.sha256(data) != digest:
            raise CheckpointError(f"{os.path.join(path, d)}: its completion mark is not the one {SHARDS_MARK} "
                                  f"names: the shard was replaced (by another save's?)")
    return world


# -------------------------------------------------------------------------- save
def check_replaceable(path: str) -> None:
    """Refuse to replace anything at ``path`` but a checkpoint folder, sharded (rank folders and its mark) or not."""
    if not os.path.lexists(path):
        return
    if os.path.isdir(path) and not os.path.islink(path):
        entries = os.listdir(path)
        if entries and all(e == SHARDS_MARK or _RANK.match(e) for e in entries):
            return
    folder.check_replaceable(path)  # an unsharded checkpoint folder may be replaced; anything else raises


def _tidy(parent: str, name: str) -> None:
    """What a killed sharded save left: ``.<name>.stmp-*`` is removed; ``.<name>.sold-*`` (the replaced
    checkpoint) is renamed back when ``name`` is missing and it is complete, removed otherwise."""
    pattern = re.compile(re.escape(f".{name}.") + r"(stmp|sold)-[0-9a-f]{12}$")
    for entry in sorted(os.listdir(parent)):
        m = pattern.match(entry)
        if not m:
            continue
        p, target = os.path.join(parent, entry), os.path.join(parent, name)
        if m.group(1) == "sold" and not os.path.lexists(target):
            try:
                _read_mark(p)
                os.rename(p, target)
                continue
            except (CheckpointError, OSError):
                pass
        shutil.rmtree(p, ignore_errors=True)


def save(path: str | os.PathLike, state: Any, extra: Any = None, *, checksum: str = "crc32",
         fsync: bool = True, marks: dict | None = None) -> str:
    """Save ``state`` (any pytree of tensors, e.g. a :class:`~functrain.TrainState`) as a checkpoint folder.

    The folder appears at ``path`` complete or not at all; an existing checkpoint at
    ``path`` is replaced (old one renamed aside, new one renamed in, old one removed).
    Everything that could make the state unsavable (an unsupported leaf or node type,
    an unregistered NamedTuple, ``extra`` that is not JSON) raises before anything is
    written. A sharded state (from ``ft.data_parallel(shard=...)``) is saved by every
    rank of its group calling ``save`` with the same ``path`` together: each writes its
    own shard (no gather), rank 0 completes the folder; see :mod:`functrain.checkpoint.per_rank`.

    Args:
        path: the checkpoint folder to create (its parent is created if needed).
        state: the pytree to save: tensors, Python scalars, strings and ``None`` in dicts,
            lists, tuples and registered NamedTuples (:func:`register_checkpoint_type`).
        extra: any JSON-serialisable value saved beside it (default ``None``), read back with
            :func:`load_extra`.
        checksum: ``"crc32"`` (default, fast) or ``"sha256"``: the checksum of the tensor file's blocks.
        fsync: ``True`` (default) fsyncs every file and folder; ``False`` is faster and still
            atomic against a killed process, but not against a power loss.
        marks: a small JSON dict recorded in (each rank's) completion mark, where
            :func:`~functrain.checkpoint.per_rank.read_marks` finds it (default ``None``: none).

    Returns:
        The checkpoint's absolute path, a str.

    Raises:
        FileExistsError: something other than a checkpoint is at ``path``.
        LinkRefused: ``path`` (or a file functrain writes in it) is a symbolic link.
        TypeError: a leaf or node type that cannot be saved, or ``extra`` that is not JSON.
        ValueError: an unknown ``checksum``, or a path without a name.
        CheckpointSpaceError: (an ``OSError``) the checkpoint does not fit (free space or the
            file-size limit), naming the bytes needed and free; older checkpoints stay intact.
        RuntimeError: a sharded state saved by one process rather than by all ranks of its group.

    Example::

        >>> import tempfile, torch, functrain as ft
        >>> path = ft.save(tempfile.mkdtemp() + "/ckpt", {"w": torch.ones(2)}, extra={"epoch": 1})
        >>> ft.load_extra(path)
        {'epoch': 1}
    """
    if not is_sharded(state):
        return folder.write_checkpoint(path, state, extra, checksum=checksum, fsync=fsync, marks=marks)
    slot: ShardState = state.slots[SLOT]
    world, rank = int(slot.world), int(slot.rank)
    dist = _dist()
    if world > 1 and (dist is None or dist.get_world_size() != world or dist.get_rank() != rank):
        raise RuntimeError(f"save: this is rank {rank}'s shard of a state sharded over {world} ranks; a sharded "
                           f"state is saved by every rank of its (default) process group calling ft.save with "
                           f"the same path together, not by one process")
    path = os.path.abspath(os.fspath(path))
    parent, name = os.path.split(path)
    if not name:
        raise ValueError(f"save needs a folder path with a name; got {path!r}")
    error: BaseException | None = None
    token = 0
    if rank == 0:  # rank 0 prepares one temporary folder for all
        try:
            os.makedirs(parent, exist_ok=True)
            _tidy(parent, name)
            check_replaceable(path)
            token = secrets.randbits(48)
            os.mkdir(os.path.join(parent, f".{name}.stmp-{token:012x}"))
        except BaseException as e:  # noqa: BLE001 - re-raised below, after telling the other ranks
            error, token = e, -1
    token = _broadcast_int(token, world)
    if token < 0:
        if error is not None:
            raise error
        raise PeerFailed(f"save {path}: rank 0 could not prepare the checkpoint folder (see its error)")
    tmp = os.path.join(parent, f".{name}.stmp-{token:012x}")
    try:  # each rank its own shard, in parallel
        folder.write_checkpoint(os.path.join(tmp, rank_dir(rank)), state, extra, checksum=checksum, fsync=fsync,
                                marks=marks)
    except BaseException as e:  # noqa: BLE001
        error = e
    if not all_ranks_agree(error is None, world):
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if error is not None:
            raise error
        raise PeerFailed(f"save {path}: another rank failed to write its shard (see its error); nothing was "
                         f"saved and the previous checkpoint at {path}, if any, is intact")
    if rank == 0:
        old = None
        try:
            folder.write_file(os.path.join(tmp, SHARDS_MARK), _mark_bytes(tmp, world), fsync)
            if fsync:
                folder.fsync_dir(tmp)
            if os.path.lexists(path):
                check_replaceable(path)
                old = os.path.join(parent, f".{name}.sold-{secrets.token_hex(6)}")
                os.rename(path, old)
            os.rename(tmp, path)
            if fsync:
                folder.fsync_dir(parent)
        except BaseException as e:  # noqa: BLE001
            error = e
            shutil.rmtree(tmp, ignore_errors=True)
            if old is not None and not os.path.lexists(path):
                os.rename(old, path)
        else:
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
    if not all_ranks_agree(error is None, world):
        if error is not None:
            raise error
        raise PeerFailed(f"save {path}: rank 0 failed to complete the checkpoint (see its error)")
    return path


def check_complete(path: str | os.PathLike) -> int:
    """The world size of the sharded checkpoint at ``path``, after checking that it is complete: its
    ``SHARDED.json`` names every rank's completion mark, and every rank's files have the sizes listed
    (contents are checked when loaded). A :class:`CheckpointError` says what is wrong."""
    path = os.path.abspath(os.fspath(path))
    world = _read_mark(path)
    for r in range(world):
        folder.check_complete(os.path.join(path, rank_dir(r)))
    return world


def read_marks(path: str | os.PathLike) -> dict:
    """The marks given to ``save(..., marks=)`` (rank 0's for a sharded checkpoint; ``{}`` if none)."""
    path = os.fspath(path)
    if is_sharded_checkpoint(path):
        return folder.read_marks(os.path.join(path, rank_dir(0)))
    return folder.read_marks(path)


def tidy(parent: str, keep_name: Any) -> None:
    """:func:`_tidy` for every checkpoint name in ``parent`` that ``keep_name(name)`` accepts."""
    try:
        entries = os.listdir(parent)
    except FileNotFoundError:
        return
    names = {m.group(1) for m in map(_LEFTOVER.match, entries) if m}
    for name in sorted(n for n in names if keep_name(n)):
        _tidy(parent, name)


_LEFTOVER = re.compile(r"\.(.+)\.(?:stmp|sold)-[0-9a-f]{12}$")


# -------------------------------------------------------------------------- load
def _without_slot(state: Any) -> Any:
    return state._replace(slots={k: v for k, v in state.slots.items() if k != SLOT})


def _whole(states: list, path: str) -> Any:
    """The logical (unsharded) state from the shards of ranks 0..W-1."""
    world = len(states)
    for r, s in enumerate(states):
        if not is_sharded(s):
            raise CheckpointError(f"{os.path.join(path, rank_dir(r))}: not a sharded state")
        if int(s.slots[SLOT].rank) != r or int(s.slots[SLOT].world) != world:
            raise CheckpointError(f"{os.path.join(path, rank_dir(r))}: holds rank {int(s.slots[SLOT].rank)}'s "
                                  f"shard of a {int(s.slots[SLOT].world)}-rank state, expected rank {r} of {world}")
    layout = FlatLayout.from_slot(states[0].slots[SLOT])

    def join(*nodes: Any) -> Any:
        if not layout.is_shard_tree(nodes[0]):
            return nodes[0]  # replicated: every rank holds the same
        return layout.tree({k: torch.cat([n[k] for n in nodes]) for k in layout.keys})

    rests = [_without_slot(s) for s in states]
    try:
        return optree.tree_map(join, rests[0], *rests[1:], is_leaf=layout.is_shard_tree)
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"{path}: the ranks' shards do not have one structure: {e}") from None


def _cut(logical: Any, template: Any, path: str) -> Any:
    """``logical`` cut for the sharded ``template`` (its world, rank and mode)."""
    tslot: ShardState = template.slots[SLOT]
    layout = FlatLayout.from_slot(tslot)
    try:
        mine = FlatLayout.from_params(logical.params, 1, 0)
    except (TypeError, AttributeError) as e:
        raise CheckpointError(f"{path}: its params cannot be sharded like the template's: {e}") from None
    if not mine.same_params(layout):
        raise CheckpointError(f"{path}: its params (structure, dtypes, shapes) are not the template's: the "
                              f"checkpoint is of another model. Checkpoint: {[e[:2] for e in mine.entries][:4]}..., "
                              f"template: {[e[:2] for e in layout.entries][:4]}...")

    def cut(t: Any, x: Any) -> Any:
        return layout.shard_of(x, copy=True) if layout.is_shard_tree(t) else x

    try:
        out = optree.tree_map(cut, _without_slot(template), logical, is_leaf=layout.is_shard_tree)
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"{path}: the checkpoint's state does not have the template's structure "
                              f"(another step's state?): {e}") from None
    return out._replace(slots={**out.slots, SLOT: tslot})


def _like(loaded: Any, template: Any, path: str, device: Any) -> Any:
    """Check ``loaded`` against ``template`` leaf by leaf and place each tensor on the template's device."""
    paths, leaves, spec = optree.tree_flatten_with_path(loaded)
    tpaths, tleaves, tspec = optree.tree_flatten_with_path(template)
    if spec != tspec:
        raise CheckpointError(f"{path}: the checkpoint's structure is not the template's: checkpoint "
                              f"{[path_str(p) for p in paths][:8]}..., template {[path_str(p) for p in tpaths][:8]}...")
    out = []
    for p, x, t in zip(paths, leaves, tleaves):
        if torch.is_tensor(t):
            if not torch.is_tensor(x) or x.dtype != t.dtype or x.shape != t.shape:
                got = f"{x.dtype} {tuple(x.shape)}" if torch.is_tensor(x) else type(x).__name__
                raise CheckpointError(f"{path}: {path_str(p)} is {got} in the checkpoint, {t.dtype} "
                                      f"{tuple(t.shape)} in the template")
            target = torch.device(device) if device is not None else t.device
            x = x.to(target) if x.device != target else x
        out.append(x)
    return optree.tree_unflatten(spec, out)


def _same_slot(a: ShardState, b: ShardState) -> bool:
    try:
        return all(optree.tree_leaves(optree.tree_map(lambda x, y: x.shape == y.shape and bool(torch.equal(
            x.cpu(), y.cpu())), a, b)))
    except (ValueError, TypeError):
        return False


def load(path: str | os.PathLike, template: Any = None, *, device: Any = None, mmap: bool = True) -> Any:
    """Load the state saved at ``path``; nothing is unpickled.

    Every file is checked against the completion mark before its contents are used.
    With ``mmap=True`` each CPU tensor of 1 MiB or more is a private copy-on-write
    mapping of its bytes in the file: no copy is made, writing to the tensor never
    changes the file, and the file's pages are shared with the page cache until
    written. Such a tensor is backed by the file while it lives (a rotated-out
    checkpoint's disk space is freed when the state is dropped, usually after the next
    step); checkpoints are never modified in place, but if something else rewrites the
    file in place the mapped pages may change. Tensors bound for another device are
    copied there from the mapping.

    Sharded checkpoints (see :mod:`functrain.checkpoint.per_rank`) load into a template
    of any world size and sharding, or unsharded: ``load(path)`` gives the whole state,
    ``load(path, step.init(params, buffers))`` on every rank of a sharded step cuts each
    rank's shard.

    Args:
        path: the checkpoint folder (what :func:`save` returned).
        template: ``None`` (default: the saved structure as it is), or a state of the same
            structure, shapes and dtypes (e.g. from ``step.init``): each tensor goes to the
            device of the template's leaf, and a flat template (``ft.flat``) gets flat params.
        device: where to place the tensors (default ``None``: CPU without a template, the
            template's devices with one); given, it overrides the template's devices.
        mmap: ``True`` (default, as ``safetensors.torch.load_file``) maps large CPU tensors
            from the file; ``False`` copies every tensor into memory of its own.

    Returns:
        The loaded state (the template's types where a template is given).

    Raises:
        CheckpointError: a missing, incomplete, truncated or edited file, naming it.
        StructureMismatch: (a :class:`CheckpointError`) the checkpoint's structure is not the
            template's, naming every differing path.

    Example::

        >>> import tempfile, torch, functrain as ft
        >>> path = ft.save(tempfile.mkdtemp() + "/ckpt", {"w": torch.arange(3.0), "step": 7})
        >>> ft.load(path)
        {'w': tensor([0., 1., 2.]), 'step': 7}
        >>> ft.load(path, template={"w": torch.zeros(3), "step": 0})["w"]
        tensor([0., 1., 2.])
    """
    path = os.path.abspath(os.fspath(path))
    sharded_ckpt, sharded_template = is_sharded_checkpoint(path), is_sharded(template)
    if not sharded_ckpt and not sharded_template:
        return folder.load(path, template, device=device, mmap=mmap)
    if sharded_ckpt:
        world = _read_mark(path)
        if sharded_template:
            tslot: ShardState = template.slots[SLOT]
            if int(tslot.world) == world:  # same cut: this rank reads its own shard only
                mine = folder.load(os.path.join(path, rank_dir(int(tslot.rank))), mmap=mmap)
                if is_sharded(mine) and _same_slot(mine.slots[SLOT], tslot):
                    return _like(complete(mine, template), template, path, device)
        logical = _whole([folder.load(os.path.join(path, rank_dir(r)), mmap=mmap) for r in range(world)], path)
    else:
        logical = folder.load(path, mmap=mmap)
    if template is not None:  # what an older checkpoint lacks (hyper-parameters as data): the template's
        logical = complete(logical, unflat(template))
    out = _cut(logical, template, path) if sharded_template else logical
    if template is not None:  # a flat template (ft.flat) takes the named tensors packed again
        return reflat(_like(out, unflat(template), path, device), template)
    if device is not None:
        out = optree.tree_map(lambda x: x.to(device) if torch.is_tensor(x) else x, out)
    return out




def load_extra(path: str | os.PathLike) -> Any:
    """The ``extra`` JSON value saved with the checkpoint at ``path`` (rank 0's for a sharded checkpoint).

    Args:
        path: the checkpoint folder.

    Returns:
        The decoded JSON value (``None`` when ``save`` got no ``extra``).

    Raises:
        CheckpointError: the checkpoint is incomplete or its ``extra.json`` differs from the completion mark.

    Example::

        >>> import tempfile, torch, functrain as ft
        >>> path = ft.save(tempfile.mkdtemp() + "/ckpt", {"w": torch.ones(1)}, extra={"batches_seen": 12})
        >>> ft.load_extra(path)
        {'batches_seen': 12}
    """
    path = os.fspath(path)
    if is_sharded_checkpoint(path):
        _read_mark(os.path.abspath(path))
        return folder.load_extra(os.path.join(path, rank_dir(0)))
    return folder.load_extra(path)
