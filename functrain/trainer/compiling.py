"""What the Trainer reports of a background compile: ``metrics.jsonl`` fields and the summary's line.

``ft.run`` compiles the Trainer's step in the background (:mod:`functrain.compiler.background`):
the first steps run eagerly, the compiled step takes over when it is ready. The loop
(:mod:`functrain.trainer.loop`) calls these three functions from its hooks: the time of each
path is measured with :class:`functrain.driver.PhaseRates` on the very call form ``ft.run``
uses, and a log step's record says when the switch happened (``switched_at``), how long the
compile took (``compile_s``, once) and the throughput on each path so far
(``steps_per_s_eager``, ``steps_per_s_compiled``).
"""
from __future__ import annotations

from typing import Any

from ..compiler import Runner

__all__ = ["watch_compile", "compile_log", "compile_notes"]


def watch_compile(runner: Any, r: Any) -> None:
    """If ``runner`` (what ``ft.run`` runs) compiles in the background, read its rate meter and progress into
    ``r`` (the loop's ``RunState``: ``rates``, ``progress``); its first step is then no compile (``r.compiled`` is
    false)."""
    if not isinstance(runner, Runner) or runner.background is None:
        return
    r.compiled = False  # the first step runs eagerly: the background job times the compile
    r.rates = runner.rates
    r.progress = runner.progress


def compile_log(r: Any, n: int, host: dict) -> None:
    """Add a background compile's fields to log step ``n``'s record ``host``: ``compile_s`` and
    ``switched_at`` once, when known; ``steps_per_s_eager`` / ``steps_per_s_compiled`` (so far) each time.

    Example::

        >>> class R:
        ...     rates = None
        >>> host = {"loss": 1.0}
        >>> compile_log(R(), 10, host)   # not a background compile: nothing added
        >>> host
        {'loss': 1.0}
    """
    if r.rates is None:
        return
    p = r.progress
    if p.compile_s is not None and "compile_s" not in r.reported:
        host["compile_s"] = p.compile_s
        r.reported.add("compile_s")
    if r.rates.switched_at is not None and "switched_at" not in r.reported:
        host["switched_at"] = r.start + r.rates.switched_at  # (the runner counts its calls; the run, its steps)
        r.reported.add("switched_at")
    for path in ("eager", "compiled"):
        rate = r.rates.rate(path)
        if rate is not None:
            host[f"steps_per_s_{path}"] = rate


def compile_notes(r: Any) -> list[str]:
    """The summary's line about a background compile (``[]`` when there was none)."""
    if r.rates is None:
        return []
    p, rates = r.progress, r.rates
    speeds = ", ".join(f"{k} {v:.1f} steps/s" for k in ("eager", "compiled") if (v := rates.rate(k)))
    speeds = f" ({speeds})" if speeds else ""
    if p.phase == "failed":
        return [f"the background compile failed, every step ran eagerly{speeds}: {str(p.reason)[:200]}"]
    if rates.switched_at is not None:
        took = f" in {p.compile_s:.1f} s" if p.compile_s is not None else ""
        at = r.start + rates.switched_at
        return [f"compiled in the background{took}; the compiled step took over at step {at}{speeds}"]
    if rates.steps["eager"] and not rates.steps["compiled"]:
        return [f"the background compile had not finished: every step ran eagerly{speeds}"]
    return [f"compiled{speeds}"] if speeds else []
