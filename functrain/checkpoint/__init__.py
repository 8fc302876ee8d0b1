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
  (:func:`functrain.core.tree.tree_equal`): int64 step counters, RNG states,
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

# format: file names, dtype codes, the tree <-> JSON encoding, template matching, the errors
# tensorfile: the safetensors file of all tensors, written and read in checksummed chunks (crc32/sha256)
# folder: the checkpoint folder: completion mark, atomic save, verified load, leftovers of killed saves
# manager: CheckpointManager (numbered checkpoints, rotation, fallback) and Restored
# per_rank: checkpoints of sharded states (one folder per rank, resharding load); save/load/load_extra
#          below are its dispatchers, which hand unsharded states and folders to folder.save/load unchanged
# agree: the ranks deciding together (which checkpoint to resume; rank 0 writes a replicated state)
# lock: FolderLock (one writer per folder) and the in-use marks of a save's folders
# safe_io: opens that never follow a link (O_NOFOLLOW, O_EXCL temporaries renamed into place): every writer of a
#          results folder uses them; bounded: JSON/YAML parsed under a memory bound (and YAML as plain data only)
# The node-type allow-list lives in functrain.core.registry (core layer): types register where they are defined.
# The classes below declare ``functrain.checkpoint`` as their ``__module__`` (their public home in reprs).
from . import bounded, folder, format, lock, manager, per_rank, safe_io, tensorfile
from ..core.registry import register_checkpoint_type
from .export import export_state_dict, export_weights  # final weights as plain state_dict files
from .folder import check_structure
from .per_rank import load, load_extra  # sharded states: one folder per rank; others go to folder
from .format import EXTRA, FORMAT, MARKER, TENSORS, TREE, VERSION, CheckpointError, CheckpointSpaceError, StructureMismatch
from .lock import FolderLock, FolderLocked
from .safe_io import LinkRefused
from .manager import CheckpointManager, Restored, save  # save: per_rank.save; a replicated state by rank 0

__all__ = [
    "save",
    "load",
    "load_extra",
    "check_structure",
    "CheckpointManager",
    "CheckpointError",
    "CheckpointSpaceError",
    "StructureMismatch",
    "FolderLock",
    "FolderLocked",
    "LinkRefused",
    "Restored",
    "register_checkpoint_type",
    "export_state_dict",
    "export_weights",
]
