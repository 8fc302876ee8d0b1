"""Numbered checkpoints in one folder, rotated to keep the newest few: :class:`CheckpointManager`."""
from __future__ import annotations

import math
import os
import re
import secrets
import shutil
import warnings
from typing import Any, NamedTuple

import torch

from ..distributed.faults import PeerFailed
from . import per_rank
from .agree import Agreement, check_timeout, replicated_rank, save_once
from .folder import check_complete, check_structure, load, tidy, write_checkpoint
from .format import CheckpointError, StructureMismatch
from .lock import hold_dir
from .tensorfile import check_checksum


_DAMAGED, _REFUSED, _FAILED = 1, 2, 3  # a rank's verdict on a candidate checkpoint (0: it loaded)


class Restored(NamedTuple):
    """What :meth:`CheckpointManager.load_latest` returns.

    Attributes:
        state: the loaded state.
        extra: the ``extra`` JSON value saved with it.
        step: the checkpoint's step number, an int.
        path: the checkpoint folder.

    Example::

        >>> import tempfile, torch, functrain as ft
        >>> manager = ft.CheckpointManager(tempfile.mkdtemp())
        >>> _ = manager.save(5, {"w": torch.ones(1)}, extra={"epoch": 0})
        >>> restored = manager.load_latest()
        >>> restored.step, restored.extra, restored.state["w"]
        (5, {'epoch': 0}, tensor([1.]))
    """

    __module__ = "functrain.checkpoint"  # its public home, in reprs and docs

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

    In a process group of more than one process (``torch.distributed``
    initialised), an unsharded state is *replicated* (data parallelism keeps it
    the same on every rank) and rank 0 writes it: call ``save`` on rank 0 alone,
    or on every rank (as Accelerate's ``save_state``). A rank's n-th save is
    paired with rank 0's n-th (:func:`functrain.checkpoint.agree.save_once`):
    into the same folder, that rank writes nothing, waits up to ``timeout``
    seconds for rank 0's save and returns its path (another step raises
    ``ValueError`` naming both); into another folder (each rank its own), it
    writes its own. ``replicated=False`` writes on this rank without asking
    rank 0. A sharded state (``ft.data_parallel(shard=...)``) is
    saved by every rank of its group calling ``save`` together: each writes its
    shard into the step's folder (:mod:`functrain.checkpoint.per_rank`), the
    folder appears complete with its ``SHARDED.json`` last, and then rank 0
    alone prunes. ``load_latest`` (on every rank, with each rank's template)
    reads such checkpoints too, into a template of any world size.

    With ``keep_best=True`` each save may carry a ``score`` (lower is better: an evaluation loss), recorded in
    its completion mark, and rotation also keeps the best-scored checkpoint (:meth:`best`) beside the newest
    ``keep``: the newest and the best, as denoising-diffusion-pytorch's ``save_best_and_latest_only``. It is
    rotated like the others, only after the new checkpoint is complete, so a kill at any point leaves the best
    checkpoint loadable (the new one if it was complete, else the old one).

    Args:
        folder: the folder of the numbered checkpoints (created by the first save).
        keep: how many checkpoints to keep, an int >= 1 (default 3), or ``None``: keep all.
        keep_best: also keep the checkpoint of the lowest ``score`` (default ``False``).
        checksum: ``"crc32"`` (default) or ``"sha256"``, as in :func:`save`.
        fsync: as in :func:`save` (default ``True``).
        replicated: ``True`` (default): in a process group, an unsharded state is the same on every rank
            and rank 0 writes it; ``False``: this rank writes, without asking rank 0 (a folder of its own).
        timeout: how long a rank other than 0 waits for rank 0's save, in seconds (default 1800).

    Attributes:
        folder: the folder's absolute path.
        keep, keep_best, checksum, fsync, replicated, timeout: the settings above.

    Raises:
        ValueError: ``keep`` is not an int >= 1 or ``None``, an unknown ``checksum``, or a ``timeout``
            that is not a finite number > 0.
        TypeError: ``replicated`` is not a bool, or ``timeout`` not a number.

    Example::

        >>> import tempfile, torch, functrain as ft
        >>> manager = ft.CheckpointManager(tempfile.mkdtemp(), keep=2)
        >>> for step in (10, 20, 30):
        ...     _ = manager.save(step, {"w": torch.full((1,), float(step))})
        >>> manager.steps()
        [20, 30]
        >>> manager.load_latest(template={"w": torch.zeros(1)}).state["w"]
        tensor([30.])
    """

    __module__ = "functrain.checkpoint"  # its public home, in reprs and tracebacks

    _NAME = re.compile(r"step_(\d+)$")
    _ASIDE = re.compile(r"\.step_(\d+)\.s?old-[0-9a-f]{12}$")  # (sold: a sharded save's)

    def __init__(self, folder: str | os.PathLike, keep: int | None = 3, *, keep_best: bool = False,
                 checksum: str = "crc32", fsync: bool = True, replicated: bool = True, timeout: float = 1800.0):
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
            raise ValueError(f"keep must be an int >= 1 or None (keep all); got {keep!r}")
        if not isinstance(keep_best, bool):
            raise TypeError(f"keep_best must be True or False; got {keep_best!r}")
        self.keep_best = keep_best
        check_checksum(checksum)
        if not isinstance(replicated, bool):
            raise TypeError(f"replicated must be True or False; got {replicated!r}")
        self.timeout = check_timeout(timeout)
        self.folder = os.path.abspath(os.fspath(folder))
        self.keep, self.checksum, self.fsync, self.replicated = keep, checksum, fsync, replicated

    def __repr__(self) -> str:
        return f"CheckpointManager({self.folder!r}, keep={self.keep}" + (", keep_best=True)" if self.keep_best else ")")

    def path(self, step: int) -> str:
        """The folder of the checkpoint for ``step`` (whether or not it exists).

        Args:
            step: the step number (an int, or an int tensor).

        Returns:
            ``folder/step_{step:08d}``.
        """
        return os.path.join(self.folder, f"step_{int(step):08d}")

    def _scan(self) -> tuple[dict[int, str], dict[int, tuple[str, str]]]:
        """``({step: path} of the complete checkpoints, {step: (path, why)} of the damaged ones)``.

        Complete: a valid mark and every listed file at its size. A ``step_*`` folder that is not complete
        is damaged (a save never leaves one: it renames a finished folder into place); so is a symbolic link
        named like a checkpoint (planted: a save never makes one).
        """
        try:
            entries = os.listdir(self.folder)
        except FileNotFoundError:
            return {}, {}
        found: dict[int, str] = {}
        asides: dict[int, str] = {}
        damaged: dict[int, tuple[str, str]] = {}
        for entry in entries:
            m, a = self._NAME.match(entry), self._ASIDE.match(entry)
            if not (m or a):
                continue
            p = os.path.join(self.folder, entry)
            step = int((m or a).group(1))
            if os.path.islink(p):  # never a checkpoint of this folder's own: not loaded, never rotated
                if m:
                    damaged[step] = (p, f"a symbolic link (to {os.readlink(p)!r}), not a checkpoint folder this "
                                        f"folder owns: not loaded, not removed")
                continue
            try:
                if per_rank.is_sharded_checkpoint(p):
                    per_rank.check_complete(p)
                else:
                    check_complete(p)
            except CheckpointError as e:
                if m:
                    damaged[step] = (p, str(e))
                continue
            (found if m else asides)[step] = p
        # a replaced step's old folder, if the kill came between the two renames of a replacement
        for step, p in asides.items():
            found.setdefault(step, p)
        return found, {s: d for s, d in damaged.items() if s not in found}

    def _complete(self) -> dict[int, str]:
        return self._scan()[0]

    def steps(self) -> list[int]:
        """The steps of the complete checkpoints, oldest first.

        Returns:
            A sorted list of ints (empty when there is none).
        """
        return sorted(self._complete())

    def latest(self) -> str | None:
        """The path of the newest complete checkpoint.

        Returns:
            Its folder, or ``None`` when there is none.
        """
        found = self._complete()
        return found[max(found)] if found else None

    def save(self, step: int, state: Any, extra: Any = None, *, finite: bool | None = None,
             score: float | None = None) -> str:
        """Save ``state`` as the checkpoint of ``step``, then prune to the newest ``keep``.

        Pruning never removes the newest checkpoint not marked ``finite=False``: after
        non-finite saves, the last good one stays (``keep + 1`` folders then). A sharded state
        is saved by every rank calling this together; rank 0 alone prunes. In a process group,
        an unsharded state is rank 0's to write (and prune): another rank that saves into the same
        folder writes nothing and waits for rank 0's save of the same step (see the class).

        Args:
            step: the step number, an int >= 0 (or an int tensor, such as ``state.step``).
            state: the state, as :func:`save` takes it.
            extra: a JSON-serialisable value saved beside it (default ``None``).
            finite: whether the state's parameters are finite, if the caller checked (default
                ``None``: unknown); recorded in the checkpoint's completion mark.
            score: with ``keep_best``, the checkpoint's score, lower is better (default ``None``: none, never
                the best); recorded in its completion mark. A non-finite one is recorded as none.

        Returns:
            The checkpoint's path.

        Raises:
            ValueError: ``step`` is not an int >= 0; or (on a rank other than 0) rank 0 saved another
                step at this point.
            TypeError: ``finite`` is not a bool or ``None``; and as :func:`save`.
            functrain.distributed.PeerFailed: (on a rank other than 0) rank 0's save failed, or did not come
                within ``timeout``.
        """
        if isinstance(step, torch.Tensor):
            step = int(step)
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an int >= 0; got {step!r}")
        if finite is not None and not isinstance(finite, bool):
            raise TypeError(f"finite must be a bool or None; got {finite!r}")
        marks = self._marks(finite, score)
        if per_rank.is_sharded(state):
            return self._save_sharded(step, state, extra, finite, marks)
        if self.replicated and replicated_rank() is not None:  # rank 0 writes; a rank that saves too waits
            return save_once("manager", self.folder, step, lambda: self._write(step, state, extra, finite, marks),
                             self.timeout)
        return self._write(step, state, extra, finite, marks)

    def _marks(self, finite: bool | None, score: Any) -> dict | None:
        """The completion mark's marks: ``finite``, and with ``keep_best`` the ``score`` (a finite number)."""
        if score is not None and not self.keep_best:
            raise ValueError(f"score={score!r} ranks checkpoints for keep_best, and this manager has "
                             f"keep_best=False")
        if score is not None and (isinstance(score, bool) or not isinstance(score, (int, float))):
            raise TypeError(f"score must be a number (lower is better) or None; got {type(score).__name__}")
        marks = {} if finite is None else {"finite": finite}
        if score is not None and math.isfinite(score):
            marks["score"] = float(score)
        return marks or None

    def _write(self, step: int, state: Any, extra: Any, finite: bool | None, marks: dict | None) -> str:
        os.makedirs(self.folder, exist_ok=True)
        self._tidy()
        path = write_checkpoint(self.path(step), state, extra, checksum=self.checksum, fsync=self.fsync,
                                marks=marks)
        self._prune(step, finite)
        return path

    def _tidy(self) -> None:
        """Remove what killed saves and removals left (plain and sharded ones)."""
        keep = lambda n: self._NAME.match(n) is not None  # noqa: E731
        tidy(self.folder, keep)
        per_rank.tidy(self.folder, keep)

    def _save_sharded(self, step: int, state: Any, extra: Any, finite: bool | None, marks: dict | None) -> str:
        """Every rank: its shard into ``step_*``; rank 0 prunes once the checkpoint is complete."""
        slot = state.slots[per_rank.SLOT]
        world, rank = int(slot.world), int(slot.rank)
        if finite is not None:  # the same mark in every rank's folder: finite only if every shard is
            finite = per_rank.all_ranks_agree(finite, world)
            marks = {**(marks or {}), "finite": finite}
        if rank == 0:
            try:
                os.makedirs(self.folder, exist_ok=True)
                self._tidy()
            except OSError as e:  # per_rank.save reports a folder it cannot use to every rank
                warnings.warn(f"{self.folder}: could not tidy leftovers of killed saves ({e})", RuntimeWarning,
                              stacklevel=3)
        # collective: returns on every rank only after rank 0 has renamed the complete folder into place
        path = per_rank.save(self.path(step), state, extra, checksum=self.checksum, fsync=self.fsync,
                            marks=marks)
        if rank == 0:
            self._prune(step, finite)
        return path

    def _prune(self, step: int, finite: bool | None) -> None:
        """Remove the oldest complete checkpoints beyond ``keep`` (never ``step``, nor the newest finite one, nor
        with ``keep_best`` the best one)."""
        if self.keep is not None:
            found = self._complete()
            others = sorted(s for s in found if s != step)  # the one just saved always stays
            doomed = others[:max(0, len(others) - (self.keep - 1))]
            spared = {self.newest_finite(found) if finite is False else None,
                      self.best(found) if self.keep_best else None}
            for old in doomed:
                if old not in spared:
                    self._remove(found[old])

    def best(self, found: dict[int, str] | None = None) -> int | None:
        """The step of the complete checkpoint with the lowest score (the oldest of equal ones), not marked
        ``finite=False``: what ``keep_best`` keeps.

        Args:
            found: ``{step: path}`` of the complete checkpoints, when the caller has them
                (default ``None``: scanned here).

        Returns:
            That step, or ``None`` if no checkpoint has a score. A mark's score that is not a finite number
            (``NaN``, ``Infinity``, ``1e999``, an int past a float, a string: a mark edited by hand, or damaged)
            is not ranked, as :meth:`save` records none for a score that is not finite.

        Example::

            >>> import tempfile, torch, functrain as ft
            >>> manager = ft.CheckpointManager(tempfile.mkdtemp(), keep=1, keep_best=True)
            >>> for step, loss in ((1, 0.5), (2, 0.2), (3, 0.4)):
            ...     _ = manager.save(step, {"w": torch.ones(1)}, score=loss)
            >>> manager.steps(), manager.best()
            ([2, 3], 2)
        """
        found = self._complete() if found is None else found
        scored = []
        for step in sorted(found):
            marks = per_rank.read_marks(found[step])
            score = _rank(marks.get("score"))
            if marks.get("finite") is not False and score is not None:
                scored.append((score, step))
        return min(scored)[1] if scored else None

    def newest_finite(self, found: dict[int, str] | None = None) -> int | None:
        """The step of the newest complete checkpoint not marked ``finite=False``.

        Args:
            found: ``{step: path}`` of the complete checkpoints, when the caller has them
                (default ``None``: scanned here).

        Returns:
            That step, or ``None`` if there is none.
        """
        found = self._complete() if found is None else found
        for step in sorted(found, reverse=True):
            if per_rank.read_marks(found[step]).get("finite") is not False:
                return step
        return None

    def _remove(self, path: str) -> None:
        m = self._NAME.match(os.path.basename(path)) or self._ASIDE.match(os.path.basename(path))
        doomed = os.path.join(self.folder, f".step_{m.group(1)}.del-{secrets.token_hex(6)}")
        try:
            fd = hold_dir(path)  # in use while it is removed: a concurrent tidy leaves it alone
        except OSError:
            return
        try:
            os.rename(path, doomed)
            shutil.rmtree(doomed, ignore_errors=True)
        except OSError:
            pass
        finally:
            os.close(fd)

    def load_latest(self, template: Any = None, *, device: Any = None, mmap: bool = True,
                    fallback: bool = True, group: Any = None) -> Restored | None:
        """Load the newest complete checkpoint as a :class:`Restored` ``(state, extra, step, path)``.

        With a template, the saved structure is compared with it first, and a difference
        raises :class:`StructureMismatch` naming every differing path, before any tensor is
        read (that is a different run, not damage: there is no fallback). With ``fallback``,
        damage in the newest checkpoint (a truncated or missing file, a checksum mismatch, an
        invalid ``tree.json`` or ``extra.json``) falls back to the newest good one; a
        ``RuntimeWarning`` names each checkpoint skipped and why.

        Several processes agree (``group``): each rank checks its own part of each candidate,
        newest first (its shard's files; the whole checkpoint when every rank loads it), the
        verdicts are combined with one small collective per candidate, and every rank loads
        the newest checkpoint that is whole on every rank. Rank 0 names each skipped
        checkpoint once, with the rank, the file and why.

        Args:
            template: as :func:`load` (default ``None``).
            device: as :func:`load` (default ``None``).
            mmap: as :func:`load` (default ``True``).
            fallback: ``True`` (default) skips damaged checkpoints for older good ones; ``False``
                raises the newest one's damage.
            group: a process group whose ranks all call ``load_latest`` together (default ``None``:
                the default group when ``template`` is sharded over more than one rank, else this
                process alone).

        Returns:
            The :class:`Restored`, or ``None`` when there is no checkpoint.

        Raises:
            CheckpointError: checkpoints exist and none loads (the newest one's error; every rank
                raises the same one, never one rank starting afresh while another resumes), or a
                damaged newest one without ``fallback``.
            StructureMismatch: the newest checkpoint's structure is not the template's.
            functrain.distributed.PeerFailed: another rank could not load it for a reason that is not
                damage, or died or hung (within the group's timeout).
        """
        agree = Agreement(self._agreeing(template, group), f"which checkpoint of {self.folder} to resume")
        found, damaged = self._scan()
        # the candidates are rank 0's, newest first: every rank tries the same steps in the same order
        head = agree.from_rank0([len(damaged), *sorted(found, reverse=True)])
        n_damaged, steps = head[0], head[1:]
        skipped: list[tuple[int, str, str]] = [(s, p, why) for s, (p, why) in damaged.items()] \
            if agree.rank == 0 else []
        first: CheckpointError | None = None
        restored = None
        for step in steps:
            code, error, loaded = self._try(found.get(step), step, template, device, mmap, agree.rank)
            codes = agree.codes(code)
            if not any(codes):
                restored = loaded
                break
            bad = [r for r, c in enumerate(codes) if c]
            reasons = agree.texts(str(error) if error is not None else "")
            why = reasons[0] if agree.world == 1 else "; ".join(f"rank {r}: {reasons[r]}" for r in bad)
            if max(codes) >= _REFUSED:  # another run's state, or a failure that is not damage: no fallback
                if error is not None and codes[agree.rank] >= _REFUSED:
                    raise error
                raise PeerFailed(f"rank(s) {', '.join(map(str, bad))} could not load {self.path(step)}: {why}")
            if not fallback:
                raise error if agree.world == 1 else CheckpointError(why)
            if first is None:
                first = error if agree.world == 1 else CheckpointError(why)
            skipped.append((step, found.get(step, self.path(step)), why))
        newer = sorted((s, p, why) for s, p, why in skipped if restored is None or s > restored.step)
        if newer and not fallback:
            raise CheckpointError(f"{newer[-1][1]}: {newer[-1][2]}")
        then = f"; loading {restored.path} (step {restored.step}) instead" if restored is not None else ""
        for _, p, why in reversed(newer if agree.rank == 0 else []):  # named once, by rank 0
            warnings.warn(f"skipping checkpoint {p}: {why}{then}", RuntimeWarning, stacklevel=2)
        if restored is None and (steps or n_damaged):
            if first is not None:
                raise first
            raise CheckpointError(f"no checkpoint in {self.folder} loads: "
                                  f"{', '.join(p for _, p, _ in newer) or f'{n_damaged} on rank 0'} are damaged "
                                  f"(see the warnings); move them away to start afresh")
        return restored

    @staticmethod
    def _agreeing(template: Any, group: Any) -> Any:
        """The process group whose ranks must agree (``None``: this process decides alone)."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return None
        if group is None:
            if not per_rank.is_sharded(template) or int(template.slots[per_rank.SLOT].world) <= 1:
                return None
            group = dist.group.WORLD
        return group if dist.get_world_size(group) > 1 else None

    def _try(self, path: str | None, step: int, template: Any, device: Any, mmap: bool,
             rank: int) -> tuple[int, BaseException | None, Restored | None]:
        """``(code, error, restored)``: this rank's attempt at the checkpoint of ``step`` (code 0: loaded)."""
        try:
            if path is None:
                raise CheckpointError(f"{self.path(step)}: rank {rank} does not find it complete (is "
                                      f"{self.folder} on a file system every rank sees?)")
            if per_rank.is_sharded_checkpoint(path) or per_rank.is_sharded(template):
                state = self._load_sharded(path, template, device, mmap)
            else:
                if template is not None:
                    check_structure(path, template)
                state = load(path, template, device=device, mmap=mmap)
            return 0, None, Restored(state, per_rank.load_extra(path), step, path)
        except StructureMismatch as e:
            return _REFUSED, e, None
        except CheckpointError as e:
            return _DAMAGED, e, None
        except Exception as e:  # noqa: BLE001 - told to the other ranks (so none waits for this one), then raised
            return _FAILED, e, None

    @staticmethod
    def _load_sharded(path: str, template: Any, device: Any, mmap: bool) -> Any:
        """A sharded checkpoint, or one into a sharded template (:func:`per_rank.load`: reshards to any world).

        The same world: the structure is checked against this rank's shard before any tensor is read.
        Otherwise the shards are read, and a checkpoint whose files are sound but that does not fit the
        template is a :class:`StructureMismatch` (another run), not damage.
        """
        early: StructureMismatch | None = None
        if template is not None and per_rank.is_sharded_checkpoint(path) and per_rank.is_sharded(template):
            slot = template.slots[per_rank.SLOT]
            if per_rank.check_complete(path) == int(slot.world):
                try:
                    check_structure(os.path.join(path, per_rank.rank_dir(int(slot.rank))), template)
                except StructureMismatch as e:
                    early = e  # perhaps only another cut (shard="optimizer" <-> "params"): load decides
        try:
            return per_rank.load(path, template, device=device, mmap=mmap)
        except StructureMismatch:
            raise
        except CheckpointError as e:
            if template is None:
                raise
            try:
                per_rank.load(path, mmap=mmap)  # damage (fall back) or another structure (refuse)?
            except CheckpointError:
                raise e from None
            raise (early or StructureMismatch(path, [("<state>", str(e))])) from None


def save(path: str | os.PathLike, state: Any, extra: Any = None, *, checksum: str = "crc32", fsync: bool = True,
         marks: dict | None = None, replicated: bool = True, timeout: float = 1800.0) -> str:
    """Save ``state`` (any pytree of tensors, e.g. a :class:`~functrain.TrainState`) as a checkpoint folder.

    The folder appears at ``path`` complete or not at all; an existing checkpoint at ``path`` is
    replaced (old one renamed aside, new one renamed in, old one removed). Everything that could make
    the state unsavable raises before anything is written. A sharded state
    (``ft.data_parallel(shard=...)``) is saved by every rank of its group calling ``save`` with the
    same ``path`` together, each its own shard (:mod:`functrain.checkpoint.per_rank`).

    In a process group of more than one process, an unsharded state is replicated and rank 0 writes
    it: call ``save`` on rank 0 alone, or on every rank. A rank's n-th ``save`` is paired with rank
    0's n-th: the same ``path``, and that rank writes nothing, waits up to ``timeout`` seconds for
    rank 0's save and returns once it is complete; another path (each rank its own), and it writes
    its own. ``replicated=False`` writes on this rank without asking rank 0.

    Args:
        path: the checkpoint folder to create (its parent is created if needed).
        state: the pytree to save: tensors, Python scalars, strings and ``None`` in dicts, lists, tuples
            and registered NamedTuples (:func:`register_checkpoint_type`).
        extra: any JSON-serialisable value saved beside it (default ``None``), read back with
            :func:`load_extra`.
        checksum: ``"crc32"`` (default, fast) or ``"sha256"``: the checksum of the tensor file's blocks.
        fsync: ``True`` (default) fsyncs every file and folder; ``False`` is faster and still atomic
            against a killed process, but not against a power loss.
        marks: a small JSON dict recorded in (each rank's) completion mark (default ``None``).
        replicated: ``True`` (default): in a process group, an unsharded state is rank 0's to write;
            ``False``: this rank writes it, without asking rank 0.
        timeout: how long a rank other than 0 waits for rank 0's save, in seconds (default 1800).

    Returns:
        The checkpoint's absolute path, a str.

    Raises:
        FileExistsError: something other than a checkpoint is at ``path``.
        LinkRefused: ``path`` (or a file functrain writes in it) is a symbolic link.
        TypeError: a leaf or node type that cannot be saved, ``extra`` that is not JSON, or a
            ``replicated`` that is not a bool.
        ValueError: an unknown ``checksum``, a path without a name, or a bad ``timeout``.
        CheckpointSpaceError: (an ``OSError``) the checkpoint does not fit (free space or the file-size
            limit), naming the bytes needed and free; older checkpoints stay intact.
        RuntimeError: a sharded state saved by one process rather than by all ranks of its group.
        functrain.distributed.PeerFailed: (on a rank other than 0) rank 0's save of ``path`` failed, or
            did not come within ``timeout``.

    Example::

        >>> import tempfile, torch, functrain as ft
        >>> path = ft.save(tempfile.mkdtemp() + "/ckpt", {"w": torch.ones(2)}, extra={"epoch": 1})
        >>> ft.load_extra(path)
        {'epoch': 1}
    """
    if not isinstance(replicated, bool):
        raise TypeError(f"replicated must be True or False; got {replicated!r}")
    timeout = check_timeout(timeout)
    if not (replicated and replicated_rank() is not None) or per_rank.is_sharded(state):
        return per_rank.save(path, state, extra, checksum=checksum, fsync=fsync, marks=marks)
    target = os.path.abspath(os.fspath(path))
    return save_once("save", target, None,
                     lambda: per_rank.save(target, state, extra, checksum=checksum, fsync=fsync, marks=marks), timeout)


def _rank(score: Any) -> float | None:
    """A completion mark's ``score`` as the finite float it ranks by, or ``None`` (not ranked)."""
    if isinstance(score, bool) or not isinstance(score, (int, float)):
        return None
    try:
        value = float(score)
    except OverflowError:  # (an int past a float's range)
        return None
    return value if math.isfinite(value) else None
