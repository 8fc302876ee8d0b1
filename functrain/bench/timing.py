"""``ft.benchmark``: time a step eager, compiled and as the loop's donating call, interleaved, after warming each.

See :func:`benchmark`. The pieces: :mod:`.stats` (medians, spreads, paired ratios), :mod:`.syncs` (host syncs
under a dispatch mode), :mod:`.phases` (a compile's time by phase), :mod:`.recompiles` (what changed when a runner
captured again), :mod:`.report` (the table and the JSON).
"""
from __future__ import annotations

import contextlib
import datetime
import gc
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Callable

import optree
import torch

from ..compiler.api import CompiledStep, compile
from ..compiler.estimate import allocated_peak
from ..compiler.estimate import memory as estimate_memory
from ..compiler.dynamo_runner import DynamoRunner
from ..compiler.runtime import Runner
from ..core.state import TrainState
from ..core.step import Step
from ..core.validate import BadValue, check_int, describe
from . import phases as phases_
from .recompiles import describe as describe_changes
from .recompiles import signature_changes
from .report import Report, VariantResult
from .stats import bootstrap_ci, paired_ratios, spread
from .syncs import SyncCounter

__all__ = ["benchmark", "VARIANTS"]

# what each variant times
VARIANTS = {"eager": "step(state, batch)", "compiled": "cstep.runner()", "donating": "cstep.runner(donate=True)"}
_SYNC_CALLS = 2  # calls each variant makes under the sync counter


def benchmark(step: Step | CompiledStep, state: TrainState, batch: Any, *, steps: int = 20, warmup: int = 2,
              rounds: int = 5, variants: Sequence[str] = tuple(VARIANTS), batches: Sequence[Any] = (),
              compile_kwargs: Mapping[str, Any] | None = None, cold: bool | str | os.PathLike = False,
              memory: bool = True) -> Report:
    """Time ``step`` eager, compiled (plain calls) and compiled as ``ft.run`` calls it (donating), interleaved.

    What is measured, per variant (``variants``, any of ``"eager"``: ``step(state, batch)``, ``"compiled"``:
    ``cstep.runner()``, ``"donating"``: ``cstep.runner(donate=True)``, what ``ft.run`` runs, a graph of its own):

    1. **compile**, each compiled variant's first call: functrain's trace, then AOTAutograd, inductor, the kernels'
       compile and load, cache loads and the rest (:mod:`functrain.bench.phases`), with the caches' hits and
       misses, and the memory estimate of that trace (:func:`functrain.memory`). With ``cold=True`` the compiles
       start from an empty temporary ``cache_dir``, then each compiles again as a new ``ft.compile`` of the step
       in this process after inductor's in-memory caches are cleared, from the on-disk caches the first filled
       (``warm_compile``);
    2. **warm-up**: ``warmup`` more untimed calls each (at least one per extra batch, so that every signature is
       compiled before timing; each capture after the first is a recompile, recorded with what changed);
    3. **host syncs** per step (two calls under a dispatch mode counting ``aten._local_scalar_dense`` and the
       other ops that read a value to the host) and the **memory** one call allocates at once (torch's
       allocator, :func:`functrain.compiler.estimate.allocated_peak`);
    4. **timed rounds**: ``rounds`` rounds, each timing ``steps`` calls of every variant in turn (the order
       rotates each round), so drift and other load hit all variants alike; each variant carries its own state
       from call to call, and the calls cycle through ``[batch, *batches]``. Per variant: the median time per step
       and its spread; per round the ratio to eager in that round, then the ratios' median, spread and a
       bootstrap interval. Nothing compiles during the rounds unless an input changes signature there (counted).

    Args:
        step: a :class:`~functrain.Step`, compiled here (``ft.compile(step, **compile_kwargs)``), or a
            :class:`~functrain.CompiledStep`, whose step and options are compiled afresh (so its compile is
            timed), waiting for each compile (``background`` and ``switch_at`` are set aside).
        state: the state to start from (never written: a donating variant steps a copy).
        batch: the first batch (the one the compiles trace).
        steps: calls of each variant per round (>= 1).
        warmup: untimed calls of each variant after its first (>= 0).
        rounds: timed rounds (>= 1).
        variants: which to time, in this order.
        batches: more batches; the calls cycle through ``[batch, *batches]``.
        compile_kwargs: ``ft.compile``'s arguments for a plain ``Step`` (``backend="aot_eager"``, ``mode=...``).
        cold: ``True``: compile into an empty temporary ``cache_dir`` (left in place: the process's compiled code
            lives there), then again from it; a folder: compile into that one, which must be empty (or not exist
            yet). Needs a process that has not called ``ft.compile`` yet (the first one fixes inductor's
            process-wide cache folder): ``python -m functrain.bench ... --cold`` is one (it removes its folder).
        memory: estimate and measure each variant's memory (``False``: skip both, and the profiled call).

    Returns:
        A :class:`~functrain.bench.report.Report`: ``print(report)`` for the table, ``report.to_dict()`` or
        ``report.to_json()`` for every number, ``report["compiled"].ratio["median"]`` for one.

    Raises:
        TypeError, ValueError: a bad argument, named with what is allowed.

    Example::

        report = ft.benchmark(step, state, batch, steps=50, rounds=10)
        print(report)
        report["donating"].ratio["median"]     # the loop's call's time / eager's, median over paired rounds
    """
    names = _check(step, state, batch, steps=steps, warmup=warmup, rounds=rounds, variants=variants,
                   batches=batches, compile_kwargs=compile_kwargs, cold=cold, memory=memory)
    inner = step.step if isinstance(step, CompiledStep) else step
    all_batches = [batch, *batches]
    notes: list[str] = []
    compiled = any(n != "eager" for n in names)
    folder = None
    if cold is not False and compiled:
        folder = tempfile.mkdtemp(prefix="functrain-bench-cache-") if cold is True else os.fspath(cold)
    cstep = None
    if compiled:
        cstep = _compiled(step, compile_kwargs, folder)
        if folder is not None and not os.path.realpath(cstep.cache_dir or "").startswith(os.path.realpath(folder)):
            if cold is True:
                shutil.rmtree(folder, ignore_errors=True)
            raise RuntimeError(
                f"ft.benchmark(cold=True): this process already compiles into {cstep.cache_dir!r} (inductor's cache "
                f"folder is process-wide, fixed by the first ft.compile), so its compiles would not start from an "
                f"empty cache; run it in a fresh process that has not called ft.compile: python -m functrain.bench "
                f"module:make_step --cold, with make_step returning the Step, not ft.compile of it")
    device = _device(state)
    sync = _synchronize(device)

    results = {n: VariantResult(name=n, call=VARIANTS[n]) for n in names}
    calls: dict[str, Callable] = {}
    states: dict[str, Any] = {}
    runners: dict[str, Any] = {}
    for n in names:  # first calls: the compiles
        if n == "eager":
            calls[n], states[n] = inner, state
            t0 = time.perf_counter()
            states[n], _ = inner(state, batch)
            results[n].first_call_s = time.perf_counter() - t0
            continue
        runner = runners[n] = cstep.runner(donate=n == "donating", background=False)
        calls[n] = runner
        states[n], results[n] = _first_call(runner, state, batch, results[n], memory)
        if results[n].compile is None:
            notes.append(f"{n}: its first call compiled nothing: the graph was compiled already for another variant "
                         f"(a step compiled with donate=True donates in every runner: one graph serves both)")
    if folder is not None:
        for n in runners:
            results[n].warm_compile = _warm_compile(cstep, n, state, batch)
        notes.append(f"cold: the first compiles started from an empty cache_dir ({folder}); warm: each compiled "
                     f"again as a new ft.compile of the step in this process after torch._inductor.utils."
                     f"clear_caches() (inductor's in-memory caches), from the on-disk caches the first filled")

    cursor = 1
    extra = max(warmup, len(all_batches) - 1)
    for n in names:  # warm-up: every batch's signature compiled
        for j in range(extra):
            states[n], _ = calls[n](states[n], all_batches[(cursor + j) % len(all_batches)])
    cursor += extra
    for n in names:  # host syncs, then the memory one call allocates
        states[n], results[n].syncs_per_step, results[n].syncs_by_op = _syncs(
            calls[n], states[n], [all_batches[(cursor + j) % len(all_batches)] for j in range(_SYNC_CALLS)])
    cursor += _SYNC_CALLS
    if any(isinstance(r, DynamoRunner) for r in runners.values()):
        notes.append("the Dynamo path: host syncs are not counted (a dispatch mode changes what Dynamo runs) and "
                     "its trace is not timed apart (it is in 'other')")
    if memory:
        b = all_batches[cursor % len(all_batches)]
        for n in names:
            try:
                with _without_profiler_lines():
                    results[n].memory_measured, (states[n], _) = allocated_peak(calls[n], states[n], b)
            except Exception as error:  # noqa: BLE001 - a profiler that fails here is reported, the timing goes on
                notes.append(f"{n}: the allocator's peak could not be measured ({type(error).__name__}: {error})")
                states[n], _ = calls[n](states[n], b)
        cursor += 1

    pauses = {n: r.pauses for n, r in runners.items()}
    load_before = _load()
    cpu0, wall0 = time.process_time(), time.perf_counter()
    _rounds(names, calls, states, all_batches, results, steps=steps, rounds=rounds, cursor=cursor, sync=sync)
    cpu_share = (time.process_time() - cpu0) / max(time.perf_counter() - wall0, 1e-9)
    load_after = _load()
    for n, runner in runners.items():
        res = results[n]
        res.graphs = runner.pauses  # (every capture made on this runner's thread)
        res.recompiles_in_rounds = runner.pauses - pauses[n]
        for old, new in _recaptures(runner):
            changes = signature_changes(old, new)
            res.recompiles.append({"reason": describe_changes(changes), "changes": changes})
        if res.recompiles_in_rounds:
            notes.append(f"{n}: {res.recompiles_in_rounds} graph(s) compiled during the timed rounds: its times "
                         f"include a compile (an input changed signature there)")
    base = results.get("eager")
    for n, res in results.items():
        res.time = spread(res.round_s)
        if base is not None and n != "eager":
            per_round = paired_ratios(res.round_s, base.round_s)
            res.ratio = {"per_round": per_round, **spread(per_round), "ci95": list(bootstrap_ci(per_round))}
    options = cstep.options if cstep is not None else None
    meta = {"steps": steps, "rounds": rounds, "warmup": extra, "batches": len(all_batches), "variants": list(names),
            "device": str(device), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "backend": _backend_name(options), "path": options.path if options is not None else "-",
            "cache": ("cold (an empty cache_dir), then warm" if folder is not None else
                      "as configured (see each compile's cache hits)"),
            "cache_dir": cstep.cache_dir if cstep is not None else None, "cold_dir": folder,
            "date": datetime.datetime.now().isoformat(timespec="seconds"), "python": sys.version.split()[0],
            "cores": _cores(), "load_before": load_before, "load_after": load_after, "cpu_share": round(cpu_share, 3)}
    return Report(meta=meta, variants=results, notes=notes)


def _load() -> float | None:
    """The 1-minute load average (``None`` where the system has none)."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def _cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


# what torch's profiler (kineto) prints on stderr at every start and stop, at its lowest levels: a trace of its
# stages, not a message for the user (its warnings and errors have other prefixes and are passed on)
_PROFILER_LINE = re.compile(r"^(USDT|STAGE):\S+ \S+ \d+:\d+ \S+:\d+\] ")


@contextlib.contextmanager
def _without_profiler_lines() -> Iterator[None]:
    """While the block runs, file descriptor 2 goes to a temporary file; after it, every line written there except
    the profiler's stage lines (:data:`_PROFILER_LINE`) is written to stderr, in order. (The profiler writes from
    C++, below ``sys.stderr``; its level setting is read once per process, so the lines are taken out here.)"""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError, AttributeError):  # no file descriptor 2 to redirect: as it is
        yield
        return
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            with contextlib.suppress(Exception):
                sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            kept = [ln for ln in tmp.read().decode(errors="replace").splitlines(keepends=True)
                    if not _PROFILER_LINE.match(ln)]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()


def _recaptures(runner: Any) -> list:
    """The ``(old, new)`` signatures a runner recorded (a Dynamo runner records none)."""
    return list(runner.recaptures) if isinstance(runner, Runner) else []


def _check(step: Any, state: Any, batch: Any, *, steps: Any, warmup: Any, rounds: Any, variants: Any, batches: Any,
           compile_kwargs: Any, cold: Any, memory: Any) -> tuple[str, ...]:
    if not isinstance(step, (Step, CompiledStep)):
        raise TypeError(f"ft.benchmark takes a functrain Step (ft.train_step) or a CompiledStep (ft.compile); got "
                        f"a {type(step).__name__}")
    if not isinstance(state, TrainState):
        raise TypeError(f"ft.benchmark takes the TrainState to start from (step.init(...)); got a "
                        f"{type(state).__name__}")
    check_int("ft.benchmark: steps", steps, minimum=1)
    check_int("ft.benchmark: warmup", warmup, minimum=0)
    check_int("ft.benchmark: rounds", rounds, minimum=1)
    if isinstance(variants, str) or not isinstance(variants, Sequence) or not variants:
        raise BadValue(f"ft.benchmark: variants must be a non-empty list of {list(VARIANTS)}; got "
                       f"{describe(variants)}")
    bad = [v for v in variants if v not in VARIANTS]
    if bad or len(set(variants)) != len(variants):
        raise BadValue(f"ft.benchmark: variants must be distinct names from {list(VARIANTS)}; got {list(variants)}")
    if isinstance(batches, (str, bytes)) or not isinstance(batches, Sequence):
        raise TypeError(f"ft.benchmark: batches must be a list of more batches; got {describe(batches)}")
    if compile_kwargs is not None:
        if isinstance(step, CompiledStep):
            raise TypeError("ft.benchmark: compile_kwargs are for a plain Step; this step is compiled already "
                            "(its options are used)")
        if not isinstance(compile_kwargs, Mapping):
            raise TypeError(f"ft.benchmark: compile_kwargs must be a dict of ft.compile's arguments; got "
                            f"{describe(compile_kwargs)}")
        for key in ("background", "switch_at"):
            if compile_kwargs.get(key) not in (None, False):
                raise BadValue(f"ft.benchmark: compile_kwargs[{key!r}]={compile_kwargs[key]!r}: the benchmark "
                               f"waits for each compile (no timed call mixes eager and compiled); drop it")
        if cold is not False and compile_kwargs.get("cache_dir") is not None:
            raise BadValue("ft.benchmark: cold= compiles into a cache_dir of its own; drop "
                           "compile_kwargs['cache_dir']")
    if not isinstance(memory, bool):
        raise TypeError(f"ft.benchmark: memory must be True or False; got {describe(memory)}")
    if not isinstance(cold, (bool, str, os.PathLike)):
        raise TypeError(f"ft.benchmark: cold must be True, False or an empty folder; got {describe(cold)}")
    if not isinstance(cold, bool) and os.path.exists(cold) and (not os.path.isdir(cold) or os.listdir(cold)):
        raise BadValue(f"ft.benchmark: cold={os.fspath(cold)!r} must be an empty folder (or not exist yet): a cold "
                       f"compile starts from an empty cache")
    return tuple(variants)


def _compiled(step: Step | CompiledStep, compile_kwargs: Mapping | None, folder: str | None) -> CompiledStep:
    """A new compiled step to time (blocking compiles), in ``folder`` when given."""
    if isinstance(step, CompiledStep):
        changes: dict = {"background": None, "switch_at": None}
        if folder is not None:
            changes["cache_dir"] = folder
        return CompiledStep(step.step, step.options.replace(**changes), step.settings)
    kwargs = dict(compile_kwargs or {})
    if folder is not None:
        kwargs["cache_dir"] = folder
    return compile(step, **kwargs)


def _owned(runner: Any, state: Any) -> Any:
    """``state`` itself for a runner that never writes its input, else a copy it may own (as ``ft.run`` makes)."""
    donates = runner.memory != "fresh" if isinstance(runner, Runner) else runner.call.donate
    if not donates:
        return state
    return optree.tree_map(lambda x: x.clone() if torch.is_tensor(x) else x, state)


def _first_call(runner: Any, state: Any, batch: Any, res: VariantResult, memory: bool) -> tuple[Any, VariantResult]:
    """The compiling first call: trace timed apart (the direct path keeps it for the call), estimate, compile."""
    state = _owned(runner, state)
    trace_s = None
    if isinstance(runner, Runner):
        t0 = time.perf_counter()
        runner.traced(state, batch)  # kept: the first call compiles this trace
        trace_s = time.perf_counter() - t0
    if memory:
        est = estimate_memory(runner, state, batch)
        res.memory_estimated = {"allocated": est.step_peak + est.new_state, "step_peak": est.step_peak,
                                "new_state": est.new_state, "total": est.total, "text": str(est)}
    pauses = runner.pauses
    before = phases_.snapshot()
    t0 = time.perf_counter()
    new, _ = runner(state, batch)
    res.first_call_s = time.perf_counter() - t0 + (trace_s or 0.0)
    if runner.pauses > pauses and runner.progress.compile_s is not None:
        res.compile = phases_.phases(before, phases_.snapshot(), compile_s=runner.progress.compile_s,
                                     trace_s=trace_s)
    return new, res


def _warm_compile(cstep: CompiledStep, name: str, state: Any, batch: Any) -> dict | None:
    """Compile ``name``'s graph again as a new compiled step of the same options (the caches the first compile
    filled on disk), after clearing inductor's in-memory caches."""
    utils = sys.modules.get("torch._inductor.utils")
    if utils is not None:
        utils.clear_caches()
    again = CompiledStep(cstep.step, cstep.options, cstep.settings)
    runner = again.runner(donate=name == "donating", background=False)
    res = VariantResult(name=name, call=VARIANTS[name])
    _first_call(runner, state, batch, res, memory=False)
    again.close()
    return res.compile


def _syncs(call: Callable, state: Any, batches: list) -> tuple[Any, float | None, dict]:
    """Run ``call`` over ``batches`` counting host syncs; ``(state, per step, {op: per step})``."""
    if isinstance(call, DynamoRunner):
        for b in batches:
            state, _ = call(state, b)
        return state, None, {}
    with SyncCounter() as counter:
        for b in batches:
            state, _ = call(state, b)
    n = len(batches)
    return state, counter.total / n, {op: k / n for op, k in sorted(counter.by_op.items())}


def _rounds(names: tuple, calls: dict, states: dict, batches: list, results: dict, *, steps: int, rounds: int,
            cursor: int, sync: Callable[[], None]) -> None:
    """The timed rounds (see :func:`benchmark`): ``results[n].round_s`` gets each round's seconds per step."""
    k = len(names)
    gc.collect()
    gc.freeze()  # what exists now is never collected again: short collections between timed blocks
    try:
        for r in range(rounds):
            order = names[r % k:] + names[:r % k]
            chosen = [batches[(cursor + j) % len(batches)] for j in range(steps)]
            for n in order:
                call, s = calls[n], states[n]
                gc.collect()
                sync()
                t0 = time.perf_counter()
                for b in chosen:
                    s, _ = call(s, b)
                sync()
                results[n].round_s.append((time.perf_counter() - t0) / steps)
                states[n] = s
            cursor += steps
    finally:
        gc.unfreeze()


def _device(state: TrainState) -> torch.device:
    leaves = [t for t in optree.tree_leaves(state.params) if torch.is_tensor(t)]
    return leaves[0].device if leaves else torch.device("cpu")


def _synchronize(device: torch.device) -> Callable[[], None]:
    """Wait for ``device``'s queued work (nothing on the CPU: its ops return when done)."""
    if device.type == "cpu":
        return lambda: None
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return torch.accelerator.synchronize


def _backend_name(options: Any) -> str:
    if options is None:
        return "-"
    backend = options.backend
    if backend is None:
        return "inductor"
    return backend if isinstance(backend, str) else getattr(backend, "__name__", type(backend).__name__)
