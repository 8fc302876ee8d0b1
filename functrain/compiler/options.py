"""What ``ft.compile`` was asked for, checked once: one frozen :class:`Options` and one table of what combines.

Every choice of :func:`functrain.compile` lands here. :data:`RULES` is the only place that
says which choices need which others; :meth:`Options.check` applies it once, when the
compiled step is made, and names the choices that conflict. The rest of the compiler
reads the derived properties (:attr:`Options.path`, :attr:`Options.cuda_graphs`) and never
re-checks a combination.

Example::

    >>> from functrain.compiler.options import Options
    >>> Options().path, Options(fullgraph=False).path
    ('direct', 'dynamo')
    >>> Options(package=True, backend="aot_eager")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: ft.compile(package=True) compiles with AOTInductor's defaults: it takes no backend=, ...
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable, NamedTuple

from ..core.validate import check_choice, check_int

__all__ = ["Options", "RULES", "CAPTURES"]

CAPTURES = ("auto", "direct", "dynamo")
"""``capture=``: ``"auto"`` (the direct path when the other choices allow it), ``"direct"`` (insist on it),
``"dynamo"`` (``torch.compile``'s frame on every call)."""

_INDUCTOR = (None, "inductor")


@dataclasses.dataclass(frozen=True)
class Options:
    """The choices of one :func:`functrain.compile` call (see its docstring for each).

    Attributes:
        donate: the call writes the new state into the input state's buffers.
        fullgraph, dynamic, backend, mode, options: as for ``torch.compile``.
        capture: one of :data:`CAPTURES`.
        cache_dir: the folder of the compile caches and packages, or ``None``.
        package: compile each graph ahead of time into a package kept in ``cache_dir`` (``None``: functrain's
            private folder).
        extra: any other ``torch.compile`` keyword arguments (they need the Dynamo path).
        background: ``True``: compile off the training thread, run eagerly until the compiled code is ready
            (:mod:`functrain.compiler.background`); ``False``: the first call compiles and waits; ``None``
            (the default): the caller decides (``ft.run`` and ``ft.Trainer``: background; a direct call: waits).
        switch_at: switch to the compiled code at the call whose input state has taken this many steps (waiting
            there if the compile is late): the reproducible form of ``background``, which it implies.
        reuse_blocks: trace each repeated block of a functionalized module once and reuse it
            (:mod:`functrain.core.regions`); ``False`` (the default): trace the step flat (regions cut compile
            time at depth, 0.67x at 32 layers, but the steady step ran 17-48 % slower: bench/README.md).
    """

    donate: bool = False
    fullgraph: bool = True
    backend: Any = None
    mode: str | None = None
    options: Any = None
    dynamic: bool | None = None
    capture: str = "auto"
    cache_dir: Any = None
    package: bool = False
    extra: Any = dataclasses.field(default_factory=dict)
    background: bool | None = None
    switch_at: int | None = None
    reuse_blocks: bool = False

    def __post_init__(self) -> None:
        if self.capture == "flat":  # the old name of "direct" ("flat" is the flat *state*, ft.flat)
            warnings.warn("ft.compile(capture='flat') is now capture='direct'", DeprecationWarning, stacklevel=4)
            object.__setattr__(self, "capture", "direct")
        check_choice("capture", self.capture, CAPTURES)
        check_choice("background", self.background, (None, True, False))
        check_choice("reuse_blocks", self.reuse_blocks, (True, False))
        object.__setattr__(self, "donate", bool(self.donate))
        if self.switch_at is not None:
            check_int("ft.compile: switch_at", self.switch_at, minimum=0,
                      what="an int >= 0 (the step count at which the compiled code takes over) or None")
        self.check()

    # -- derived --------------------------------------------------------------------------------
    @property
    def cuda_graphs(self) -> bool:
        """``mode="reduce-overhead"``: CUDA graphs (functrain's on the direct path, inductor's on Dynamo's)."""
        return self.mode == "reduce-overhead"

    @property
    def direct_ok(self) -> bool:
        """Whether the direct path can serve these choices (it cannot break graphs, trace dynamic shapes,
        take other torch.compile arguments, or graph an undonated state)."""
        return self.fullgraph and not self.dynamic and not self.extra and (self.donate or not self.cuda_graphs)

    @property
    def path(self) -> str:
        """``"direct"`` (trace once, call the compiled code on flat leaves) or ``"dynamo"``."""
        return "direct" if self.direct_ok and self.capture != "dynamo" else "dynamo"

    def in_background(self, default: bool = False) -> bool:
        """Whether a call path compiles in the background: ``background``, else (``None``) ``default``
        (what the caller prefers: ``ft.run`` passes ``True``); never on the Dynamo path."""
        if self.path != "direct":
            return False
        if self.switch_at is not None:
            return True
        return default if self.background is None else self.background

    def replace(self, **changes: Any) -> "Options":
        """A copy with ``changes`` (checked again)."""
        return dataclasses.replace(self, **changes)

    def check(self) -> None:
        """Raise the first rule of :data:`RULES` these choices break."""
        for rule in RULES:
            if rule.applies(self) and not rule.holds(self):
                raise ValueError(rule.message(self))


class Rule(NamedTuple):
    """One line of :data:`RULES`: when ``applies(options)``, ``holds(options)`` must be true, else
    ``message(options)`` is the error."""

    applies: Callable[[Options], bool]
    holds: Callable[[Options], bool]
    message: Callable[[Options], str]


def _given(o: Options) -> str:
    return (f"fullgraph={o.fullgraph!r}, dynamic={o.dynamic!r}, mode={o.mode!r}, donate={o.donate!r}, "
            f"capture={o.capture!r}, extra={sorted(o.extra)}")


RULES: tuple[Rule, ...] = (
    Rule(lambda o: o.mode is not None or o.options is not None,
         lambda o: o.backend in _INDUCTOR,
         lambda o: f"ft.compile: mode/options apply to the inductor backend only; got backend={o.backend!r}"),
    Rule(lambda o: o.capture == "direct",
         lambda o: o.direct_ok,
         lambda o: "ft.compile: capture='direct' needs fullgraph=True, static shapes, donate=True with mode="
                   f"'reduce-overhead', and no extra torch.compile arguments; got {_given(o)}"),
    Rule(lambda o: o.background or o.switch_at is not None,
         lambda o: o.path == "direct",
         lambda o: "ft.compile(background=True / switch_at=) compiles the direct capture off the training thread; "
                   "it needs fullgraph=True, static shapes, no extra torch.compile arguments, capture='auto' or "
                   f"'direct' (with mode='reduce-overhead', donate=True); got {_given(o)}"),
    Rule(lambda o: o.switch_at is not None,
         lambda o: o.background is not False,
         lambda o: f"ft.compile(switch_at={o.switch_at}) is when a background compile takes over; background=False "
                   f"compiles before the first step: drop one of them"),
    Rule(lambda o: o.package,
         lambda o: o.path == "direct",
         lambda o: "ft.compile(package=True) needs the direct capture (fullgraph=True, static shapes, no extra "
                   "torch.compile arguments, capture='auto' or 'direct'; with mode='reduce-overhead', "
                   f"donate=True); got {_given(o)}"),
    Rule(lambda o: o.package,
         lambda o: o.backend in _INDUCTOR and not o.options and o.mode in (None, "default", "reduce-overhead"),
         lambda o: "ft.compile(package=True) compiles with AOTInductor's defaults: it takes no backend=, options= "
                   f"or mode= other than 'reduce-overhead'; got backend={o.backend!r}, options={o.options!r}, "
                   f"mode={o.mode!r}"),
)
"""What combines with what: each rule says, for the choices it applies to, what else must hold."""
