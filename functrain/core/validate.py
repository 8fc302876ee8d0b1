"""Private helpers shared by every layer: argument checks and names of pytree paths.

Every check raises :class:`BadValue`, which is both a ``TypeError`` and a
``ValueError`` (as ``numpy.AxisError`` is both an ``IndexError`` and a
``ValueError``): callers that catch either keep working, and the message always
names the argument, what is allowed and what was given.
"""
from __future__ import annotations

import math
import numbers
import os
from typing import Any, Iterable

__all__ = ["BadValue", "describe", "bounded_repr", "is_real", "is_int", "check_real", "check_int", "check_choice", "path_str",
           "env_seconds"]


class BadValue(TypeError, ValueError):
    """An argument of the wrong type or out of range (both a TypeError and a ValueError)."""


REPR_LIMIT = 300  # characters of a value quoted in an error message


def describe(value: Any, limit: int = REPR_LIMIT) -> str:
    """``'abc' (str)``: a value and its type, for error messages; the value's repr is cut at ``limit`` characters.

    Example::

        >>> describe("abc")
        "'abc' (str)"
        >>> big = [list(range(10))] * 10**6
        >>> describe(big, limit=40)
        '[[0, 1, 2, 3, 4, 5, 6, 7, 8, 9], [0, 1, ... (list)'
    """
    return f"{bounded_repr(value, limit)} ({type(value).__name__})"


def bounded_repr(value: Any, limit: int = REPR_LIMIT) -> str:
    """``repr(value)`` cut at ``limit`` characters (``...`` marks the cut), built without building the whole.

    Containers (lists, tuples, dicts, sets) are walked with a budget of characters, so a value that shares
    its parts (a YAML document of nested aliases: a few hundred bytes whose repr is hundreds of megabytes)
    costs ``limit`` characters, not its full repr. Other objects use their own ``repr``, cut; an int too
    large to print is described by its size.

    Example::

        >>> bounded_repr({"a": "x" * 1000}, limit=20)
        "{'a': 'xxxxxxxxxxxxx..."
    """
    out: list[str] = []
    budget = [max(int(limit), 8)]

    def put(text: str) -> bool:
        if len(text) > budget[0]:
            out.append(text[:budget[0]])
            budget[0] = 0
            return False
        out.append(text)
        budget[0] -= len(text)
        return True

    def walk(x: Any, depth: int) -> bool:
        if isinstance(x, (str, bytes, bytearray)):
            return put(repr(x[:budget[0] + 1]))
        if isinstance(x, int) and not isinstance(x, bool) and x.bit_length() > 1000:
            return put(f"<int of {x.bit_length()} bits>")
        if type(x) in (list, tuple, set, frozenset, dict) and depth < 50:
            items = list(x.items()) if isinstance(x, dict) else x
            if isinstance(x, (set, frozenset)) and not x:
                return put(f"{type(x).__name__}()")
            left, right = {list: "[]", tuple: "()", dict: "{}", set: "{}"}.get(type(x), ("frozenset({", "})"))
            if not put(left):
                return False
            for i, item in enumerate(items):
                if i and not put(", "):
                    return False
                if isinstance(x, dict):
                    if not (walk(item[0], depth + 1) and put(": ") and walk(item[1], depth + 1)):
                        return False
                elif not walk(item, depth + 1):
                    return False
            if type(x) is tuple and len(x) == 1 and not put(","):
                return False
            return put(right)
        try:
            text = repr(x)
        except Exception as e:  # noqa: BLE001 - a broken __repr__ must not hide the real error
            text = f"<{type(x).__name__} (repr failed: {type(e).__name__})>"
        return put(text)

    if not walk(value, 0):
        return "".join(out) + "..."
    return "".join(out)


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


def env_seconds(name: str, default: float, *, positive: bool = False) -> float:
    """The number of seconds in environment variable ``name`` (``default`` when unset): a ``ValueError`` naming
    the variable, what it holds and what is allowed (``> 0`` with ``positive``, else ``>= 0``) otherwise.

    Example::

        >>> env_seconds("FUNCTRAIN_DOCTEST_UNSET_SECONDS", 5.0)
        5.0
    """
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not (value > 0 if positive else value >= 0):
        raise ValueError(f"{name} must be a number of seconds {'> 0' if positive else '>= 0'}; got {raw!r}")
    return value
