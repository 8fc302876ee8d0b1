"""The compile worker's settings: every ``FUNCTRAIN_COMPILE_*`` variable, read and checked once.

:func:`functrain.compile` reads them when it is called (:meth:`WorkerSettings.from_env`) and the
:class:`~functrain.compiler.api.CompiledStep` hands the frozen result down to what starts, bounds
and follows compiles (the background component, its jobs, the worker, the graph lock): no module
below reads the environment. A bad value is refused there, before anything runs, naming the
variable, the value and what is allowed. Every bound is finite, so no timer overflows.

============================  ==========  ==============================================================
variable                      default     allowed
============================  ==========  ==============================================================
FUNCTRAIN_COMPILE_WORKER      ``process`` ``process`` (a worker process), ``thread`` (for comparison only)
FUNCTRAIN_COMPILE_TIMEOUT     3600        seconds a compile may take, ``0 < t <= 604800`` (a week)
FUNCTRAIN_COMPILE_NICE        10          the worker's niceness increment, an integer ``0..19``
FUNCTRAIN_COMPILE_LOCK_TIMEOUT 600        seconds to wait for another process's compile, ``0 <= t <= 86400``
FUNCTRAIN_COMPILE_FOLLOW_S    5           seconds a rank waits for local rank 0 to start a compile,
                                          ``0 <= t <= 3600``
FUNCTRAIN_COMPILE_FINISH      ``0``       ``0``: a compile still running when its run ends is killed with it
                                          (nothing of a run outlives it); ``1`` (opt-in): when the run ended
                                          normally, it finishes after exit, into the caches
FUNCTRAIN_COMPILE_POLICY      ``auto``    ``auto``: compile when it pays in this run (:mod:`functrain.compiler.
                                          policy`); ``always``: compile; ``never``: train eagerly
FUNCTRAIN_COMPILE_DRAW_CAPTURES 8         captures of one input signature's outcomes of Python ``random``
                                          draws (:mod:`functrain.compiler.host_draws`); a call with another
                                          outcome runs eagerly: an integer ``1..4096``
============================  ==========  ==============================================================
"""
from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Callable, Mapping, NamedTuple

__all__ = ["WorkerSettings", "SETTINGS", "BadSetting", "DRAW_CAPTURES"]

DRAW_CAPTURES = 8
"""The default bound on one input signature's captures for the outcomes of its Python draws (as Dynamo's
recompile limit, 8): past it, a call with another outcome runs the eager step."""


class BadSetting(ValueError):
    """A ``FUNCTRAIN_COMPILE_*`` variable holds a value that is not allowed (the message names both)."""


def _seconds(lo: float, hi: float, lo_open: bool) -> Callable[[str], float]:
    def parse(raw: str) -> float:
        value = float(raw)  # ValueError: not a number
        if not math.isfinite(value) or value > hi or (value <= lo if lo_open else value < lo):
            raise ValueError
        return value
    return parse


def _nice(raw: str) -> int:
    value = int(raw.strip())
    if not 0 <= value <= 19:
        raise ValueError
    return value


def _captures(raw: str) -> int:
    value = int(raw.strip())
    if not 1 <= value <= 4096:
        raise ValueError
    return value


def _choice(*allowed: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        if raw.strip() not in allowed:
            raise ValueError
        return raw.strip()
    return parse


class Setting(NamedTuple):
    """One row of :data:`SETTINGS`: the variable, the :class:`WorkerSettings` field it sets, how its text is
    read (``ValueError``: not allowed) and what is allowed, in words."""

    variable: str
    field: str
    parse: Callable[[str], Any]
    allowed: str
    limit: str = ""


SETTINGS: tuple[Setting, ...] = (
    Setting("FUNCTRAIN_COMPILE_WORKER", "worker", _choice("process", "thread"), "'process' or 'thread'"),
    Setting("FUNCTRAIN_COMPILE_TIMEOUT", "timeout", _seconds(0.0, 604800.0, True), "a number of seconds > 0",
            "finite, at most 604800: a week"),
    Setting("FUNCTRAIN_COMPILE_NICE", "nice", _nice, "an integer from 0 to 19 (the worker's niceness increment)"),
    Setting("FUNCTRAIN_COMPILE_LOCK_TIMEOUT", "lock_timeout", _seconds(0.0, 86400.0, False),
            "a number of seconds >= 0", "finite, at most 86400: a day"),
    Setting("FUNCTRAIN_COMPILE_FOLLOW_S", "follow_s", _seconds(0.0, 3600.0, False), "a number of seconds >= 0",
            "finite, at most 3600"),
    Setting("FUNCTRAIN_COMPILE_FINISH", "finish", lambda raw: _choice("0", "1")(raw) == "1",
            "0 (a compile still running at exit is killed) or 1 (it finishes after a run that ended normally)"),
    Setting("FUNCTRAIN_COMPILE_POLICY", "policy", _choice("auto", "always", "never"),
            "'auto' (compile when it pays in this run), 'always' or 'never'"),
    Setting("FUNCTRAIN_COMPILE_DRAW_CAPTURES", "draw_captures", _captures,
            "an integer from 1 to 4096 (the captures of one input signature's Python random outcomes)"),
)
"""Every ``FUNCTRAIN_COMPILE_*`` variable, in one table (the module docstring gives the defaults)."""


@dataclasses.dataclass(frozen=True)
class WorkerSettings:
    """How background compiles run on this machine (see the module docstring for each variable).

    Attributes:
        worker: ``"process"`` or ``"thread"``.
        timeout: seconds a compile may take before it is stopped (its step trains on eagerly).
        nice: the worker's niceness increment.
        lock_timeout: seconds a blocking compile waits for another process compiling the same graph.
        follow_s: seconds a rank other than local rank 0 waits for it to start a graph's compile.
        finish: whether a compile still running when its run ended normally may finish after exit (opt-in).
        policy: ``"auto"`` (the compile policy decides whether compiling pays), ``"always"`` or ``"never"``.
        draw_captures: how many outcomes of a step's Python ``random`` draws get a capture of their own, per input
            signature; a call with another outcome runs eagerly (:mod:`functrain.compiler.host_draws`).

    Example::

        >>> from functrain.compiler.settings import WorkerSettings
        >>> WorkerSettings.from_env({"FUNCTRAIN_COMPILE_NICE": "5"}).nice
        5
        >>> WorkerSettings.from_env({"FUNCTRAIN_COMPILE_TIMEOUT": "inf"})
        Traceback (most recent call last):
        ...
        functrain.compiler.settings.BadSetting: FUNCTRAIN_COMPILE_TIMEOUT must be a number of seconds > 0; got 'inf' (finite, at most 604800: a week)
    """

    worker: str = "process"
    timeout: float = 3600.0
    nice: int = 10
    lock_timeout: float = 600.0
    follow_s: float = 5.0
    finish: bool = False
    policy: str = "auto"
    draw_captures: int = DRAW_CAPTURES

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "WorkerSettings":
        """The settings in ``environ`` (default: this process's environment); unset variables keep their
        defaults; the first bad value raises :class:`BadSetting` naming it."""
        environ = os.environ if environ is None else environ
        values = {}
        for s in SETTINGS:
            raw = environ.get(s.variable)
            if raw is None:
                continue
            try:
                values[s.field] = s.parse(raw)
            except (ValueError, OverflowError):
                limit = f" ({s.limit})" if s.limit else ""
                raise BadSetting(f"{s.variable} must be {s.allowed}; got {raw[:100]!r}{limit}") from None
        return cls(**values)
