"""``python -m functrain.bench module:make_step``: benchmark your own step from the command line.

``make_step()`` (any name after the colon) returns ``(step, state, batch)``: a :class:`~functrain.Step` (or a
:class:`~functrain.CompiledStep`), the state to start from and a batch. ``module`` is an importable module
(the current folder is searched first) or a ``.py`` file. The report goes to stdout (``--json``: the JSON of
:meth:`functrain.bench.Report.to_dict`, nothing else), progress and warnings to stderr. Exit status 0, or 2 for
bad usage (a message naming what was wrong).

    python -m functrain.bench train:make_step
    python -m functrain.bench train.py:make_step --steps 50 --rounds 10 --json > bench.json
    python -m functrain.bench train:make_step --cold --backend aot_eager
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import shutil
import sys
import tempfile
from typing import Any, Callable

__all__ = ["main", "load"]


class UsageError(Exception):
    """A bad argument of the command (exit status 2)."""


def _positive(text: str) -> int:
    return _int(text, 1)


def _natural(text: str) -> int:
    return _int(text, 0)


def _int(text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"{value} is less than {minimum}")
    return value


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from .timing import VARIANTS

    p = argparse.ArgumentParser(prog="python -m functrain.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("target", help="module:function (or path/to/file.py:function) returning (step, state, batch)")
    p.add_argument("--steps", type=_positive, default=20, help="calls of each variant per round (default 20)")
    p.add_argument("--rounds", type=_positive, default=5, help="timed rounds (default 5)")
    p.add_argument("--warmup", type=_natural, default=2, help="untimed calls of each variant after its first "
                                                              "(default 2)")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated subset of {','.join(VARIANTS)} (default all)")
    p.add_argument("--backend", default=None, help="ft.compile's backend (default inductor; aot_eager: no C++)")
    p.add_argument("--cold", action="store_true", help="compile from an empty cache (a temporary cache_dir, removed "
                                                       "at the end), then again from it (warm)")
    p.add_argument("--no-memory", action="store_true", help="skip the memory estimate and the allocator's count")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    return p.parse_args(argv)


def load(target: str) -> Callable[[], Any]:
    """The function ``module:function`` (or ``file.py:function``) names; :class:`UsageError` naming what is not
    there."""
    module_name, sep, attr = target.rpartition(":")
    if not sep or not module_name or not attr:
        raise UsageError(f"target {target!r} must be module:function (or path/to/file.py:function), e.g. "
                         f"train:make_step")
    if module_name.endswith(".py") or os.sep in module_name:
        if not os.path.isfile(module_name):
            raise UsageError(f"target {target!r}: no file {module_name!r}")
        spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(module_name))[0],
                                                      module_name)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        if "" not in sys.path and os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            if error.name != module_name and not module_name.startswith(f"{error.name}."):
                raise  # (a module it imports is missing: its own error)
            raise UsageError(f"target {target!r}: no module named {module_name!r} (from the current folder "
                             f"{os.getcwd()!r} or the installed packages)") from None
    fn = vars(module).get(attr)
    if not callable(fn):
        raise UsageError(f"target {target!r}: module {module_name!r} has no function {attr!r}")
    return fn


def main(argv: list[str] | None = None) -> int:
    """``python -m functrain.bench module:make_step [options]``: benchmark the step ``make_step()`` returns and print
    the report (``--json``: as JSON); the exit status (2: bad usage)."""
    args = parse_args(argv)
    from ..compiler.api import CompiledStep
    from ..core.state import TrainState
    from ..core.step import Step
    from .timing import VARIANTS, benchmark

    try:
        variants = [v.strip() for v in args.variants.split(",") if v.strip()]
        bad = [v for v in variants if v not in VARIANTS]
        if bad or not variants:
            raise UsageError(f"--variants {args.variants!r}: each must be one of {','.join(VARIANTS)}")
        made = load(args.target)()
        if not isinstance(made, (tuple, list)) or len(made) != 3:
            raise UsageError(f"{args.target}() must return (step, state, batch); it returned "
                             f"{type(made).__name__}" + (f" of {len(made)}" if isinstance(made, (tuple, list)) else ""))
        if not isinstance(made[0], (Step, CompiledStep)):
            raise UsageError(f"{args.target}() must return (step, state, batch) with step a functrain Step or "
                             f"CompiledStep; its first item is a {type(made[0]).__name__}")
        if not isinstance(made[1], TrainState):
            raise UsageError(f"{args.target}() must return (step, state, batch) with state a TrainState "
                             f"(step.init(...)); its second item is a {type(made[1]).__name__}")
    except UsageError as error:
        print(f"python -m functrain.bench: {error}", file=sys.stderr)
        return 2
    step, state, batch = made
    kwargs = {"compile_kwargs": {"backend": args.backend}} if args.backend is not None else {}
    folder = tempfile.mkdtemp(prefix="functrain-bench-cache-") if args.cold else None
    try:
        report = benchmark(step, state, batch, steps=args.steps, rounds=args.rounds, warmup=args.warmup,
                           variants=variants, cold=folder or False, memory=not args.no_memory, **kwargs)
    finally:
        if folder is not None:  # the cold cache this process made: nothing else uses it
            shutil.rmtree(folder, ignore_errors=True)
    print(report.to_json() if args.json else report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
