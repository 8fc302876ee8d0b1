"""``ft.compile``: the whole step compiled as one graph, split by phase.

:mod:`.api` is the entry (:func:`compile`, :class:`CompiledStep`); :mod:`.options` checks the
choices once (one table of what combines); :mod:`.capture` traces the step over flat leaves;
:mod:`.backend` compiles a capture (inductor by default) and holds the Dynamo path;
:mod:`.runtime` holds the runners (:class:`Runner`: the per-call direct path; :class:`DynamoRunner`) and the
graphs they share; :mod:`.progress` is a runner's :class:`Progress` and rate meter; :mod:`.background` the
component a runner asks while a graph compiles off its thread (one record per signature), with :mod:`.budget` (the
run's compile budget, the one caller of the compile policy) and :mod:`.jobs` (the worker pool and the jobs); :mod:`.memory` is where the new state lives
(fresh, recycled buffers, donation); :mod:`.cudagraph` replays a donated step as a CUDA
graph; :mod:`.cache` and :mod:`.package` keep compiled code between processes;
:mod:`.errors` explains a failed capture or compile, at the model's line; :mod:`.estimate` is
``ft.memory`` (what a step holds and allocates, from its capture, before it runs).
"""
from .api import CompiledStep, GraphBreakError, compile
from .errors import BackendError
from .estimate import MemoryEstimate, memory
from .progress import PhaseRates, Progress
from .dynamo_runner import DynamoRunner
from .runtime import Runner

__all__ = ["compile", "CompiledStep", "GraphBreakError", "BackendError", "memory", "MemoryEstimate", "Runner", "DynamoRunner",
           "Progress", "PhaseRates"]
