"""Numbered checkpoints in one folder, rotated to keep the newest few: :class:`CheckpointManager`."""
from __future__ import annotations

import os
import re
import secrets
import shutil
import warnings
from typing import Any, NamedTuple

import torch

from .folder import _is_complete, _tidy, load, load_extra, save
from .format import CheckpointError
from .tensorfile import _check_checksum


class Restored(NamedTuple):
    """What :meth:`CheckpointManager.load_latest` returns."""

    state: Any
    extra: Any
    step: int
    path: str


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
        _check_checksum(checksum)
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
            if _is_complete(p):
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
