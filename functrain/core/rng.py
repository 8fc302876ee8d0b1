"""The RNG hand-over: each step draws its random numbers from ``state.rng``, on the host, without a sync.

``state.rng`` is ``{"key": int64 host tensor [seed, counter]}`` (or ``None``: the
step then uses torch's global generators as they are). :func:`with_rng` runs one
step the way a pure function of the state needs:

1. hash ``[seed, counter]`` into a step seed (splitmix64, twice);
2. seed the global generators of the state's devices with ``step seed + offset``
   (the offset is a transform's :meth:`~functrain.Transform.rng_offset`: the
   process's rank under data parallelism, so ranks draw different dropout masks
   while the key, and so every checkpoint, stays replicated);
3. run the step, restore the caller's generators, return the state with the
   counter advanced.

Example::

    >>> import torch
    >>> from functrain.core.rng import rng_init, with_rng
    >>> state_rng = rng_init(0, torch.device("cpu"))
    >>> state_rng["key"].tolist()
    [0, 0]
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch

from .validate import BadValue, check_int
from .checks import rng_ok, rng_problem

__all__ = ["rng_init", "with_rng"]


def rng_init(seed: int, device: torch.device) -> dict:
    """The initial ``state.rng`` for ``seed`` (an int in ``[0, 2**63)``): ``{"key": tensor([seed, 0])}``.

    The key is a host tensor whatever ``device`` is: it is read on the host every
    step, and a device tensor would make that read a sync.
    """
    check_int("seed", seed, minimum=0, maximum=2**63 - 1, what="an int in [0, 2**63) or None")
    return {"key": torch.tensor([int(seed), 0], dtype=torch.int64)}


def _mix64(x: int) -> int:
    """splitmix64: a well-mixed 64-bit value from a counter."""
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


def step_seed(seed: int, counter: int) -> int:
    """The seed of the step at ``counter`` of the stream ``seed`` (< 2**62, so ``+ offset`` stays valid)."""
    return _mix64(_mix64(seed) ^ counter) >> 2


def _devices(state: Any) -> list[str]:
    device = state.step.device
    return ["cpu"] if device.type != "cuda" else ["cpu", str(device)]


def _get_rng(dev: str) -> torch.Tensor:
    return torch.get_rng_state() if dev == "cpu" else torch.cuda.get_rng_state(dev)


def _set_rng(dev: str, value: torch.Tensor) -> None:
    if dev == "cpu":
        torch.set_rng_state(value)
    else:
        torch.cuda.set_rng_state(value, dev)


def _seed_globals(devices: list[str], seed: int) -> None:
    for dev in devices:
        if dev == "cpu":
            torch.default_generator.manual_seed(seed)
        else:
            torch.cuda.default_generators[torch.device(dev).index or 0].manual_seed(seed)


def with_rng(fn: Callable, state: Any, batch: Any, rank: int = 0) -> tuple[Any, dict]:
    """Run ``fn(state, batch)`` drawing random numbers from ``state.rng`` (host side).

    ``state.rng["key"]`` is a host int64 tensor ``[seed, counter]``, the same on
    every process. Each step hashes it into a step seed (splitmix64), advances
    the counter (into the new state), seeds the global generators with
    ``step seed + rank`` (``rank`` is the step's RNG offset: data-parallel ranks
    draw different dropout masks, yet the state stays replicated and a checkpoint
    holds everything), runs, and restores the caller's generators. All of it is
    host work on host memory: no device sync, no torch op that reads a value.

    Example::

        >>> import torch, functrain as ft
        >>> from functrain.core.rng import with_rng
        >>> drop = lambda p, b, x: (p["w"] * torch.nn.functional.dropout(x, 0.5)).sum()
        >>> step = ft.train_step(drop, ft.optim.sgd(0.1))
        >>> state = step.init({"w": torch.ones(4)}, seed=0)
        >>> new, _ = with_rng(step.apply, state, torch.ones(4))
        >>> new.rng["key"].tolist()
        [0, 1]
    """
    rng = state.rng
    if rng is None:
        return fn(state, batch)
    if not rng_ok(rng):
        raise BadValue(f"the state does not match this step: {rng_problem(rng)}")
    seed, counter = rng["key"].tolist()  # a host tensor: read without a torch op (and so no sync)
    seed_now = step_seed(seed, counter)
    if not state.step.is_cuda:  # the common case, one generator: the general loop below, unrolled
        cpu = torch.default_generator
        saved_cpu = cpu.get_state()
        try:
            cpu.manual_seed(seed_now + rank)
            new_state, metrics = fn(state._replace(rng=None), batch)
        finally:
            cpu.set_state(saved_cpu)
    else:
        devices = _devices(state)
        saved = {dev: _get_rng(dev) for dev in devices}
        try:
            _seed_globals(devices, seed_now + rank)
            new_state, metrics = fn(state._replace(rng=None), batch)
        finally:
            for dev, value in saved.items():
                _set_rng(dev, value)
    # (from numpy: half the cost of torch.tensor([...]) for a two-element host tensor)
    key = torch.from_numpy(np.array((seed, counter + 1), dtype=np.int64))
    return new_state._replace(rng={"key": key}), metrics
