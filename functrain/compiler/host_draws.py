"""Python's ``random`` in a compiled step: one capture per outcome of the branches the draws decide.

A step may branch on a number drawn from Python's global generator (denoising-diffusion-pytorch's
self-conditioning: ``if self.self_condition and random() < 0.5``). Eagerly the number comes from the state's key
(:func:`functrain.core.rng.with_rng` seeds the generator from the step seed). Compiled, the same holds:

* **the trace** (:func:`recording`) seeds the generator from the step seed of the state it traces, so it draws the
  numbers the eager step would, and hands the step each number as a :class:`HostDraw`: an object (not a ``float``
  subclass, whose value C code reads without asking) that records every comparison made on it (``<``, ``<=``,
  ``>``, ``>=``, ``==``, ``!=``, ``bool``) as a guard of the capture (its :class:`DrawPlan`). Any other use of a
  drawn number (arithmetic, ``float()`` and all that calls it: ``math.*``, ``struct``, ``%``-formatting; its text,
  ``str``/``repr``/``format``; its hash, its attributes, a torch op that takes it) would bake it into the graph as
  a constant: it is refused there, at the trace, naming the draw's line and the use's
  (:class:`~functrain.core.rng.HostRandomError`), even if the step catches the error. So is a draw the trace
  cannot see (a generator method other than ``random()`` and ``uniform()``, a ``random.Random`` of the step's own,
  a name bound inside a closure).
* **each call** (:class:`DrawCases`, asked by the runner) seeds a private ``random.Random`` from the state's key (a
  host tensor: no device sync), makes the same draws, evaluates the guards, and takes the capture whose guards all
  hold; on a miss, the key names the guards' outcome, and the runner traces (or has compiled in the background) a
  capture for it, as for a new input signature. The captures of one signature's outcomes are bounded
  (``FUNCTRAIN_COMPILE_DRAW_CAPTURES``, default 8): past the bound a call with a new outcome runs eagerly, said once.

Python's generator is seeded alike on every rank (:func:`functrain.core.rng.host_seed`), so every rank takes the same
branch at the same step and needs the same capture: ranks switch to compiled code together, with no extra
communication. Compiled and eager steps are equal from the same state (a law), and a resumed run draws the same
numbers (they come from the key in the checkpoint).

Example::

    >>> import random
    >>> from functrain.compiler.host_draws import recording
    >>> with recording(seed=3) as plan:
    ...     coin = random.random() < 0.5
    >>> plan.outcome(3) == plan.results, len(plan.guards)
    (True, 1)
"""
from __future__ import annotations

import contextlib
import operator
import os
import random
import sys
import threading
import warnings
from typing import Any, Iterator

import torch
from torch.overrides import TorchFunctionMode

from ..core.rng import HostRandomError, host_seed
from .settings import DRAW_CAPTURES

__all__ = ["HostDraw", "DrawPlan", "DrawCases", "OutcomeKey", "recording", "RECORDER_CODES"]

# the draw methods a trace can see and replay (each returns a float from the generator's state alone)
DRAWN = ("random", "uniform")
_OPS = {"<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge, "==": operator.eq,
        "!=": operator.ne}


class DrawPlan:
    """The Python draws of one capture and the guards they decided, in the order the trace made them.

    Attributes:
        draws: ``[(method, args)]``: each draw, e.g. ``("random", ())`` or ``("uniform", (0.0, 1.0))``.
        guards: ``[(draw, op, other)]``: a comparison of draw ``draw`` with ``other`` (a number, or ``("draw", j)``
            for another draw), ``op`` one of ``<``, ``<=``, ``>``, ``>=``, ``==``, ``!=``.
        results: what each guard gave while tracing (a tuple of bools): the branch the capture holds.
        where: ``file:line in function`` of the first draw, for messages.
    """

    def __init__(self) -> None:
        self.draws: list[tuple[str, tuple]] = []
        self.guards: list[tuple[int, str, Any]] = []
        self.results: tuple = ()
        self.where = ""
        self.closed = False  # the trace ended: a draw kept for later is refused (its guards would go nowhere)
        self.refused: HostRandomError | None = None  # the first use refused while tracing

    def values(self, seed: int, known: dict | None = None) -> list:
        """The numbers the draws give a generator seeded with ``seed``; ``known``: ``{draws: numbers}`` of this
        seed made for other plans (captures of one signature mostly make the same draws: made once a call)."""
        key = tuple(self.draws)
        got = known.get(key) if known is not None else None
        if got is None:
            gen = random.Random(seed)
            got = [getattr(gen, name)(*args) for name, args in self.draws]
            if known is not None:
                known[key] = got
        return got

    def outcome(self, seed: int, n: int | None = None, known: dict | None = None) -> tuple:
        """The guards' results (the first ``n``; all by default) for the draws of a generator seeded with
        ``seed``: host arithmetic, about 10 microseconds for one draw (``known``: see :meth:`values`)."""
        values = self.values(seed, known)
        out = []
        for i, op, other in self.guards[:n]:
            b = values[other[1]] if isinstance(other, tuple) else other
            out.append(bool(_OPS[op](values[i], b)))
        return tuple(out)

    def agreeing(self, seed: int, known: dict | None = None) -> int:
        """How many leading guards hold for ``seed`` (``len(guards)``: this capture is the call's)."""
        got = self.outcome(seed, known=known)
        n = 0
        while n < len(got) and got[n] == self.results[n]:
            n += 1
        return n

    def __repr__(self) -> str:
        return f"DrawPlan(draws={self.draws}, guards={self.guards}, results={self.results})"


def _refuse(draw: "HostDraw", use: str) -> HostRandomError:
    at = _use_site()
    where = f" at {at}" if at and at != draw._where else ""
    error = HostRandomError(
        f"ft.compile: the number drawn by random.{draw._method}() at {draw._where} was used as a number ({use}){where} "
        f"while the step was captured: it would be a constant of the compiled graph, the same at every step. A "
        f"compiled step may only compare a drawn number (<, <=, >, >=, ==, != with a number or another draw, or its "
        f"truth), which picks the graph. Draw a number you compute with from torch ops instead (torch.rand((), "
        f"device=x.device); a coin as a tensor: torch.rand((), device=x.device) < 0.5, used through torch.where): "
        f"they come from state.rng and compile. Or run this step eagerly (ft.TrainConfig(compile=False))")
    if draw._plan.refused is None:  # (kept: the trace fails with it even if the step caught it, see recording)
        draw._plan.refused = error
    return error


_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))


def _use_site() -> str:
    """``file:line in function`` of the innermost frame outside this module and torch: where a drawn number was
    used (``math.sqrt(r)`` has no frame of its own: it is the line that called it)."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if name != __file__ and not name.startswith("<frozen") and not os.path.abspath(name).startswith(_TORCH_DIR):
            return f"{name}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return ""


class HostDraw:
    """A number drawn from Python's ``random`` while a step is traced (see the module docstring): comparing it
    records a guard of the capture; any other use raises :class:`~functrain.core.rng.HostRandomError`.

    It is not a ``float`` subclass: C code reads a float's value without asking (``math.sqrt``, ``math.fsum``,
    ``struct.pack``, ``"%f" %``, ``float.__repr__``), so a subclass's number leaks past any method. This object's
    number is reached only through its own methods, and each one but the comparisons refuses: the arithmetic
    operators, ``__float__`` (what ``math.*``, ``struct``, ``array`` and ``%``-formatting call), ``__int__``,
    ``__round__``, ``__floor__``, ``__str__``, ``__repr__`` and ``__format__`` (no text of the number either:
    ``float(str(r))``), ``__hash__``, pickling, and a float's named attributes or any method a library calls on it
    (``r.hex()``, ``r.as_integer_ratio()``, ``r.sqrt()`` from a numpy ufunc). It has exactly a float's special
    methods, and ``__class__`` says ``float``: ``isinstance(r, float)``, ``numbers.Real`` and protocol checks give
    what they give the eager step's number, so a type check takes the eager step's branch.
    """

    __slots__ = ("_value", "_plan", "_index", "_method", "_where")

    def __init__(self, value: float, plan: DrawPlan, index: int, method: str, where: str) -> None:
        set_ = object.__setattr__
        set_(self, "_value", float(value))
        set_(self, "_plan", plan)
        set_(self, "_index", index)
        set_(self, "_method", method)
        set_(self, "_where", where)

    @property  # type: ignore[misc]
    def __class__(self) -> type:  # isinstance(r, float), numbers.Real: what the eager step's number is
        return float

    def _guard(self, op: str, other: Any) -> bool:
        plan = self._plan
        if plan.closed:
            raise _refuse(self, f"compared ({op}) after the capture that drew it ended: a number kept from one "
                                f"trace for another")
        if type(other) is HostDraw:
            if other._plan is not plan:
                raise _refuse(self, "compared with a number drawn in another trace")
            b, value = ("draw", other._index), other._value
        elif isinstance(other, (int, float)) and not isinstance(other, bool):
            b = value = float(other)
        else:
            raise _refuse(self, f"compared with a {type(other).__name__}")
        result = bool(_OPS[op](self._value, value))
        plan.guards.append((self._index, op, b))
        plan.results += (result,)
        return result

    def __lt__(self, other: Any) -> bool:
        return self._guard("<", other)

    def __le__(self, other: Any) -> bool:
        return self._guard("<=", other)

    def __gt__(self, other: Any) -> bool:
        return self._guard(">", other)

    def __ge__(self, other: Any) -> bool:
        return self._guard(">=", other)

    def __eq__(self, other: Any) -> bool:  # type: ignore[override]
        return self._guard("==", other)

    def __ne__(self, other: Any) -> bool:  # type: ignore[override]
        return self._guard("!=", other)

    def __bool__(self) -> bool:
        return self._guard("!=", 0.0)

    def __copy__(self) -> "HostDraw":  # (immutable: a copy is itself, its comparisons still guards)
        return self

    def __deepcopy__(self, memo: Any) -> "HostDraw":
        return self

    def __setattr__(self, name: str, value: Any) -> None:  # (as a float: no attribute can be set)
        raise AttributeError(f"'float' object attribute {name!r} is read-only")

    def __getattr__(self, name: str) -> Any:
        # only names it lacks: a float's own (r.hex(), r.real, r.as_integer_ratio()) and any other method a library
        # may call on a number (numpy's ufuncs call r.sqrt() on an object) are uses of the number; a special name a
        # float lacks is missing, as on the eager step's float (a protocol probe, numpy's __array__)
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(f"'float' object has no attribute {name!r}")
        raise _refuse(self, f".{name}")


def _refusing(use: str) -> Any:
    def method(self: HostDraw, *args: Any) -> Any:
        raise _refuse(self, use)
    method.__name__ = use
    return method


# every special method of a float but its comparisons and truth: each one a way to the number or its text. Only
# these (no more: a special method a float lacks would change what protocols it meets, isinstance(r, Iterable))
for _name in ("add", "radd", "sub", "rsub", "mul", "rmul", "truediv", "rtruediv", "floordiv", "rfloordiv", "mod",
              "rmod", "divmod", "rdivmod", "pow", "rpow", "neg", "pos", "abs", "float", "int", "round", "trunc",
              "floor", "ceil", "str", "repr", "format", "hash", "reduce", "reduce_ex", "getnewargs", "getstate"):
    setattr(HostDraw, f"__{_name}__", _refusing(f"__{_name}__"))


def _draw_in(value: Any) -> "HostDraw | None":
    """The first :class:`HostDraw` in ``value`` (itself, or inside lists, tuples, dicts), else ``None``."""
    if type(value) is HostDraw:
        return value
    if isinstance(value, (list, tuple)):
        for v in value:
            found = _draw_in(v)
            if found is not None:
                return found
    elif isinstance(value, dict):
        return _draw_in(list(value.values()))
    return None


class _NoDrawsIntoTorch(TorchFunctionMode):
    """While tracing: a torch function given a :class:`HostDraw` (``x * coin``, ``torch.full((), coin)``,
    ``torch.tensor([[coin]])``) would bake it into the graph: refused."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        found = _draw_in(args)  # (not `or`: the truth of a draw is a guard)
        if found is None and kwargs:
            found = _draw_in(kwargs)
        if found is not None:
            raise _refuse(found, f"passed to {getattr(func, '__name__', func)}")
        return func(*args, **kwargs)


class _Recorder:
    """``random.random`` (or ``uniform``) while a trace records: the draw, as a :class:`HostDraw`."""

    def __init__(self, name: str, fn: Any, plan: DrawPlan, thread: int):
        self.name, self.fn, self.plan, self.thread = name, fn, plan, thread

    def __call__(self, *args: Any) -> Any:
        value = self.fn(*args)
        if threading.get_ident() != self.thread:
            return value
        plan, where = self.plan, _caller(2)
        if not plan.draws:
            plan.where = where
        plan.draws.append((self.name, tuple(float(a) for a in args)))
        return HostDraw(value, plan, len(plan.draws) - 1, self.name, where)


# the frame that draws for a recorded trace: a profile hook naming the other draws skips its calls
RECORDER_CODES = frozenset({_Recorder.__call__.__code__})


class OutcomeKey(tuple):
    """A cache key ``(signature key, guard results)``: the capture of a signature for one outcome of its draws."""

    __slots__ = ()

    @property
    def base(self) -> Any:
        return self[0]


def _caller(depth: int) -> str:
    frame = sys._getframe(depth)
    return f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"


@contextlib.contextmanager
def recording(seed: int) -> Iterator[DrawPlan]:
    """Trace-time draws from Python's ``random``, seeded from ``seed`` and recorded (yields the :class:`DrawPlan`).

    For the block, the global generator is seeded with ``seed``, and ``random.random`` / ``random.uniform`` (the
    module's names and every module-level name bound to them, as ``from random import random`` binds it) return
    :class:`HostDraw` numbers; a torch function given one is refused. At the end the generator is restored; a draw the
    block made without those names (the generator's state then differs from the recorded draws' replay) raises
    :class:`~functrain.core.rng.HostRandomError` with ``unnamed = True`` (the caller's hooked trace names it).

    Only the calling thread's draws are recorded (another thread calling the names meanwhile gets plain numbers).
    """
    plan = DrawPlan()
    gen = random._inst
    me = threading.get_ident()
    originals = {name: getattr(random, name) for name in DRAWN}
    wrappers = {name: _Recorder(name, fn, plan, me) for name, fn in originals.items()}
    bound = _bound_names(originals)
    saved = gen.getstate()
    gen.seed(seed)
    try:
        for module, name, which in bound:
            setattr(module, name, wrappers[which])
        with _NoDrawsIntoTorch():
            yield plan
    except Exception as error:  # (not KeyboardInterrupt: a Ctrl-C stays one)
        # a refusal the step's code turned into another error (struct.pack's "required argument is not a float")
        # is the refusal; a function that checks its argument's type and refuses a draw (torch's argument parser:
        # "torch.full(): argument 'fill_value' must be Number, not HostDraw") is refused by name
        if plan.refused is not None and error is not plan.refused:
            raise plan.refused from error
        if isinstance(error, TypeError) and "HostDraw" in str(error) and plan.draws:
            raise _refused_by_type(plan, error) from error
        raise
    finally:
        plan.closed = True
        for module, name, which in bound:
            setattr(module, name, originals[which])
        after = gen.getstate()
        gen.setstate(saved)
    if plan.refused is not None:  # refused, and the step caught it (`except Exception:` a fallback number)
        raise plan.refused
    replay = random.Random(seed)
    for name, args in plan.draws:
        getattr(replay, name)(*args)
    if replay.getstate() != after:
        error = HostRandomError(
            "ft.compile: the step drew from Python's random generator in a way a trace cannot follow (a method "
            f"other than {', '.join(f'random.{n}()' for n in DRAWN)}, or a name bound where functrain cannot see "
            "it) while being captured")
        error.unnamed = True
        raise error


def _refused_by_type(plan: DrawPlan, error: TypeError) -> HostRandomError:
    """The refusal of a draw that a function refused by its type (which draw it was, the error does not say)."""
    tb, site = error.__traceback__, ""
    while tb is not None:  # the innermost line of the step's own code (not this module, not torch)
        name = tb.tb_frame.f_code.co_filename
        if name != __file__ and not name.startswith("<frozen") and not os.path.abspath(name).startswith(_TORCH_DIR):
            site = f"{name}:{tb.tb_lineno} in {tb.tb_frame.f_code.co_name}"
        tb = tb.tb_next
    which = f"random.{plan.draws[0][0]}() at {plan.where}" if len(plan.draws) == 1 else \
        f"Python's random (its first draw: random.{plan.draws[0][0]}() at {plan.where})"
    return HostRandomError(
        f"ft.compile: a number drawn by {which} was used as a number (given to a function that refused it: "
        f"{type(error).__name__}: {str(error)[:200]}){f' at {site}' if site else ''} while the step was captured: "
        f"it would be a constant of the compiled graph, the same at every step. A compiled step may only compare a "
        f"drawn number (<, <=, >, >=, ==, != with a number or another draw, or its truth), which picks the graph. "
        f"Draw a number you compute with from torch ops instead (torch.rand((), device=x.device)): it comes from "
        f"state.rng and compiles. Or run this step eagerly (ft.TrainConfig(compile=False))")


def _bound_names(originals: dict) -> list:
    """``(module, name, method)`` of every module-level name holding one of ``originals`` (the ``random`` module's
    own, and ``from random import random`` anywhere)."""
    ids = {id(fn): name for name, fn in originals.items()}
    found = []
    for module in list(sys.modules.values()):
        try:
            names = vars(module)
        except TypeError:
            continue
        for key, value in list(names.items()):
            which = ids.get(id(value))
            if which is not None and value is originals[which]:
                found.append((module, key, which))
    return found


class DrawCases:
    """The captures of one step's signatures that branch on Python draws: which one a call takes.

    Owned by the runner's graph cache (:class:`~functrain.compiler.runtime.Graphs`); the runner asks :meth:`key` on
    every call that misses its last capture and :meth:`holds` before reusing it, and registers each capture it
    installs (:meth:`add`). A step with no such capture costs one dict lookup.

    ``limit``: how many cache keys (captures) one signature's outcomes may have (``FUNCTRAIN_COMPILE_DRAW_CAPTURES``,
    default :data:`~functrain.compiler.settings.DRAW_CAPTURES`): ``n`` coins have up to ``2**n`` outcomes, each a
    trace and a compile. Past it, :meth:`key` answers ``None`` for a call whose outcome has no key yet, and the
    runner runs that call eagerly (the captured outcomes stay compiled), as Dynamo does past its recompile limit;
    one warning says so. The keys are counted as asked, which is the same on every rank (the draws come from the
    replicated key): the ranks run the same calls eagerly.
    """

    def __init__(self, limit: int = DRAW_CAPTURES) -> None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError(f"DrawCases: limit must be an int >= 1 (captures per signature); got {limit!r}")
        self.limit = limit
        self.plans: dict = {}  # signature key -> [(full key, DrawPlan)]
        self.seeds: dict = {}  # cache key -> the seed of the first call that asked for it
        self.asked: dict = {}  # signature key -> how many cache keys its calls asked for (each one capture)
        self.past: set = set()  # signature keys whose outcomes went past the limit (said once each)
        self.last: Any = None  # the cache key of the latest call that asked (the one a trace now is for)

    def key(self, key: Any, rng: dict | None) -> Any:
        """The cache key of a call with signature key ``key`` and ``state.rng`` ``rng``: ``key`` itself while no
        capture of it branched on a draw (or for an unseeded state); else the key of the capture whose guards all
        hold for the call's seed, or, if none does, an :class:`OutcomeKey` ``(key, outcome)``: the results of the
        guards up to the first that no known capture holds. ``None``: such a new outcome past the limit on
        captures (the call runs eagerly). Asked on a miss of the runner's last capture only."""
        if rng is None:
            self.last = None
            return key
        seed = host_seed(rng)
        full = key
        entries = self.plans.get(key)
        if entries:
            best, best_n = None, -1
            made: dict = {}  # (the draws' numbers for this seed, made once for the plans that share them)
            for known, plan in entries:
                n = plan.agreeing(seed, made)
                if n == len(plan.guards):
                    best = None
                    full = known
                    break
                if n > best_n:
                    best, best_n = plan, n
            if best is not None:
                full = OutcomeKey((key, best.outcome(seed, best_n + 1, made)))
        if full not in self.seeds:
            asked = self.asked.get(key, 0)
            if asked >= self.limit:
                self._say_past(key)
                self.last = None
                return None
            self.asked[key] = asked + 1
            self.seeds[full] = seed
        self.last = full
        return full

    def _say_past(self, key: Any) -> None:
        if key in self.past:
            return
        self.past.add(key)
        plans = self.plans.get(key) or []
        where = next((p.where for _, p in plans if p.where), "")
        drawn = f" (the first at {where})" if where else ""
        warnings.warn(
            f"ft.compile: the step's draws from Python's random{drawn} have taken more than {self.limit} outcomes for "
            f"one input signature, each a graph of its own (traced and compiled at its first call); "
            f"FUNCTRAIN_COMPILE_DRAW_CAPTURES={self.limit} bounds them. The {self.limit} captured outcomes run "
            f"compiled; a call with any other outcome runs the eager step from now on (the same result). A coin "
            f"drawn as a tensor (torch.rand((), device=x.device) < 0.5, used through torch.where) needs one graph "
            f"for every outcome", RuntimeWarning, stacklevel=4)

    def trace_seed(self, rng: dict | None) -> int | None:
        """The seed a trace for the latest call's key uses: the seed of the first call that asked for that key.
        Every rank asks for the same keys at the same calls, so every rank traces the same outcome, whichever call
        its trace comes in (a background trace waits for the compiler's imports, which differ by process)."""
        if rng is None:
            return None
        seed = self.seeds.get(self.last) if self.last is not None else None
        return seed if seed is not None else host_seed(rng)

    def add(self, full: Any, cap: Any) -> None:
        """Register an installed capture under its cache key ``full`` (a capture with no draw: nothing)."""
        plan = cap.draws
        if plan is None or not plan.guards:
            return
        base = full.base if isinstance(full, OutcomeKey) else full
        entries = self.plans.setdefault(base, [])
        if all(f != full for f, _ in entries):
            entries.append((full, plan))

    @staticmethod
    def holds(cap: Any, seed: int | None) -> bool:
        """Whether ``cap`` is the capture of a call seeded ``seed`` (its guards all hold; a capture with no guard:
        always)."""
        plan = cap.draws
        if plan is None or not plan.guards:
            return True
        return seed is not None and plan.outcome(seed) == plan.results
