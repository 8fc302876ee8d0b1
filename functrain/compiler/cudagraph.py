"""CUDA graphs for ``ft.compile``'s fast path: ``mode="reduce-overhead"`` with a donated state.

A CUDA graph replays recorded kernels on the very addresses it was recorded with. A
donated step is the ideal case: the graph writes the new state into the input state's
buffers, so step after step the state sits at the same addresses (``donate=True``
moves the storage to new tensor objects, ``.runner(donate=True)`` keeps the objects), and the
tensors the step closes over are the same objects every call. Only the batch changes:
it is copied into buffers of the graph's own before each replay. The metrics the graph
returns live in its memory pool (overwritten by the next replay) and are cloned.

Inductor's own CUDA graphs (``torch.compile(mode="reduce-overhead")``, the Dynamo path)
take their static inputs from Dynamo's metadata, which a flat capture has not; this
module records the graph of the compiled code itself instead. A state at new addresses
(another state passed in) records a new graph (counted in :attr:`GraphedCall.records`).
"""
from __future__ import annotations

import warnings
from typing import Callable

import torch

__all__ = ["GraphedCall", "why_not"]

_WARMUP = 2
_MANY_RECORDS = 8


def why_not(tensors: list, constants: list, *, donate: bool, random: bool) -> str | None:
    """Why the compiled step cannot run as a CUDA graph (``None`` if it can)."""
    if not donate:
        return "the state is not donated (pass donate=True, or use .runner(donate=True) / ft.run)"
    if random:
        return "the step draws random numbers (their host-side seeding is not part of a CUDA graph)"
    devices = {t.device for t in list(tensors) + list(constants)}
    if not devices or any(d.type != "cuda" for d in devices):
        return f"CUDA graphs need CUDA tensors; the step's tensors are on {sorted(map(str, devices))}"
    if len(devices) > 1:
        return f"the step's tensors are on several devices ({sorted(map(str, devices))})"
    return None


class GraphedCall:
    """The compiled code ``fn(*state, *batch, *constants)`` of a donated step, replayed as a CUDA graph.

    A wrapper with ``fn``'s calling convention: ``n_state`` of its arguments are the (donated)
    state's tensors, the last ``n_constants`` the tensors the step closes over, the batch's in
    between; it returns ``fn``'s outputs (cloned out of the graph's pool).

    Attributes:
        records: how many graphs it has recorded (1 unless the state moved to new addresses).
    """

    def __init__(self, fn: Callable, n_state: int, n_constants: int):
        self.fn = fn
        self.n_state = n_state
        self.n_constants = n_constants
        self.graph: torch.cuda.CUDAGraph | None = None
        self.ptrs: tuple = ()
        self.batch: list = []   # the graph's copies of the batch tensors
        self.outputs: list = []
        self.records = 0

    def __call__(self, *args: torch.Tensor) -> list:
        split = len(args) - self.n_constants
        tensors, constants = args[:split], args[split:]
        state, batch = tensors[:self.n_state], tensors[self.n_state:]
        ptrs = tuple(t.data_ptr() for t in state) + tuple(t.data_ptr() for t in constants)
        if self.graph is None or ptrs != self.ptrs:
            self._record(state, batch, constants, ptrs)
        for mine, x in zip(self.batch, batch):
            mine.copy_(x)
        self.graph.replay()
        return [o.clone() if torch.is_tensor(o) else o for o in self.outputs]

    def _record(self, state: list, batch: list, constants: list, ptrs: tuple) -> None:
        self.graph = None  # release the previous graph (and its pool) first
        self.batch = [torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device) for x in batch]
        for mine, x in zip(self.batch, batch):
            mine.copy_(x)
        # Warm-up (lazy library handles, workspaces: not allowed while recording) on copies of the
        # state: the compiled code writes the new state into its inputs, and the real state must
        # take exactly one step per call.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            scratch = [x.clone() for x in state]
            for _ in range(_WARMUP):
                self.fn(*scratch, *self.batch, *constants)
            del scratch
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):  # records, runs nothing: the state is untouched until replay
            outputs = self.fn(*state, *self.batch, *constants)
        self.graph, self.outputs, self.ptrs = graph, list(outputs), ptrs
        self.records += 1
        if self.records == _MANY_RECORDS:
            warnings.warn(f"ft.compile(mode='reduce-overhead'): the state has moved to new addresses "
                          f"{self.records} times (each records a new CUDA graph); step one donated state "
                          f"(donate=True, or .runner(donate=True) / ft.run) instead of passing new ones", stacklevel=4)
