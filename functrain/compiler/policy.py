"""When compiling pays: the compile policy, one pure function (:func:`decide`).

A background compile (:mod:`functrain.compiler.background`) costs CPU time and gains only the steps that run
compiled after it is ready. A tiered JIT compiles a method once its invocation counter says it is hot; a training
run knows more: how many steps are left, how long an eager step takes (measured over the first few), how many
cores the machine has and how many ranks use them, and (from this machine's history, :mod:`functrain.compiler.
history`) how long graphs like this one took to compile here and how fast the compiled step then ran.

The model, in seconds of the run's wall time (``C``: the compile's predicted CPU seconds; ``e``: the eager step;
``c = e x ratio``: the compiled step; ``n``: steps left; ``busy``: the ranks of this machine, or the load average
when other work keeps more cores busy):

* **a spare core** (``cores - busy >= 1``): the compile runs on it at a low priority; it is ready after ``C``
  seconds, during which ``C / e`` steps run eagerly; the run loses only the switch's load (``load_s``).
* **no spare core**: the compile takes its ``C`` CPU seconds from the cores the ranks use, and ranks that step
  together wait for the slowest: the run loses about ``C`` (plus the load); it is ready after its share of the
  cores, ``C x (busy + 1) / cores`` seconds.
* the gain: ``max(0, n - steps while compiling) x (e - c)``; it compiles when the gain exceeds the cost.

Several ranks decide once, together: each puts its own inputs in a vote (:func:`vote`), the ranks take the
elementwise least of their votes (one host all-reduce, MIN), and every rank decides from the same inputs, the
ranks' combined (:func:`combine`, :func:`from_vote`): the slowest rank's eager step, the largest predicted
compile, the fewest cores and the most load any rank sees, the fewest steps left. One decision, one set of
numbers, on every rank.

An unknown run length (a plain call of the compiled step, ``ft.run`` over an iterator without ``len``) compiles,
as before. ``FUNCTRAIN_COMPILE_POLICY`` (:mod:`functrain.compiler.settings`) forces it either way: ``always`` or
``never``; ``switch_at=`` forces a compile too (the switch step waits for it).
"""
from __future__ import annotations

import math
from typing import NamedTuple

__all__ = ["Inputs", "Decision", "decide", "combine", "vote", "from_vote", "VOTE_SIZE", "FORCES", "PRECOMPILE_HINT",
           "DECIDE_AFTER"]

FORCES = ("auto", "always", "never")
DECIDE_AFTER = 3
"""Eager steps measured before the decision (the first is not timed: it pays the imports and the trace)."""
PRECOMPILE_HINT = ("compile it ahead once with `cstep.precompile(state, batch)` (a Trainer: "
                   "`trainer.precompile()`; examples/diffusion.py: `--precompile`) and "
                   "later runs start compiled")


class Inputs(NamedTuple):
    """What :func:`decide` decides from (every field is in the run's metrics with the decision).

    Attributes:
        remaining: steps left in the run (``None``: unknown).
        eager_s: the measured eager step, seconds.
        compile_cpu_s: the compile's predicted CPU seconds (history, or the default).
        compiled_ratio: the compiled step's predicted time as a fraction of the eager step's (``0 < r``).
        cores: the cores this process may run on (``os.sched_getaffinity``).
        busy: the ranks of this run on this machine (each keeps a core busy).
        load: the machine's 1-minute load average (other work counts as busy cores too).
        force: ``"auto"``, ``"always"`` or ``"never"`` (``FUNCTRAIN_COMPILE_POLICY``).
        load_s: the switch's load of the compiled code on the training thread, seconds.
        source: where the predictions came from: ``"history"`` or ``"default"``.
    """

    remaining: int | None
    eager_s: float
    compile_cpu_s: float
    compiled_ratio: float
    cores: int
    busy: int = 1
    load: float = 0.0
    force: str = "auto"
    load_s: float = 1.0
    source: str = "default"


class Decision(NamedTuple):
    """What :func:`decide` answers.

    Attributes:
        compile: whether to compile (in the background, now).
        spare: whether a core beyond the busy ones was free for the compile (it then runs at a low priority).
        ready_s: predicted seconds until the compiled code is ready.
        cost_s: predicted seconds the run loses to the compile.
        gain_s: predicted seconds the compiled steps save in this run.
        why: the decision in words (said once on the console).
        inputs: the :class:`Inputs`.
    """

    compile: bool
    spare: bool
    ready_s: float
    cost_s: float
    gain_s: float
    why: str
    inputs: Inputs

    def record(self) -> dict:
        """The decision and its inputs as plain values (a ``metrics.jsonl`` field)."""
        i = self.inputs
        return {"compile": self.compile, "spare_core": self.spare, "ready_s": round(self.ready_s, 3),
                "cost_s": round(self.cost_s, 3), "gain_s": round(self.gain_s, 3), "why": self.why,
                "remaining": i.remaining, "eager_s": round(i.eager_s, 6), "compile_cpu_s": round(i.compile_cpu_s, 3),
                "compiled_ratio": round(i.compiled_ratio, 4), "cores": i.cores, "busy": i.busy,
                "load": round(i.load, 2), "force": i.force, "source": i.source}


def _check(inputs: Inputs) -> None:
    def bad(name: str, value: object, allowed: str) -> ValueError:
        return ValueError(f"compile policy: {name} must be {allowed}; got {value!r}")

    r = inputs.remaining
    if r is not None and (isinstance(r, bool) or not isinstance(r, int) or r < 0):
        raise bad("remaining", r, "an int >= 0 or None")
    for name, lo in (("eager_s", 0.0), ("compile_cpu_s", 0.0), ("load", 0.0), ("load_s", 0.0)):
        v = getattr(inputs, name)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < lo:
            raise bad(name, v, "a finite number >= 0")
    ratio = inputs.compiled_ratio
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not math.isfinite(ratio) or ratio <= 0:
        raise bad("compiled_ratio", ratio, "a finite number > 0")
    for name in ("cores", "busy"):
        v = getattr(inputs, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise bad(name, v, "an int >= 1")
    if inputs.force not in FORCES:
        raise bad("force", inputs.force, "one of " + ", ".join(map(repr, FORCES)))


def decide(inputs: Inputs) -> Decision:
    """Whether compiling pays in this run (see the module docstring for the model); bad inputs raise
    ``ValueError`` naming the value and what is allowed.

    Example::

        >>> from functrain.compiler.policy import Inputs, decide
        >>> short = decide(Inputs(remaining=400, eager_s=0.01, compile_cpu_s=60, compiled_ratio=0.5, cores=2, busy=2))
        >>> short.compile, short.why.split(";")[0]
        (False, 'compiling would not pay in this run: ~60 s to compile, ~0 s to gain')
        >>> decide(short.inputs._replace(remaining=100_000)).compile
        True
    """
    _check(inputs)
    i = inputs
    occupied = max(float(i.busy), i.load)
    spare = i.cores - occupied >= 1.0
    if spare:
        ready, cost = i.compile_cpu_s, i.load_s
    else:
        ready, cost = i.compile_cpu_s * (occupied + 1.0) / i.cores, i.compile_cpu_s + i.load_s
    per_step = i.eager_s * max(0.0, 1.0 - i.compiled_ratio)
    if i.remaining is None:
        gain = math.inf
    else:
        while_compiling = ready / i.eager_s if i.eager_s > 0 else math.inf
        gain = max(0.0, i.remaining - while_compiling) * per_step
    where = "on a spare core at a low priority" if spare else "on the cores the ranks use"
    if i.force == "always":
        return Decision(True, spare, ready, cost, gain, f"compiling {where}: forced (FUNCTRAIN_COMPILE_POLICY="
                        f"always)", i)
    if i.force == "never":
        return Decision(False, spare, ready, cost, gain, "not compiling: FUNCTRAIN_COMPILE_POLICY=never", i)
    if i.remaining is None:
        return Decision(True, spare, ready, cost, gain, f"compiling {where}: the run's length is unknown", i)
    if gain > cost:
        return Decision(True, spare, ready, cost, gain,
                        f"compiling {where}: ~{ready:.0f} s to compile, ~{gain:.0f} s to gain in the "
                        f"{i.remaining} steps left", i)
    return Decision(False, spare, ready, cost, gain,
                    f"compiling would not pay in this run: ~{i.compile_cpu_s:.0f} s to compile, ~{gain:.0f} s "
                    f"to gain; training eagerly; {PRECOMPILE_HINT}", i)


# A vote is a tuple of floats whose elementwise least over the ranks is the vote of the combined inputs: a field
# combined by its largest value is negated. Unknown steps left (None) count as -1: fewest wins, so any rank's
# unknown length makes the run's unknown. The force's index: "never" wins over "always" over "auto".
_SOURCES = ("default", "history")
VOTE_SIZE = 10
"""The length of a :func:`vote`."""


def combine(inputs: "list[Inputs] | tuple[Inputs, ...]") -> Inputs:
    """The run's inputs from each rank's: the fewest steps left (unknown if any rank's is), the slowest eager step,
    the largest predicted compile, ratio and load time, the fewest cores, the most ranks and load, the strongest
    force (``never`` over ``always`` over ``auto``), and ``"history"`` only if every rank's predictions came from
    its history. What :func:`from_vote` gives for the least of the ranks' votes.

    Example::

        >>> from functrain.compiler.policy import Inputs, combine
        >>> a = Inputs(remaining=400, eager_s=0.01, compile_cpu_s=30, compiled_ratio=0.5, cores=2, busy=2)
        >>> combine([a, a._replace(eager_s=0.02, compile_cpu_s=20)])[1:3]
        (0.02, 30)
    """
    if not inputs:
        raise ValueError("combine: no inputs (at least one rank's are needed)")
    for i in inputs:
        _check(i)
    left = [i.remaining for i in inputs]
    return Inputs(remaining=None if None in left else min(left), eager_s=max(i.eager_s for i in inputs),
                  compile_cpu_s=max(i.compile_cpu_s for i in inputs),
                  compiled_ratio=max(i.compiled_ratio for i in inputs), cores=min(i.cores for i in inputs),
                  busy=max(i.busy for i in inputs), load=max(i.load for i in inputs),
                  force=FORCES[max(FORCES.index(i.force) for i in inputs)], load_s=max(i.load_s for i in inputs),
                  source=_SOURCES[min(_SOURCES.index(i.source) for i in inputs)])


def vote(inputs: Inputs) -> tuple:
    """This rank's inputs as a vote: :data:`VOTE_SIZE` floats whose elementwise least over the ranks is what
    :func:`from_vote` turns into :func:`combine` of their inputs. A rank with no inputs to give votes
    ``(inf,) * VOTE_SIZE`` (it leaves the others' as they are)."""
    _check(inputs)
    if inputs.source not in _SOURCES:
        raise ValueError(f"compile policy: source must be one of {', '.join(map(repr, _SOURCES))}; got "
                         f"{inputs.source!r}")
    i = inputs
    return (-1.0 if i.remaining is None else float(i.remaining), -float(i.eager_s), -float(i.compile_cpu_s),
            -float(i.compiled_ratio), float(i.cores), -float(i.busy), -float(i.load), -float(FORCES.index(i.force)),
            -float(i.load_s), float(_SOURCES.index(i.source)))


def from_vote(least: "tuple | list") -> Inputs:
    """The inputs a least vote stands for (see :func:`vote`); ``ValueError`` if no rank voted (a field is
    infinite) or the vote has another length."""
    v = [float(x) for x in least]
    if len(v) != VOTE_SIZE or not all(math.isfinite(x) for x in v):
        raise ValueError(f"compile policy: a vote is {VOTE_SIZE} finite numbers (some rank's inputs); got {least!r}")
    remaining = None if v[0] < 0 else int(v[0])
    return Inputs(remaining=remaining, eager_s=-v[1], compile_cpu_s=-v[2], compiled_ratio=-v[3], cores=int(v[4]),
                  busy=int(-v[5]), load=-v[6], force=FORCES[int(-v[7])], load_s=-v[8], source=_SOURCES[int(v[9])])
