"""``ft.compile``: the whole step compiled as one graph (see docs/compiling.md).

:mod:`.api` is the entry (:func:`compile`, :class:`CompiledStep`); :mod:`.capture` traces the
step once over flat leaves and calls the compiled code directly; :mod:`.cache` and
:mod:`.package` keep compiled code between processes; :mod:`.cudagraph` and :mod:`.recycle`
are the memory-side modes.
"""
from .api import CompiledStep, GraphBreakError, compile

__all__ = ["compile", "CompiledStep", "GraphBreakError"]
