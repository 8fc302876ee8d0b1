"""The end-of-run summary: what the run reached, how long it took, and where everything went."""
from __future__ import annotations

import math
import os
from typing import Any, Iterable, Mapping

__all__ = ["run_summary", "format_duration"]


def format_duration(seconds: float) -> str:
    """``"42.0 s"``, ``"3 min 05 s"``, ``"2 h 07 min"``.

    Example::

        >>> format_duration(185.2)
        '3 min 05 s'
    """
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(int(round(seconds)), 60)
    if minutes < 60:
        return f"{minutes} min {secs:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


def _value(v: Any) -> str:
    try:
        return f"{float(v):.6g}"
    except (TypeError, ValueError):
        return str(v)


def run_summary(*, results_folder: str, step: int, total_steps: int | None = None,
                final_metrics: Mapping[str, Any] | None = None, wall_time_s: float | None = None,
                compile_time_s: float | None = None, steps_run: int | None = None,
                outputs: Mapping[str, str] | None = None, trackers: Iterable[Any] = (),
                notes: Iterable[str] = ()) -> str:
    """A few lines for the end of ``train()``: final metrics, time (and compile time), where the results are.

    ``final_metrics`` are the last logged values (``loss`` first); ``wall_time_s`` the
    time of this session's loop; ``compile_time_s`` the part spent compiling, so the
    throughput line excludes it; ``steps_run`` the steps this session ran (differs from
    ``step`` after a resume); ``outputs`` ``{label: path}`` (paths that do not exist are
    left out, so the summary never points at a missing file); ``trackers`` the objects of
    :func:`functrain.trainer.trackers.make_trackers` (their ``where()`` lines); ``notes`` more lines
    after the time (a background compile: when it took over, the rate of each path).

    Example::

        >>> print(run_summary(results_folder="/tmp/none", step=100, total_steps=100,
        ...                   final_metrics={"loss": 0.1234567}, wall_time_s=12.5, compile_time_s=2.5, steps_run=100))
        finished step 100/100: loss 0.123457
        time 12.5 s (compile 2.5 s), 10.0 steps/s after compiling
        results in /tmp/none
    """
    lines = []
    metrics = dict(final_metrics or {})
    head = f"finished step {step}" + (f"/{total_steps}" if total_steps is not None else "")
    ordered = sorted(metrics, key=lambda k: (k != "loss", k != "eval_loss", k))
    shown = [f"{k} {_value(metrics[k])}" for k in ordered if k not in ("steps_per_s",)]
    lines.append(head + (": " + ", ".join(shown) if shown else ""))
    if wall_time_s is not None:
        line = f"time {format_duration(wall_time_s)}"
        if compile_time_s is not None:
            line += f" (compile {format_duration(compile_time_s)})"
        run_time = wall_time_s - (compile_time_s or 0.0)
        if steps_run and run_time > 0:
            line += f", {steps_run / run_time:.1f} steps/s" + (" after compiling" if compile_time_s else "")
        lines.append(line)
    lines.extend(notes)
    lines.append(f"results in {os.path.abspath(results_folder)}")
    for label, path in (outputs or {}).items():
        if path and os.path.exists(path):
            lines.append(f"  {label}: {path}")
    for tracker in trackers:
        where = getattr(tracker, "where", None)
        text = where() if callable(where) else None
        if text:
            lines.append(f"  {text}")
    return "\n".join(lines)
