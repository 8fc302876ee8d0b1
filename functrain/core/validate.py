"""Private helpers shared by every layer: argument checks and names of pytree paths.

Every check raises :class:`BadValue`, which is both a ``TypeError`` and a
``ValueError`` (as ``numpy.AxisError`` is both an ``IndexError`` and a
``ValueError``): callers that catch either keep working, and the message always
names the argument, what is allowed and what was given.
"""
from __future__ import annotations

import math
import numbers
from typing import Any, Iterable

__all__ = ["BadValue", "describe", "is_real", "is_int", "check_real", "check_int", "check_choice", "path_str"]


class BadValue(TypeError, ValueError):
    """An argument of the wrong type or out of range (both a TypeError and a ValueError)."""


def describe(value: Any) -> str:
    """``'abc' (str)``: a value and its type, for error messages."""
    return f"{value!r} ({type(value).__name__})"


def is_real(value: Any) -> bool:
    """A real Python/NumPy number that is not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def is_int(value: Any) -> bool:
    """A Python/NumPy integer that is not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_real(name: str, value: Any, *, lo: float | None = None, hi: float | None = None,
               lo_open: bool = False, hi_open: bool = False, what: str | None = None) -> float:
    """``float(value)`` for a finite real number in the range, else :class:`BadValue`.

    ``what`` describes the allowed values (default: the range).
    """
    if what is None:
        left, right = "(" if lo_open else "[", ")" if hi_open else "]"
        if lo is not None and hi is not None:
            what = f"a number in {left}{lo:g}, {hi:g}{right}"
        elif lo is not None:
            what = f"a number {'>' if lo_open else '>='} {lo:g}"
        elif hi is not None:
            what = f"a number {'<' if hi_open else '<='} {hi:g}"
        else:
            what = "a finite number"
    ok = is_real(value) and math.isfinite(float(value))
    if ok:
        x = float(value)
        ok = not (lo is not None and (x <= lo if lo_open else x < lo)) and \
            not (hi is not None and (x >= hi if hi_open else x > hi))
    if not ok:
        raise BadValue(f"{name} must be {what}; got {describe(value)}")
    return float(value)


def check_int(name: str, value: Any, *, minimum: int | None = None, maximum: int | None = None,
              what: str | None = None) -> int:
    """``int(value)`` for an integer (not a bool) in ``[minimum, maximum]``, else :class:`BadValue`."""
    if what is None:
        if minimum is not None and maximum is not None:
            what = f"an int in [{minimum}, {maximum}]"
        elif minimum is not None:
            what = f"an int >= {minimum}"
        elif maximum is not None:
            what = f"an int <= {maximum}"
        else:
            what = "an int"
    if not is_int(value) or (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise BadValue(f"{name} must be {what}; got {describe(value)}")
    return int(value)


def check_choice(name: str, value: Any, choices: Iterable[Any]) -> Any:
    """``value`` if it is one of ``choices``, else :class:`BadValue` listing them."""
    choices = tuple(choices)
    if not any(type(value) is type(c) and value == c for c in choices):
        raise BadValue(f"{name} must be one of {choices}; got {describe(value)}")
    return value


def path_str(path: Iterable[Any]) -> str:
    """A pytree path as ``"layer/w"`` (the root is ``"<root>"``), for messages and checkpoint keys."""
    return "/".join(str(p) for p in path) or "<root>"
