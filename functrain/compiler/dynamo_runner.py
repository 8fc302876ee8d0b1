"""The Dynamo path's runner (``ft.compile(..., fullgraph=False)`` or a step Dynamo must trace): ``torch.compile``
of the step on every call, with the same attributes as :class:`functrain.compiler.runtime.Runner` where they apply.
"""
from __future__ import annotations

import time
from typing import Any

from ..core.step import Step
from .backend import CountingBackend, DynamoCall
from .progress import PhaseRates, Progress

__all__ = ["DynamoRunner"]


class DynamoRunner:
    """The Dynamo path's runner: ``torch.compile`` of the step on every call (guards, graph breaks allowed with
    ``fullgraph=False``); its first call compiles and waits. The same attributes as :class:`Runner` where they
    apply (``progress``, ``rates``, ``pauses``, ``compiles``)."""

    background = None

    def __init__(self, step: Step, options: Any, backend: CountingBackend):
        self.step = step
        self.call = DynamoCall(step, options, backend)
        self.backend = backend
        self.progress = Progress(background=False)
        self.rates = PhaseRates()
        self.pauses = 0

    def __call__(self, state: Any, batch: Any) -> tuple[Any, dict]:
        before = self.backend.count
        t0 = time.perf_counter()
        new, metrics = self.call(state, batch)
        paused = self.backend.count != before  # (a compile, or a recompile)
        if paused:
            self.pauses += 1
            self.progress.traced = True
            if self.progress.compile_s is None:
                self.progress.compile_s, self.progress.source = time.perf_counter() - t0, "here"
        self.progress.phase = "compiled"
        self.rates.record("compiled", paused)
        return new, metrics

    def may_start_warm(self) -> bool:
        """Never: the Dynamo path has no warm starts (:meth:`Runner.may_start_warm`)."""
        return False

    def traced(self, state: Any, batch: Any) -> None:
        """``None``: the Dynamo path keeps no capture (:func:`functrain.memory` traces afresh)."""
        return None

    def kept(self, state: Any, batch: Any) -> None:
        """``None``: the Dynamo path keeps no capture."""
        return None

    def finish_after_exit(self, finish: bool = True) -> None:
        """Nothing compiles in the background on the Dynamo path."""

    def expect(self, steps: int | None) -> None:
        """Nothing compiles in the background on the Dynamo path: nothing to weigh."""

    def close(self) -> None:
        """Nothing to stop on the Dynamo path."""

    @property
    def compiles(self) -> int:
        """Graphs Dynamo's backend has built for this step (a recompile shows as an increase)."""
        return self.backend.count

    def __repr__(self) -> str:
        return f"DynamoRunner({self.step!r})"
