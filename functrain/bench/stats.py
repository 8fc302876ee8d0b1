"""Statistics over timed rounds: medians, spreads, paired ratios and their intervals, times as text.

Shared by :func:`functrain.bench.benchmark` and the project's own benchmarks (``bench/``).

Example::

    >>> from functrain.bench.stats import paired_ratios, spread
    >>> paired_ratios([2.0, 4.0, 3.0], [1.0, 2.0, 2.0])
    [2.0, 2.0, 1.5]
    >>> s = spread([1.0, 2.0, 3.0, 4.0, 5.0])
    >>> s["median"], s["min"], s["max"], s["q1"], s["q3"]
    (3.0, 1.0, 5.0, 2.0, 4.0)
"""
from __future__ import annotations

import random
import statistics
from typing import Sequence

__all__ = ["median", "bootstrap_ci", "spread", "paired_ratios", "fmt_time", "fmt_bytes"]


def median(xs: Sequence[float]) -> float:
    """The median of ``xs`` (at least one value)."""
    return statistics.median(xs)


def bootstrap_ci(xs: Sequence[float], n: int = 4000, level: float = 0.95, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of the median (rounds resampled with replacement; seeded, so repeatable)."""
    if len(xs) < 2:
        return xs[0], xs[0]
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(xs, k=len(xs))) for _ in range(n))
    lo = meds[int((1 - level) / 2 * n)]
    hi = meds[min(n - 1, int((1 + level) / 2 * n))]
    return lo, hi


def spread(xs: Sequence[float]) -> dict[str, float]:
    """``{"median", "min", "max", "q1", "q3"}`` of ``xs``: quartiles by the inclusive method (``q1 == q3 ==`` the
    value for one value)."""
    xs = list(xs)
    if not xs:
        raise ValueError("spread() needs at least one value")
    q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else (xs[0], xs[0], xs[0])
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "q1": q1, "q3": q3}


def paired_ratios(times: Sequence[float], base: Sequence[float]) -> list[float]:
    """``times[r] / base[r]`` per round ``r``: the two were timed in the same round, so drift hits both."""
    if len(times) != len(base):
        raise ValueError(f"paired_ratios: {len(times)} rounds against {len(base)}: pair the same rounds")
    return [t / b for t, b in zip(times, base)]


def fmt_time(s: float | None) -> str:
    """Seconds as ``"1.2 s"``, ``"3.45 ms"`` or ``"120 µs"`` (``"-"`` for ``None``)."""
    if s is None:
        return "-"
    if s >= 1.0:
        return f"{s:.1f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.0f} µs"


def fmt_bytes(n: int | None) -> str:
    """Bytes as ``"512 B"``, ``"4.0 KiB"``, ``"1.50 MiB"`` (``"-"`` for ``None``)."""
    if n is None:
        return "-"
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"
