"""``ft.compile``: the whole step compiled as one graph, split by phase.

:mod:`.api` is the entry (:func:`compile`, :class:`CompiledStep`); :mod:`.options` checks the
choices once (one table of what combines); :mod:`.capture` traces the step over flat leaves;
:mod:`.backend` compiles a capture (inductor by default) and holds the Dynamo path;
:mod:`.runtime` is the per-call direct path; :mod:`.memory` is where the new state lives
(fresh, recycled buffers, donation); :mod:`.cudagraph` replays a donated step as a CUDA
graph; :mod:`.cache` and :mod:`.package` keep compiled code between processes;
:mod:`.errors` explains a failed capture; :mod:`.estimate` is ``ft.memory`` (what a step holds and
allocates, from its capture, before it runs).
"""
from .api import CompiledStep, GraphBreakError, compile
from .estimate import MemoryEstimate, memory

__all__ = ["compile", "CompiledStep", "GraphBreakError", "memory", "MemoryEstimate"]
