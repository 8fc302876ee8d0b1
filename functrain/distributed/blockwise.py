"""Per-block gathering for ``data_parallel(shard="params", blocks=model)``: the whole model is never held.

Without it a ``shard="params"`` step all-gathers every parameter before the forward and keeps them, and their
whole gradient, until the reduce-scatter. With ``blocks=model`` the step is differentiated with respect to
this rank's shard itself, and each block marked with :func:`functrain.remat` makes its parameters from it:

* the shard (one flat buffer per dtype, :class:`~functrain.core.flat.FlatLayout`'s cut, unchanged: checkpoints,
  resharding and resume are the same) is split at the block boundaries into this rank's *pieces* (a
  block's parameters are one run of each buffer: ``named_parameters`` order, a block's names share a prefix);
* the parameters outside the blocks (embeddings, a head) are gathered once, before the loss; every block's
  are gathered when the block runs (:class:`~functrain.core.recompute.Lent`), and again when the backward
  reaches it, by the remat mechanism (:mod:`functrain.core.recompute`): nothing made from the gathered
  parameters is kept between them, and the gathered block is freed after its forward;
* in the forward the next block's gather is issued before this block computes (prefetched: at most two
  blocks gathered at once), and waited for when that block runs; in the backward likewise the re-gather of the
  block before (the next one the backward reaches) is issued when this block's recomputation starts;
* a gather is a sum of every rank's pieces laid into a buffer of ``-0.0`` (``x + -0.0 == x`` for every float:
  the exact concatenation) and its gradient the sum of every rank's gradient of that buffer, cut to this
  rank's pieces: both one functional all-reduce (in the graph, no host sync). So the gradient the step gets
  is this rank's shard of the gradient summed over the ranks, and the reduce stage has nothing left to reduce.

The gather is an all-reduce, not an all-gather, because a block's run of the buffer falls unevenly on the
ranks (the layout cuts the whole buffer, not each block); on gloo that is also the faster collective. On
NCCL an all-reduce moves twice an all-gather's bytes: a per-block padded layout would make it an all-gather.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ..core.flat import FlatLayout
from ..core.recompute import Lender, Lent, tie
from ..core.remat import marked_blocks
from ..core.validate import BadValue, describe

__all__ = ["BlockPlan", "BlockLender", "check_blocks"]

REST = -1  # the owner of the parameters outside the blocks


def check_blocks(blocks: Any) -> torch.nn.Module:
    """``blocks=``: the module whose ``ft.remat``-marked blocks are gathered one at a time."""
    if not isinstance(blocks, torch.nn.Module):
        raise BadValue(f"data_parallel: blocks must be the model given to ft.functionalize (a torch.nn.Module "
                       f"whose blocks are marked with ft.remat); got {describe(blocks)}")
    if not marked_blocks(blocks):
        raise BadValue(f"data_parallel: blocks={type(blocks).__name__} has no block marked with ft.remat; "
                       f"per-block gathering gathers each marked block's parameters when it runs: mark them "
                       f"first (ft.remat(model.blocks), or ft.remat(model.blocks, 'everything_saveable') to "
                       f"keep their activations)")
    return blocks


class _Piece(NamedTuple):
    owner: int  # a block's index, REST, or None (the padding)
    length: int  # how many of its elements this rank holds
    at: int  # where those sit in the owner's concatenated runs


class _Owner(NamedTuple):
    length: int  # the owner's elements of one dtype (its runs, end to end)
    pieces: tuple  # indices into the dtype's split
    leaves: tuple  # (leaf index, offset in the owner's runs)


class BlockPlan:
    """Which block owns each parameter, and how this rank's shard splits into each owner's pieces (host
    values, computed once per layout and set of marked blocks)."""

    def __init__(self, layout: FlatLayout, model: torch.nn.Module):
        index = layout.index
        if index is None:
            raise BadValue("data_parallel(blocks=...): the params must be a {name: tensor} dict (what "
                           "ft.functionalize gives) to find each block's parameters by name")
        self.layout = layout
        blocks = marked_blocks(model)
        qual = {id(m): name for name, m in model.named_modules(remove_duplicate=False)}
        prefixes = [qual[id(b)] + "." if qual[id(b)] else "" for b in blocks]
        names = list(index)
        owner_of: dict[str, int] = {}
        for name in names:
            owner_of[name] = next((i for i, p in enumerate(prefixes) if name.startswith(p)), REST)
        self.blocks = {id(b): i for i, b in enumerate(blocks)}
        self.local = [{} for _ in blocks]  # per block: leaf index -> its name in the block
        for i, (b, p) in enumerate(zip(blocks, prefixes)):
            for local, _ in b.named_parameters():
                if p + local in index:
                    self.local[i][index[p + local]] = local
            if not self.local[i] and any(True for _ in b.parameters()):
                raise BadValue(f"data_parallel(blocks=...): the marked block {prefixes[i][:-1] or '(the model)'} "
                               f"({type(b).__name__}) has none of its parameters among the step's params (e.g. "
                               f"{next(iter(names))!r}): blocks= must be the module given to ft.functionalize")
        # a parameter tied across owners would be gathered by one and read by another: refuse it
        tied: dict[int, set] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            tied.setdefault(id(p), set()).add(next((i for i, q in enumerate(prefixes) if name.startswith(q)), REST))
        shared = [o for o in tied.values() if len(o) > 1]
        if shared:
            raise BadValue("data_parallel(blocks=...): a parameter is shared between two marked blocks or between "
                           "a block and the rest of the model; per-block gathering needs each block's parameters "
                           "to be its own (unmark the blocks that share it)")
        # per dtype: the runs of each owner, this rank's pieces in buffer order, each owner's pieces
        self.owner_of = [owner_of[n] for n in names]
        self.split: dict[str, list[int]] = {}
        self.owners: dict[str, dict[int, _Owner]] = {}
        self._pieces: dict[str, list[_Piece]] = {}
        for k in layout.keys:
            runs: list[list[int]] = []  # [owner, start, end] in buffer order, adjacent leaves of one owner merged
            mine = [(idx, off, n) for idx, (key, _, n, off) in enumerate(layout.entries) if key == k]
            for idx, off, n in mine:
                o = self.owner_of[idx]
                if runs and runs[-1][0] == o and runs[-1][2] == off:
                    runs[-1][2] = off + n
                else:
                    runs.append([o, off, off + n])
            base: dict[int, int] = {}  # owner -> its elements in the runs before this one
            run_at = []  # per run: where it starts in its owner's concatenation
            for o, a, b in runs:
                run_at.append(base.get(o, 0))
                base[o] = base.get(o, 0) + b - a
            leaves: dict[int, list] = {}
            r = 0
            for idx, off, n in mine:
                if n == 0:  # an empty parameter: an empty view of its owner's runs
                    leaves.setdefault(self.owner_of[idx], []).append((idx, 0))
                    continue
                while not runs[r][1] <= off < runs[r][2]:
                    r += 1
                leaves.setdefault(runs[r][0], []).append((idx, run_at[r] + off - runs[r][1]))
            lo, hi = layout.span(k)
            pieces: list[_Piece] = []
            for (o, a, b), at in zip(runs, run_at):
                x, y = max(a, lo), min(b, hi)
                pieces.append(_Piece(o, max(0, y - x), at + max(0, min(x, b) - a)))
            pad = hi - max(lo, layout.numel[k])
            if pad > 0:
                pieces.append(_Piece(None, min(pad, hi - lo), 0))
            self.split[k] = [p.length for p in pieces]
            self.owners[k] = {o: _Owner(base[o], tuple(i for i, p in enumerate(pieces) if p.owner == o),
                                        tuple(leaves.get(o, ()))) for o in base}
            self._pieces[k] = pieces

    def pieces(self, k: str) -> list[_Piece]:
        """This rank's pieces of buffer ``k``, in buffer order: each one owner's elements of one run (``split[k]``
        are their lengths)."""
        return self._pieces[k]


class _GatherSpec(NamedTuple):
    length: int
    places: tuple  # (position in the owner's runs, length) of each piece
    group: Any
    world: int


def _all_reduce(x: torch.Tensor, group: Any) -> torch.Tensor:
    """``x`` summed over the ranks: the functional collective's ops themselves, in the graph when traced."""
    ops = torch.ops._c10d_functional
    with torch.no_grad():  # (the op's autograd formula is a torch.library one that torch.func refuses; the
        # gather's own backward is this sum, and nothing differentiates it twice)
        return ops.wait_tensor(ops.all_reduce(x.detach(), "sum", group.group_name))


def _issue(spec: _GatherSpec, pieces: tuple) -> torch.Tensor:
    """Start the gather of an owner's runs: this rank's pieces laid into ``-0.0``, summed over the ranks (the
    all-reduce is issued, not waited for: :func:`_wait`). On one process the concatenation itself."""
    like = pieces[0]
    parts, at = [], 0
    for (pos, n), piece in zip(spec.places, pieces):
        if pos > at:
            parts.append(torch.full((pos - at,), -0.0, dtype=like.dtype, device=like.device))
        parts.append(piece)
        at = pos + n
    if spec.length > at:
        parts.append(torch.full((spec.length - at,), -0.0, dtype=like.dtype, device=like.device))
    buf = parts[0].clone() if len(parts) == 1 else torch.cat(parts)
    if spec.world == 1:
        return buf
    with torch.no_grad():
        return torch.ops._c10d_functional.all_reduce(buf.detach(), "sum", spec.group.group_name)


def _wait(spec: _GatherSpec, pending: torch.Tensor) -> torch.Tensor:
    return torch.ops._c10d_functional.wait_tensor(pending) if spec.world > 1 else pending


class _Gather(torch.autograd.Function):
    """An owner's runs of one buffer, whole, from every rank's pieces; its gradient: the sum over the ranks
    of the whole runs' gradient, cut to this rank's pieces (one functional all-reduce each way)."""

    @staticmethod
    def forward(spec: _GatherSpec, pending: torch.Tensor | None,  # type: ignore[override]
                *pieces: torch.Tensor) -> torch.Tensor:
        # pending: this gather, already issued (prefetched) from the same pieces
        return _wait(spec, pending if pending is not None else _issue(spec, pieces))

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        ctx.spec = inputs[0]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:  # type: ignore[override]
        spec: _GatherSpec = ctx.spec
        if spec.world > 1:
            grad = _all_reduce(grad.contiguous(), spec.group)
        return (None, None, *[grad[pos:pos + n] for pos, n in spec.places])


class BlockLender(Lender):
    """One call's lender: this rank's pieces of the shard, the parameters outside the blocks gathered, and each
    block's gathered when it runs (see the module docstring)."""

    def __init__(self, plan: BlockPlan, shards: dict, group: Any, world: int):
        self.plan, self.group, self.world = plan, group, world
        self.split = {k: shards[k].split(plan.split[k]) for k in plan.layout.keys}
        self.lent = 0
        self._pending: dict[tuple, dict] = {}  # (phase, block) -> its prefetched gathers, issued, not waited for
        self._ran: set[int] = set()  # the blocks whose forward ran (the backward prefetches only those)

    def _inputs(self, owner: int) -> tuple[list, tuple]:
        keys, inputs = [], []
        for k in self.plan.layout.keys:
            o = self.plan.owners[k].get(owner)
            if o is not None:
                keys.append(k)
                inputs.extend(self.split[k][i] for i in o.pieces)
        return keys, tuple(inputs)

    def _spec(self, k: str, owner: int) -> _GatherSpec:
        o = self.plan.owners[k][owner]
        places = tuple((self.plan.pieces(k)[j].at, self.plan.pieces(k)[j].length) for j in o.pieces)
        return _GatherSpec(o.length, places, self.group, self.world)

    def _make(self, owner: int, keys: list, inputs: tuple, pending: dict | None = None) -> dict[int, torch.Tensor]:
        """Leaf index -> the gathered parameter, for ``owner``'s leaves, from its pieces ``inputs`` (differentiable:
        the gradient of the pieces is the sum over the ranks), its gather already issued if ``pending`` holds it
        (:meth:`prefetch`)."""
        layout, out, i = self.plan.layout, {}, 0
        for k in keys:
            o = self.plan.owners[k][owner]
            pieces = inputs[i:i + len(o.pieces)]
            i += len(o.pieces)
            spec = self._spec(k, owner)
            whole = _Gather.apply(spec, pending[k] if pending is not None else None, *pieces)
            for idx, at in o.leaves:
                _, shape, n, _ = layout.entries[idx]
                out[idx] = whole[at:at + n].view(shape)
        return out

    def prefetch(self, phase: str, block: int, after: torch.Tensor | None) -> None:
        """Issue the gather of ``block``'s parameters now (tied to ``after``, so no sooner than it exists), so that
        it runs while the block next to it computes: in the ``"forward"`` the next block, in the ``"backward"``
        the one before; that block's call of the same phase waits for it."""
        if not 0 <= block < len(self.plan.local) or (phase, block) in self._pending or self.world == 1:
            return
        keys, inputs = self._inputs(block)
        if after is not None:
            inputs = tuple(tie(x, after) for x in inputs)
        pending, i = {}, 0
        for k in keys:
            n = len(self.plan.owners[k][block].pieces)
            pending[k] = _issue(self._spec(k, block), inputs[i:i + n])
            i += n
        self._pending[phase, block] = pending

    def drain(self, phase: str) -> None:
        """Wait for the gathers of ``phase`` prefetched for blocks that did not run (every rank issued them)."""
        for (p, block), pending in list(self._pending.items()):
            if p == phase:
                del self._pending[p, block]
                for k, t in pending.items():
                    _wait(self._spec(k, block), t)

    def params(self) -> dict[str, torch.Tensor]:
        """The params dict for the loss: the parameters outside the blocks gathered, the blocks' placeholders
        (meta tensors: a block's parameters exist only inside it; reading one elsewhere fails loudly)."""
        layout = self.plan.layout
        keys, inputs = self._inputs(REST)
        rest = self._make(REST, keys, inputs) if keys else {}
        leaves = [rest[idx] if idx in rest else torch.empty(shape, dtype=layout.dtypes[k], device="meta")
                  for idx, (k, shape, _, _) in enumerate(layout.entries)]
        return layout.unflatten(leaves)

    def lend(self, module: torch.nn.Module) -> Lent | None:
        b = self.plan.blocks.get(id(module))
        if b is None:
            return None
        self.lent += 1
        keys, inputs = self._inputs(b)
        local = self.plan.local[b]
        # the block's parameters as the loss chain left them (placeholders, cast by mixed precision): each
        # gathered parameter takes its dtype, as the whole parameter would have been cast
        dtypes = {name: p.dtype for name, p in module.named_parameters()}

        calls = []

        def params(xs: tuple) -> dict[str, torch.Tensor]:
            # the first call is the block's forward (no gradient: the Function's forward), the second its
            # recomputation in the backward (differentiable); each takes the gather prefetched while the block
            # next to it ran, and prefetches the one after it in its phase
            calls.append(None)
            phase = "forward" if len(calls) == 1 and not torch.is_grad_enabled() else "backward"
            pending = self._pending.pop((phase, b), None)
            made = {local[idx]: t for idx, t in self._make(b, keys, xs, pending).items()}
            after = next((x for x in xs if x.numel()), None)
            if phase == "forward":
                self._ran.add(b)
                self.prefetch(phase, b + 1, after)
            elif b - 1 in self._ran:
                self.prefetch(phase, b - 1, after)
            return {k: t if t.dtype == dtypes.get(k, t.dtype) else t.to(dtypes[k]) for k, t in made.items()}

        return Lent(inputs, params)


