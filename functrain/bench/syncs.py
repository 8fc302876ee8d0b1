"""Count device-to-host synchronisations with a ``TorchDispatchMode`` (what :func:`functrain.bench.benchmark`
reports per step; ``bench/steps.py`` uses it too).

``.item()``, ``float(t)``, ``int(t)`` and ``bool(t)`` (and so ``if t:``) all end
in ``aten._local_scalar_dense``, which copies a scalar to the host and, on an
accelerator, waits for the device. A few other ops need a value on the host to
know their output's shape or result and sync the same way on CUDA. The mode
sees every aten op that reaches the dispatcher's Python key, including the ops
of the backward pass and of ``torch.func`` transforms, so it counts the syncs a
step makes wherever they come from (GradScaler.step does one ``.item()``).

Composite ops (``is_nonzero``, ``item``) decompose before they reach the mode,
so their syncs show up as ``_local_scalar_dense``; they are listed for the
backends where they do not.

On a CPU run every tensor is a host tensor, so the counter is told which
device the step would run on and which tensors stay on the host even then:
``torch.optim`` keeps its ``state["step"]`` counters on the CPU (unless
``capturable``/``fused``) and reads them with ``.item()`` every step; those reads
cost no device sync and are counted apart, as *host reads*.

Example::

    with SyncCounter(host=[opt.state[p]["step"] for p in params]) as c:
        train_one_step()
    c.total, c.by_op, c.host_reads      # 1, {"_local_scalar_dense": 1}, 6

As a doctest::

    >>> import torch
    >>> from functrain.bench.syncs import SyncCounter
    >>> x = torch.ones(3)
    >>> with SyncCounter() as c:
    ...     _ = float(x.sum())
    >>> c.total, c.by_op
    (1, {'_local_scalar_dense': 1})
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["SyncCounter", "SYNC_OPS"]

# aten op names (overload packets) whose result needs data from the device on the host
SYNC_OPS = frozenset({
    "_local_scalar_dense",   # .item(), float(), int(), bool(), if tensor:
    "is_nonzero",            # bool(t) where not decomposed
    "item",
    "equal",                 # torch.equal returns a Python bool
    "allclose",
    "nonzero",               # output shape depends on the data
    "masked_select",
    "_unique2",
    "unique_dim",
    "unique_consecutive",
    "repeat_interleave",     # without output_size
})


class SyncCounter(TorchDispatchMode):
    """Counts calls to the ops in :data:`SYNC_OPS` (and every op, in ``ops``) while active."""

    def __init__(self, host=()) -> None:
        super().__init__()
        self.host = {t.data_ptr() for t in host}
        self.by_op: dict[str, int] = {}
        self.host_reads = 0
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        name = func.overloadpacket.__name__
        if name in SYNC_OPS:
            arg = args[0] if args else None
            if torch.is_tensor(arg) and arg.data_ptr() in self.host:
                self.host_reads += 1
            else:
                self.by_op[name] = self.by_op.get(name, 0) + 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.by_op.values())

    def describe(self) -> str:
        parts = ", ".join(f"{k} x{v}" for k, v in sorted(self.by_op.items()))
        text = f"{self.total} ({parts})" if parts else "0"
        if self.host_reads:
            text += f" + {self.host_reads} host reads"
        return text
