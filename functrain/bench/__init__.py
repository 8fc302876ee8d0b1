"""Benchmark your own step: :func:`benchmark` (``ft.benchmark``) and ``python -m functrain.bench module:make_step``.

It times the step eager, compiled (plain calls of ``cstep.runner()``) and compiled as ``ft.run`` calls it
(``cstep.runner(donate=True)``: a graph of its own), interleaved, each warmed first, and reports medians,
spreads and paired ratios to eager, the compile by phase (cold and warm with ``cold=True``), graphs and what
changed at each recompile, host syncs per step and memory (estimated and measured): a :class:`Report`.

Modules: :mod:`.timing` (:func:`benchmark`), :mod:`.report` (:class:`Report`), :mod:`.stats` (medians, spreads,
paired ratios, bootstrap intervals), :mod:`.syncs` (:class:`SyncCounter`), :mod:`.phases` (a compile's time by
phase, from torch's records), :mod:`.recompiles` (what changed between two input signatures); ``bench/`` (the
project's own benchmarks) uses them too.
"""
from .recompiles import signature_changes
from .report import Report, VariantResult
from .syncs import SyncCounter
from .timing import VARIANTS, benchmark

__all__ = ["benchmark", "Report", "VariantResult", "VARIANTS", "SyncCounter", "signature_changes"]
