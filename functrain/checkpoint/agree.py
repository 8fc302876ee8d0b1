"""The ranks of a group deciding together: which checkpoint every rank resumes from.

:meth:`CheckpointManager.load_latest <functrain.checkpoint.CheckpointManager.load_latest>`
with a group tries the candidates newest first on every rank; each rank checks
its own part (its shard's files, or the whole checkpoint when every rank loads
it) and the verdicts are combined with one small collective per candidate, so
every rank takes the same one. A :class:`Agreement` is those collectives: on one
process (``group=None``) each is the identity, no collective runs.

Every collective is bounded by the group's timeout (the trainer passes its gloo
group of ``save_timeout`` seconds); a rank that dies or hangs meanwhile makes the
others raise :class:`~functrain.distributed.PeerFailed` saying what they were
agreeing on, with the collective's own error (lost connection, timeout) chained.
"""
from __future__ import annotations

from typing import Any

import torch

from ..distributed.faults import PeerFailed

__all__ = ["Agreement", "TEXT_BYTES"]

TEXT_BYTES = 2048  # the longest reason one rank sends (longer ones are cut)


class Agreement:
    """Collectives over ``group`` (a ``torch.distributed`` process group; ``None``: one process, no collectives).

    ``what`` names the decision in the error a lost or hung peer causes.

    Example::

        >>> a = Agreement(None, "which checkpoint to resume")
        >>> a.rank, a.world, a.codes(1), a.texts("why"), a.from_rank0([3, 2])
        (0, 1, [1], ['why'], [3, 2])
    """

    def __init__(self, group: Any, what: str):
        self.group, self.what = group, what
        if group is None:
            self.rank, self.world, self.device = 0, 1, torch.device("cpu")
            return
        import torch.distributed as dist

        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        cuda = dist.get_backend(group) == "nccl"
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")

    def _run(self, fn: Any) -> None:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - a peer died or hung: say what was being agreed on
            raise PeerFailed(f"rank {self.rank}: lost the other ranks while agreeing {self.what} "
                             f"({type(e).__name__}: {str(e)[:500]})") from e

    def from_rank0(self, values: list[int]) -> list[int]:
        """Rank 0's ``values`` (a list of ints) on every rank (two broadcasts)."""
        if self.group is None:
            return list(values)
        import torch.distributed as dist

        n = torch.tensor([len(values) if self.rank == 0 else 0], dtype=torch.int64, device=self.device)
        self._run(lambda: dist.broadcast(n, src=dist.get_global_rank(self.group, 0), group=self.group))
        t = torch.tensor(values if self.rank == 0 else [0] * int(n.item()), dtype=torch.int64, device=self.device)
        if t.numel():
            self._run(lambda: dist.broadcast(t, src=dist.get_global_rank(self.group, 0), group=self.group))
        return [int(v) for v in t.tolist()]

    def codes(self, code: int) -> list[int]:
        """Every rank's ``code`` (a small int), by rank: one all-reduce of ``world`` ints."""
        if self.group is None:
            return [int(code)]
        import torch.distributed as dist

        t = torch.zeros(self.world, dtype=torch.int64, device=self.device)
        t[self.rank] = int(code)
        self._run(lambda: dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group))
        return [int(v) for v in t.tolist()]

    def texts(self, text: str) -> list[str]:
        """Every rank's ``text`` (cut at :data:`TEXT_BYTES` bytes of UTF-8), by rank: one all-gather."""
        data = text.encode("utf-8")[:TEXT_BYTES]
        if self.group is None:
            return [data.decode("utf-8", "ignore")]
        import torch.distributed as dist

        mine = torch.zeros(TEXT_BYTES + 8, dtype=torch.uint8)
        mine[:8] = torch.tensor(list(len(data).to_bytes(8, "little")), dtype=torch.uint8)
        mine[8:8 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else mine[8:8]
        mine = mine.to(self.device)
        out = [torch.zeros_like(mine) for _ in range(self.world)]
        self._run(lambda: dist.all_gather(out, mine, group=self.group))
        texts = []
        for t in out:
            raw = bytes(t.cpu().tolist())
            n = min(int.from_bytes(raw[:8], "little"), TEXT_BYTES)
            texts.append(raw[8:8 + n].decode("utf-8", "ignore"))
        return texts
