"""The run's compile budget: what the compile policy weighs, gathered in one place, and its answers.

:func:`functrain.compiler.policy.decide` is a pure function of its :class:`~functrain.compiler.policy.Inputs`. A
:class:`Budget` is the one caller: it counts the run's eager calls and times them (after the first, which pays the
imports and the trace), knows how many steps the run has left (:meth:`Budget.expect`), reads this machine's
compile history (:mod:`functrain.compiler.history`) once, and its cores, ranks and load when it judges. It answers
the background compiler (:mod:`functrain.compiler.background`): whether to wait before judging
(:meth:`Budget.waits`), what this process knows for the decision (:meth:`Budget.inputs`, which the ranks
combine), and the decision on the run's combined inputs (:meth:`Budget.decide`: a
:class:`~functrain.compiler.policy.Decision`, compile or decline). It records what the run measured into the
history (:meth:`Budget.record_compile`, :meth:`Budget.record_rates`).

Example::

    >>> from functrain.compiler.budget import Budget
    >>> b = Budget(policy="never", mode=None)
    >>> b.expect(100)
    >>> d = b.decide(b.inputs(None))
    >>> d.compile, d.why, b.decision is d
    (False, 'not compiling: FUNCTRAIN_COMPILE_POLICY=never', True)
"""
from __future__ import annotations

import os
from typing import Any

import optree
import torch

from .policy import DECIDE_AFTER, Decision, Inputs, decide

__all__ = ["Budget"]

_TIMED = 64  # eager calls timed at most (their median is the policy's eager step)


class Budget:
    """The run's compile budget (see the module docstring). ``policy``: ``"auto"``, ``"always"`` or ``"never"``;
    ``mode``: inductor's mode (part of a graph's kind in the history).

    Attributes:
        total: the calls the run makes in all (``None``: unknown), from :meth:`expect`.
        done: eager calls made.
        decision: this process's first decision (its inputs and words), or ``None``.
    """

    def __init__(self, policy: str, mode: Any):
        self.policy, self.mode = policy, mode
        self.total: int | None = None
        self.done = 0
        self.decision: Decision | None = None
        self._timed: list[float] = []
        self._history: Any = None
        self._kind_seen = "cpu:default"  # the kind of the graph that last switched (the history's key)

    def expect(self, steps: int | None) -> None:
        """The caller's run has ``steps`` steps left (``None``: unknown)."""
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 0):
            raise ValueError(f"expect: steps must be an int >= 0 or None; got {steps!r}")
        self.total = None if steps is None else self.done + steps

    def eager_call(self, seconds: float) -> None:
        """One eager call took ``seconds`` (the first is counted, not timed)."""
        self.done += 1
        if self.done > 1 and len(self._timed) < _TIMED:
            self._timed.append(seconds)

    @property
    def measured(self) -> bool:
        """Whether enough eager calls were timed to judge (:data:`~functrain.compiler.policy.DECIDE_AFTER`), or the
        run's length is unknown (nothing to weigh: judged at once)."""
        return self.total is None or len(self._timed) >= DECIDE_AFTER

    def untraced(self, state: Any, compiler_imported: bool) -> Any:
        """Before anything is imported or traced (a run of known length, a machine whose history has no compile
        of this kind): the history's cheapest prediction for ``state``'s kind, or ``None`` (judge the trace)."""
        if self.total is None or compiler_imported:
            return None
        from .history import kind_of
        leaves = [x for x in optree.tree_leaves(state) if isinstance(x, torch.Tensor)]
        device = leaves[0].device if leaves else None
        return self.history().untraced(kind_of(((None, None, None, device),), self.mode))

    def waits(self, bound: Any) -> bool:
        """With an untraced ``bound``: whether to wait for more timed calls before judging it."""
        return bound is not None and len(self._timed) < DECIDE_AFTER

    def inputs(self, cap: Any, bound: Any = None) -> Inputs:
        """What this process knows now for the policy, of a graph traced as ``cap`` (``None``: not traced; then from
        ``bound``, a history prediction, or for the forced ``never``): its :class:`~functrain.compiler.policy.
        Inputs` (the ranks combine theirs: :func:`~functrain.compiler.policy.combine`)."""
        if cap is not None:
            cpu_s, ratio, source = self.history().predict(self.kind(cap), len(cap.gm.graph.nodes))
        elif bound is not None:  # no graph yet: the cheapest compile a new machine predicts
            cpu_s, ratio, source = bound
        else:  # (forced never: nothing traced)
            cpu_s, ratio, source = 1.0, 1.0, "default"
        timed = sorted(self._timed)
        eager_s = timed[len(timed) // 2] if timed else 0.0
        remaining = None if self.total is None else max(self.total - self.done, 0)
        return Inputs(remaining, eager_s, cpu_s, ratio, _cores(), _busy(), _load(), self.policy, 1.0, source)

    def decide(self, inputs: Inputs, final: bool = True) -> Decision:
        """The policy's decision on ``inputs`` (the run's, combined over its ranks); the run's first final one is
        :attr:`decision`: a decline, or a compile with ``final`` (a compile judged before the trace is not: the
        traced graph is judged again)."""
        d = decide(inputs)
        if (final or not d.compile) and self.decision is None:
            self.decision = d
        return d

    def kind(self, cap: Any) -> str:
        """The history's kind of a capture (its device and inductor mode)."""
        from .history import kind_of
        return kind_of(cap.metas if cap is not None else (), self.mode)

    def history(self) -> Any:
        """This machine's compile history (:class:`~functrain.compiler.history.History`), read once."""
        if self._history is None:
            from .history import History
            self._history = History.beside_caches()
        return self._history

    def switched(self, cap: Any) -> None:
        """A graph's code was installed: its kind keys the run's step times (:meth:`record_rates`)."""
        self._kind_seen = self.kind(cap)

    def record_compile(self, cap: Any, cpu_s: float | None) -> None:
        """A compile this process's worker made took ``cpu_s`` CPU seconds: into this machine's history."""
        if cpu_s is not None and cap is not None and cpu_s > 0:
            self.history().add_compile(self.kind(cap), len(cap.gm.graph.nodes), cpu_s)

    def record_rates(self, eager_s: float | None, compiled_s: float | None, lead: bool) -> None:
        """The run's measured eager and compiled step times, into the history when both are known (``lead``: by
        the machine's local rank 0 only)."""
        if eager_s and compiled_s and eager_s > 0 and compiled_s > 0 and lead:
            self.history().add_steps(self._kind_seen, eager_s, compiled_s)


def _cores() -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(cores, 1)


def _busy() -> int:
    try:
        return max(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), 1)
    except ValueError:
        return 1


def _load() -> float:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return 0.0
