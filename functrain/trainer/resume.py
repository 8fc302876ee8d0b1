"""What a resumed run trains with: the checkpoint's state, with the configuration's hyper-parameters.

A checkpoint holds the hyper-parameters it trained with (they are data in the state: :mod:`functrain.core.hyper`).
A run resumed with other numbers (``--steps 4000`` after 400, another lr or warm-up) trains with the numbers it
was given, as a fresh run with them would at that step: the schedule continues to the new horizon from the step
the checkpoint holds (it is not restarted, and the old horizon is not kept). The compiled step is the same graph
(the values are its inputs), so nothing compiles again. The resume line says which values changed.
"""
from __future__ import annotations

from typing import Any, NamedTuple

from ..core.hyper import copy_hyper, holders, hyper_changes

__all__ = ["ResumedHyper", "resume_hyper"]


class ResumedHyper(NamedTuple):
    """The state to train on and what the resume line adds about its hyper-parameters ("" when none changed)."""
    state: Any
    line: str


def resume_hyper(restored: Any, fresh: Any, step: int) -> ResumedHyper:
    """``restored`` (a checkpoint's state at ``step``) with every hyper-parameter taken from ``fresh`` (this run's
    initial state, built from its configuration), and the words for the resume line.

    Example::

        >>> import torch, functrain as ft
        >>> opt = lambda total: ft.optim.adamw(ft.optim.schedules.warmup_cosine(1e-3, 10, total_steps=total))
        >>> step = lambda total: ft.train_step(lambda p, b, x: (p["w"] * x).sum(), opt(total))
        >>> old = step(400).init({"w": torch.ones(1)})
        >>> got = resume_hyper(old, step(4000).init({"w": torch.ones(1)}), 400)
        >>> float(ft.get_hyper(got.state)["lr"]["warmup_cosine"]["total_steps"])
        4000.0
        >>> print(got.line)
        ; the lr schedule and hyper-parameters continue from step 400 with this run's values (lr.warmup_cosine.total_steps 400 -> 4000)
    """
    if not holders(fresh):
        return ResumedHyper(restored, "")  # (a user's step holding no hyper-parameters as data: nothing to take)
    changes = hyper_changes(restored, fresh)
    state = copy_hyper(restored, fresh)
    if not changes:
        return ResumedHyper(state, "")
    what = ", ".join(f"{k} {_num(a)} -> {_num(b)}" for k, (a, b) in changes.items())
    part = "the lr schedule and hyper-parameters" if any(k.startswith("lr") for k in changes) else "hyper-parameters"
    return ResumedHyper(state, f"; {part} continue from step {step} with this run's values ({what})")


def _num(x: Any) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)
