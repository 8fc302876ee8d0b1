"""Where a compiled step's new state lives: fresh memory, recycled buffers, or the donated input state.

One :class:`Memory` per capture decides it, in the two places that matter: inside the
traced graph (:meth:`Memory.in_graph`: what the graph writes and returns) and after each
call (:meth:`Memory.call`: how the outputs become the new state). The three kinds:

* ``"fresh"`` (the pure call): the graph returns the new state, except that each large
  CPU leaf (:data:`RECYCLE_BYTES` and up) is written into a *recycled buffer*, an extra
  trailing graph input (``copy_``, fused by inductor into the kernel computing it). On CPU
  a large block is fresh pages from the kernel and every first write faults (~0.7k faults
  per step on a 1.3M-parameter MLP with Adam, ~20% of its step time). Each capture keeps
  two buffer sets, and a set is reused only when every buffer's storage is held by nobody
  but the pool (the caller dropped that state and every view of it): a loop
  ``state, m = cstep(state, b)`` alternates between them, and a state the caller keeps is
  never written. The price: up to two sets of those leaves stay alive while the compiled
  step lives. Other devices have caching allocators: nothing is recycled there.
* ``"donate"`` (``donate=True``): the graph writes the new state into the input state's
  tensors (:func:`write_inputs`) and returns only the metrics; the call then moves every
  storage to new tensor objects and empties the old ones (:func:`release`), so using the
  donated state again raises.
* ``"owned"`` (:meth:`functrain.CompiledStep.donating`, what ``ft.run`` uses): the same
  in-place graph, but the caller holds no other reference to the state, so the new state
  keeps the very tensor objects; only the step counter moves to a new object and the old
  one is emptied, so the old state cannot be stepped again.

The Dynamo path (:mod:`functrain.compiler.backend`) donates with the same two functions.
"""
from __future__ import annotations

from typing import Any

import optree
import torch

__all__ = ["Memory", "Written", "write_inputs", "release", "RECYCLE_BYTES", "KINDS"]

KINDS = ("fresh", "donate", "owned")
RECYCLE_BYTES = 1 << 17  # glibc serves blocks from 128 KiB up with fresh pages: a page fault per 4 KiB
_use_count = getattr(torch._C, "_storage_Use_Count", None)


class Written:
    """Marks an output leaf the graph wrote into recycled buffer ``j`` (not a graph output)."""

    __slots__ = ("j",)

    def __init__(self, j: int):
        self.j = j


def write_inputs(old_leaves: list, new_leaves: list) -> None:
    """Donation inside a graph: write each new state leaf into the input leaf it replaces (inductor turns the
    ``copy_`` into the kernel writing its result there). Both must be tensors of one shape, dtype and device."""
    if len(old_leaves) != len(new_leaves):
        raise ValueError(f"donate=True needs the step to return a state of the input's structure; "
                         f"got {len(new_leaves)} leaves for {len(old_leaves)}")
    for old, value in zip(old_leaves, new_leaves):
        if not (torch.is_tensor(old) and torch.is_tensor(value)) or old.shape != value.shape \
                or old.dtype != value.dtype or old.device != value.device:
            raise ValueError("donate=True needs every state leaf to keep its shape, dtype and device; "
                             f"got {_describe(value)} for {_describe(old)}")
        if value is not old:
            old.copy_(value)


def release(old_leaves: list) -> list:
    """After a donating call: the new state's leaves as new tensor objects on the donated storage; the old
    tensors are emptied, so a step on the old state raises."""
    new = [x.detach() if torch.is_tensor(x) else x for x in old_leaves]
    for x in old_leaves:
        if torch.is_tensor(x):
            x.set_()
    return new


class Memory:
    """The memory policy of one capture: ``kind`` (one of :data:`KINDS`) and, for ``"fresh"``, which
    of the state's tensors go to recycled buffers.

    Attributes:
        kind: ``"fresh"``, ``"donate"`` or ``"owned"``.
        recycle: positions among the state's tensors offered a recycled buffer.
        recycled: the buffers the traced graph actually writes (set by :meth:`in_graph`).
        pool: the buffer sets (at most two).
    """

    def __init__(self, kind: str, state_tensors: list):
        self.kind = kind
        self.donates = kind != "fresh"
        self.recycle = _recyclable(state_tensors) if kind == "fresh" else ()
        self.recycled: tuple = ()
        self.pool: list[list[torch.Tensor]] = []
        self._metas = [_meta(state_tensors[k]) for k in self.recycle]

    # -- at capture --------------------------------------------------------------------------------
    def example_buffers(self) -> list:
        """Example inputs for the recycled buffers (appended after the state and batch tensors)."""
        return [_empty(m) for m in self._metas]

    def in_graph(self, state: Any, new: Any, metrics: Any, inputs: list, buffers: list) -> Any:
        """Inside the traced graph: write the new state where this policy puts it; returns the tree of what the
        graph gives back (``(new state, metrics)`` with :class:`Written` marks, or the metrics alone)."""
        if self.donates:
            old_leaves, state_spec = optree.tree_flatten(state)
            new_leaves, new_spec = optree.tree_flatten(new)
            if new_spec != state_spec:
                raise ValueError(f"donate=True needs the step to return a state of the input's structure; "
                                 f"got {new_spec} for {state_spec}")
            write_inputs(old_leaves, new_leaves)
            # a metric that is an input tensor would alias a buffer the graph overwrites: copy it
            ids = {id(t) for t in inputs}
            return optree.tree_map(lambda m: m.clone() if torch.is_tensor(m) and id(m) in ids else m, metrics)
        if buffers:
            new = self._write_buffers(state, new, inputs, buffers)
        return new, metrics

    def _write_buffers(self, state: Any, new: Any, inputs: list, buffers: list) -> Any:
        new_leaves, new_spec = optree.tree_flatten(new)
        used = []
        if new_spec == optree.tree_structure(state):
            tensor_idx = [i for i, x in enumerate(new_leaves) if torch.is_tensor(x)]
            for j, (k, buf) in enumerate(zip(self.recycle, buffers)):
                if k >= len(tensor_idx):
                    continue
                i = tensor_idx[k]
                value = new_leaves[i]
                if value is inputs[k] or value.shape != buf.shape or value.dtype != buf.dtype \
                        or value.device != buf.device:
                    continue  # an unchanged leaf is returned as it is; another shape cannot go there
                buf.copy_(value)
                new_leaves[i] = Written(j)
                used.append(j)
        self.recycled = tuple(used)
        return optree.tree_unflatten(new_spec, new_leaves)

    # -- per call ----------------------------------------------------------------------------------
    def call(self, cap: Any, tensors: list, leaves: list) -> tuple[Any, dict, list]:
        """Run ``cap``'s compiled code on ``tensors`` (the state's and the batch's); returns the new state
        (``rng=None``), the metrics and the new state's tensors."""
        buffers = self._free_buffers() if self.recycle else ()
        out = cap.fn(*tensors, *buffers, *cap.constants)
        n = cap.signature.n_state
        if not self.donates:
            # a recycled buffer goes out as a new tensor object on its storage: the pool's own reference stays
            # apart, so the storage's use count tells when the caller dropped it
            out = cap.outputs(list(out), [b.detach() for b in buffers])
            new, metrics = optree.tree_unflatten(cap.out_spec, out)
            new_tensors = out[:n] if cap.trivial_out else [x for x in optree.tree_leaves(new) if torch.is_tensor(x)]
            return new, metrics, new_tensors
        metrics = optree.tree_unflatten(cap.out_spec, cap.outputs(list(out)))
        if self.kind == "owned" and cap.step_index is not None:
            # the new state keeps the tensors the graph wrote into; only the step counter is re-homed (one
            # object), and the old one emptied, so the old state cannot be stepped again
            new_tensors = tensors[:n]
            old_step = new_tensors[cap.step_index]
            new_tensors[cap.step_index] = old_step.detach()
            old_step.set_()
            new_leaves = list(leaves[:cap.n_state])
            new_leaves[cap.signature.tensor_pos[cap.step_index]] = new_tensors[cap.step_index]
            return optree.tree_unflatten(cap.state_spec, new_leaves), metrics, new_tensors
        new = release(leaves[:cap.n_state])
        return optree.tree_unflatten(cap.state_spec, new), metrics, [x for x in new if torch.is_tensor(x)]

    def _free_buffers(self) -> list:
        """A buffer set from an earlier call whose every storage nobody else holds any more (the caller dropped
        that state and all views of it), or a new set. At most two are kept: the state passed in (in use) and
        the one before it (free once the caller rebinds its variable)."""
        for bufs in self.pool:
            # 2 = the pool's tensor + the temporary storage object of the query; anything more is a holder
            if all(_use_count(b.untyped_storage()._cdata) == 2 for b in bufs):
                return bufs
        bufs = [_empty(m) for m in self._metas]
        self.pool.insert(0, bufs)
        del self.pool[2:]
        return bufs


def _recyclable(state_tensors: list) -> tuple:
    if _use_count is None:  # pragma: no cover - a torch without the use-count query: no recycling
        return ()
    return tuple(k for k, t in enumerate(state_tensors)
                 if t.device.type == "cpu" and t.numel() * t.element_size() >= RECYCLE_BYTES)


def _meta(x: torch.Tensor) -> tuple:
    return (x.shape, x.stride(), x.dtype, x.device)


def _empty(meta: tuple) -> torch.Tensor:
    shape, stride, dtype, device = meta
    return torch.empty_strided(shape, stride, dtype=dtype, device=device)


def _describe(x: Any) -> str:
    if torch.is_tensor(x):
        return f"a {x.dtype} tensor of shape {tuple(x.shape)} on {x.device}"
    return type(x).__name__
