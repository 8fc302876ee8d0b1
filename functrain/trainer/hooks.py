"""The Trainer's user hooks: ``on_log``, ``on_save``, ``on_eval``, ``should_stop``: arguments or callback objects."""
from __future__ import annotations

from typing import Any, Callable, Iterable

from ..core.validate import describe

__all__ = ["Callback", "Hooks"]

NAMES = ("on_log", "on_save", "on_eval", "should_stop")


class Callback:
    """A base for callback objects given to ``Trainer(callbacks=[...])``; override any of the methods.

    * ``on_log(step, metrics)``: every log step, on every process, with the host metrics (floats) that go
      to the trackers (the same on every process but for timings).
    * ``on_eval(step, metrics)``: after each evaluation, on every process (``eval_loss``, ...).
    * ``on_save(step, path)``: on rank 0, after a checkpoint (and its samples) is written.
    * ``should_stop(step, metrics) -> bool``: asked with the metrics of each log step and evaluation; a
      true answer on any process stops every process (agreed like SIGTERM), saving first.

    The constructor takes no arguments; the methods not overridden do nothing (``should_stop``:
    ``False``). Any object with at least one of these methods is accepted too.

    Example::

        >>> import functrain as ft
        >>> class EarlyStop(ft.Callback):
        ...     best = float("inf")
        ...
        ...     def should_stop(self, step, metrics):
        ...         if "eval_loss" not in metrics:
        ...             return False
        ...         worse = metrics["eval_loss"] > self.best
        ...         self.best = min(self.best, metrics["eval_loss"])
        ...         return worse
        >>> stop = EarlyStop()
        >>> [stop.should_stop(s, {"eval_loss": l}) for s, l in ((100, 0.5), (200, 0.4), (300, 0.45))]
        [False, False, True]
    """

    def on_log(self, step: int, metrics: dict) -> None:
        """Called every log step, on every process.

        Args:
            step: the number of steps taken.
            metrics: ``{name: float}``, the host metrics that go to the trackers.

        Returns:
            ``None``.
        """
        pass

    def on_eval(self, step: int, metrics: dict) -> None:
        """Called after each evaluation, on every process.

        Args:
            step: the number of steps taken.
            metrics: ``{name: float}`` of the evaluation (``eval_loss``, ...).

        Returns:
            ``None``.
        """
        pass

    def on_save(self, step: int, path: str) -> None:
        """Called on rank 0 after a checkpoint (and its samples) is written.

        Args:
            step: the checkpoint's step.
            path: the checkpoint folder.

        Returns:
            ``None``.
        """
        pass

    def should_stop(self, step: int, metrics: dict) -> bool:
        """Asked with the metrics of each log step and evaluation; a true answer on any process stops every process.

        Args:
            step: the number of steps taken.
            metrics: the log step's or the evaluation's ``{name: float}``.

        Returns:
            ``True`` to stop (saving first); the base class says ``False``.
        """
        return False


class Hooks:
    """The callables registered for each hook, called in order (constructor arguments first)."""

    def __init__(self, callbacks: Iterable[Any] = (), **functions: Callable | None):
        self.table: dict[str, list[Callable]] = {name: [] for name in NAMES}
        for name, fn in functions.items():
            if fn is None:
                continue
            if not callable(fn):
                raise TypeError(f"Trainer({name}=...) must be callable; got {describe(fn)[:200]}")
            self.table[name].append(fn)
        if isinstance(callbacks, Callback) or not isinstance(callbacks, (list, tuple)):
            raise TypeError(f"Trainer(callbacks=...) takes a list of callback objects (with any of {NAMES}); got "
                            f"{describe(callbacks)[:200]}")
        for i, cb in enumerate(callbacks):
            found = [n for n in NAMES if callable(getattr(cb, n, None))]
            if not found:
                raise TypeError(f"Trainer(callbacks=...)[{i}] has none of the hook methods {NAMES}; got "
                                f"{describe(cb)[:200]}")
            for n in found:
                self.table[n].append(getattr(cb, n))

    def call(self, name: str, *args: Any) -> None:
        for fn in self.table[name]:
            fn(*args)

    def stop(self, step: int, metrics: dict) -> bool:
        """Whether any ``should_stop`` says so (each is asked)."""
        answers = [bool(fn(step, metrics)) for fn in self.table["should_stop"]]
        return any(answers)
