"""The fastest runner per call: a background compile's JIT code against the package built in the same run.

A step compiled in the background runs inductor's JIT code (its wrapper behind AOTAutograd's runtime wrapper).
With ``package=True`` (the Trainer's default) a second worker then builds the same graph's AOTInductor package
for the next run (:mod:`functrain.compiler.later`), called through torch's C++ loader. Which of the two runs a
call faster depends on the graph (on this project's CPU benchmarks the package took 0.77-0.87x of the JIT code's
time on a small MLP, bitwise equal), so the run measures it once the package is there and keeps the faster.

Every process of the run follows the same protocol at the same calls (the runner carries it out:
:meth:`functrain.compiler.runtime.Runner`; this module holds the race's state and its rules):

1. **Waiting.** Every :data:`POLL_EVERY` compiled calls each process looks for the package (:meth:`Race.look`):
   its warm entry written (``READY``), its build ended without one (``GONE``: a refusal, a failed or killed
   worker), or neither (``WAIT``). The processes agree on the least (``Step.agree``, one host collective per
   :data:`POLL_EVERY` calls): all go on at once, or none.
2. **Checked.** Every process loads the package (all, or none) and its first call is checked against the eager
   step on the same inputs, as a warm start's is (:func:`functrain.compiler.warm.disagreement`); a mismatch
   drops the entry with a warning naming the leaf, and the JIT code goes on.
3. **Timed.** :data:`ROUNDS` rounds of two calls, one on each runner, the order alternating from round to round,
   each call timed on the host (a CPU graph: the call returns when its work is done). Every call trains: the
   state goes from one runner to the other.
4. **Decided.** The median over the rounds of the package's time over the JIT code's (:func:`paired_ratio`); the
   processes agree on the largest (each must gain); the package replaces the JIT code when it is at most
   ``1 - MARGIN`` (:func:`chooses_package`), else it is let go. ``Progress.runner`` and ``runner_ratio`` say
   which runs and why.

Only CPU graphs race (a GPU call returns before its kernels finish: timing it would need a device sync per call);
a step whose code was loaded from a package before any trace (a warm start) or compiled as a package (a
blocking ``package=True`` compile) has one runner and nothing to race.

Example::

    >>> from functrain.compiler.race import paired_ratio, chooses_package
    >>> round(paired_ratio([100e-6, 90e-6, 88e-6, 101e-6]), 4)   # (JIT, package), then (package, JIT)
    0.8856
    >>> chooses_package(0.886), chooses_package(0.99)
    (True, False)
"""
from __future__ import annotations

import os
import statistics
from typing import Any

__all__ = ["Race", "paired_ratio", "chooses_package", "POLL_EVERY", "ROUNDS", "MARGIN", "WAIT", "GONE", "READY"]

POLL_EVERY = 64  # compiled calls between two looks for the package
ROUNDS = 32  # timed rounds (two calls each)
MARGIN = 0.02  # the package must take at most 1 - MARGIN of the JIT code's time per call
GONE, WAIT, READY = 0, 1, 2  # a look's outcome; the processes agree on the least


def paired_ratio(times: list[float]) -> float:
    """The median over rounds of the package's call time over the JIT code's, from ``times`` in call order:
    round ``r`` is ``times[2r], times[2r + 1]``, the JIT code first in even rounds, the package first in odd ones."""
    if len(times) < 2:
        raise ValueError(f"paired_ratio needs at least one round (two call times), got {len(times)}")
    ratios = []
    for r in range(len(times) // 2):
        first, second = times[2 * r], times[2 * r + 1]
        jit, package = (first, second) if r % 2 == 0 else (second, first)
        ratios.append(package / jit if jit > 0 else float("inf"))
    return statistics.median(ratios)


def chooses_package(ratio: float) -> bool:
    """Whether a package whose time per call is ``ratio`` of the JIT code's replaces it (at most ``1 - MARGIN``)."""
    return ratio <= 1.0 - MARGIN


class Race:
    """One signature's race between its JIT capture ``jit`` and the package built for the next run under
    ``prekey`` (see the module docstring); ``files``: the package's warm entry and its refusal
    (:meth:`~functrain.compiler.warm.WarmStarts.path`, :meth:`~functrain.compiler.warm.WarmStarts.refusal`).

    Attributes:
        key: the signature key the JIT capture serves; ``package``: the loaded package's capture once checked
            (``None`` while waiting); ``times``: the timed calls' seconds, in call order.
    """

    __slots__ = ("key", "prekey", "jit", "files", "package", "calls", "times")

    def __init__(self, key: Any, prekey: str, jit: Any, files: tuple[str, str]):
        self.key, self.prekey, self.jit, self.files = key, prekey, jit, files
        self.package: Any = None
        self.calls = 0
        self.times: list[float] = []

    def due(self) -> bool:
        """Count a compiled call while waiting; whether this one looks for the package (every
        :data:`POLL_EVERY`-th)."""
        self.calls += 1
        return self.calls % POLL_EVERY == 0

    def look(self, build_ended: bool) -> int:
        """This process's view: ``READY`` (the entry is written), ``GONE`` (the refusal is, or ``build_ended``:
        this process's build ended without an entry), else ``WAIT``."""
        entry, refusal = self.files
        if os.path.exists(entry):
            return READY
        return GONE if build_ended or os.path.exists(refusal) else WAIT

    def start(self, package: Any) -> None:
        """The package's capture passed its check: the timed rounds begin."""
        self.package = package

    def next(self) -> Any:
        """The capture the next timed call runs (the JIT code first in even rounds, the package in odd ones)."""
        n = len(self.times)
        jit_first = (n // 2) % 2 == 0
        return self.jit if (n % 2 == 0) == jit_first else self.package

    def timed(self, seconds: float) -> bool:
        """Record the call just made (``seconds``); whether every round is done."""
        self.times.append(seconds)
        return len(self.times) >= 2 * ROUNDS

    def ratio(self) -> float:
        """The package's time per call over the JIT code's (:func:`paired_ratio` of the rounds)."""
        return paired_ratio(self.times)
