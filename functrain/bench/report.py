"""What :func:`functrain.bench.benchmark` measured: a :class:`Report` of one :class:`VariantResult` per variant.

``str(report)`` is two markdown tables, times then compiles and memory, under a line saying how loaded the machine
was (the times of a loaded machine mean little on their own) and over the lines of warm compiles, recompiles and
notes, every line at most :data:`WIDTH` (120) characters;
``report.to_dict()`` / ``report.to_json()`` hold every number (every round's time too), for a machine.
"""
from __future__ import annotations

import dataclasses
import json
import textwrap
from typing import Any

from .stats import fmt_bytes, fmt_time

__all__ = ["Report", "VariantResult", "PHASES", "WIDTH", "machine_line"]

# the compile's phases, in order (seconds each; see functrain.bench.phases)
PHASES = ("trace", "aot_autograd", "inductor", "kernels", "cache_load", "other")
_PHASE_TITLES = {"trace": "trace", "aot_autograd": "AOTAutograd", "inductor": "inductor", "kernels": "kernels",
                 "cache_load": "cache load", "other": "other"}


@dataclasses.dataclass
class VariantResult:
    """One variant's numbers (times in seconds, memory in bytes).

    Attributes:
        name: ``"eager"``, ``"compiled"`` or ``"donating"``.
        call: what was timed (``"step(state, batch)"``, ``"cstep.runner()"``, ``"cstep.runner(donate=True)"``).
        round_s: seconds per step in each timed round, in round order.
        time: :func:`~functrain.bench.stats.spread` of ``round_s`` (``median``, ``min``, ``max``, ``q1``, ``q3``).
        ratio: the paired ratio to eager, per round (``per_round``: this variant's time / eager's in the same
            round), its spread and ``ci95`` (a bootstrap interval of the median); ``None`` for eager itself or when
            eager was not run.
        first_call_s: the wall time of the first call (a compiled variant's compile is in it).
        compile: a compiled variant's first compile: ``total`` (seconds), ``phases`` (``{phase: seconds}``,
            :data:`PHASES`; ``trace`` is ``None`` on the Dynamo path) and ``cache`` (hits and misses of
            AOTAutograd's and inductor's caches); ``None`` for eager, or when the variant compiled nothing
            (it shares the graphs of another).
        warm_compile: the same compile again from the caches the first one filled (``cold=True`` only).
        graphs: graphs this variant's runner compiled (``None`` for eager).
        recompiles: each capture after the first: ``{"reason": text, "changes": [{"leaf", "what", "old", "new"}]}``
            (:func:`functrain.bench.recompiles.signature_changes`).
        recompiles_in_rounds: graphs compiled during the timed rounds (0 unless an input changed signature there).
        syncs_per_step: host syncs per call (``aten._local_scalar_dense`` and the other ops that read a value to
            the host: :data:`functrain.bench.syncs.SYNC_OPS`), counted under a dispatch mode; ``None`` where not
            counted (the Dynamo path).
        syncs_by_op: ``{op: count per step}``.
        memory_estimated: a compiled variant's :func:`functrain.memory` estimate: ``allocated`` (what one call
            allocates above what exists before it: ``step_peak + new_state``), ``step_peak``, ``new_state``,
            ``total`` (with the state and the batch) and ``text`` (its line); ``None`` for eager or when not asked.
        memory_measured: the most bytes the tensors one call creates hold at once, counted at torch's allocator
            (:func:`functrain.compiler.estimate.allocated_peak`): what ``allocated`` estimates; ``None`` when not
            asked.
    """

    name: str
    call: str
    round_s: list = dataclasses.field(default_factory=list)
    time: dict = dataclasses.field(default_factory=dict)
    ratio: dict | None = None
    first_call_s: float | None = None
    compile: dict | None = None
    warm_compile: dict | None = None
    graphs: int | None = None
    recompiles: list = dataclasses.field(default_factory=list)
    recompiles_in_rounds: int = 0
    syncs_per_step: float | None = None
    syncs_by_op: dict = dataclasses.field(default_factory=dict)
    memory_estimated: dict | None = None
    memory_measured: int | None = None


@dataclasses.dataclass
class Report:
    """What :func:`functrain.bench.benchmark` measured.

    Attributes:
        meta: how it was measured (``steps``, ``rounds``, ``warmup``, ``batches``, ``device``, ``threads``,
            ``torch``, ``backend``, ``path``, ``cache``, ``date``) and how loaded the machine was (``cores``,
            ``load_before``, ``load_after``: the 1-minute load average when the timing started and ended;
            ``cpu_share``: this process's CPU seconds over the timed rounds' wall seconds; :func:`machine_line`).
        variants: ``{name: VariantResult}`` in the order given.
        notes: sentences about what was measured and anything unusual (a recompile during the rounds).
    """

    meta: dict
    variants: dict
    notes: list = dataclasses.field(default_factory=list)

    def __getitem__(self, name: str) -> VariantResult:
        return self.variants[name]

    def to_dict(self) -> dict[str, Any]:
        """Every number, as plain data (JSON-ready)."""
        return {"meta": dict(self.meta), "variants": {k: dataclasses.asdict(v) for k, v in self.variants.items()},
                "notes": list(self.notes)}

    def to_json(self, indent: int | None = 1) -> str:
        """:meth:`to_dict` as JSON text."""
        return json.dumps(self.to_dict(), indent=indent, default=str)

    def __str__(self) -> str:
        m = self.meta
        head = (f"ft.benchmark: {m['rounds']} rounds x {m['steps']} steps per variant, interleaved (warm-up "
                f"{m['warmup']}, {m['batches']} batch{'es' if m['batches'] != 1 else ''}); {m['device']}, "
                f"{m['threads']} threads, torch {m['torch']}; backend {m['backend']} ({m['path']} path); "
                f"compile cache: {m['cache']}")
        out = _wrap(head) + _wrap(machine_line(m)) + [""]
        out += ["| variant | per step: median [IQR] (min–max) | x eager: median [IQR] (min–max) | graphs | syncs/step |",
                "|---|---|---|---|---|"]
        for v in self.variants.values():
            t = v.time
            per = (f"{fmt_time(t['median'])} [{fmt_time(t['q1'])}–{fmt_time(t['q3'])}] "
                   f"({fmt_time(t['min'])}–{fmt_time(t['max'])})") if t else "-"
            if v.ratio is not None:
                r = v.ratio
                ratio = f"{_x(r['median'])} [{_x(r['q1'])}–{_x(r['q3'])}] ({_x(r['min'])}–{_x(r['max'])})"
            else:
                ratio = "1" if v.name == "eager" else "-"
            syncs = "-" if v.syncs_per_step is None else f"{v.syncs_per_step:g}"
            graphs = "-" if v.graphs is None else str(v.graphs)
            out.append(f"| {v.name} | {per} | {ratio} | {graphs} | {syncs} |")
        if any(v.compile or v.memory_estimated or v.memory_measured is not None for v in self.variants.values()):
            phases = " + ".join(_PHASE_TITLES[p] for p in PHASES)
            out += ["", f"| variant | compile s = {phases} | allocates: est. · measured |", "|---|---|---|"]
            for v in self.variants.values():
                est = "-" if v.memory_estimated is None else fmt_bytes(v.memory_estimated["allocated"])
                out.append(f"| {v.name} | {_compile_cell(v.compile)} | {est} · {fmt_bytes(v.memory_measured)} |")
        out.append("")
        out += _wrap("calls: " + "; ".join(f"{v.name} `{v.call}`" for v in self.variants.values()))
        hits = [f"{v.name} {_hits(v.compile)}" for v in self.variants.values() if _hits(v.compile)]
        if hits:
            out += _wrap("compile cache hits and misses: " + "; ".join(hits))
        warm = [v for v in self.variants.values() if v.warm_compile is not None]
        if warm:
            out.append("")
            for v in warm:
                cell = _compile_cell(v.warm_compile) + (f" ({_hits(v.warm_compile)})" if _hits(v.warm_compile) else "")
                out += _wrap(f"warm compile of {v.name} (the caches the first compile filled): {cell} s")
        again = [(v.name, r["reason"]) for v in self.variants.values() for r in v.recompiles]
        if again:
            out.append("")
            for name, reason in again:
                out += _wrap(f"recompile of {name}: {reason}")
        if self.notes:
            out.append("")
            for n in self.notes:
                out += _wrap(f"- {n}")
        return "\n".join(out)


WIDTH = 120  # the text's widest line: a terminal or a notebook cell shows it without wrapping


def _wrap(text: str) -> list[str]:
    """``text`` as lines of at most :data:`WIDTH` characters (continuations indented)."""
    return textwrap.wrap(text, WIDTH, subsequent_indent="  ", break_long_words=False, break_on_hyphens=False) or [""]


def machine_line(meta: dict) -> str:
    """How loaded the machine was while the benchmark ran, from ``meta``'s ``cores``, ``load_before`` /
    ``load_after`` (the 1-minute load average when the timing started and ended) and ``cpu_share`` (the CPU
    seconds this process used over the timed rounds' wall seconds): other work on the machine then makes the
    times longer and noisier than the step's own, so the line says so.

    Example::

        >>> machine_line({"cores": 2, "load_before": 9.7, "load_after": 9.9, "cpu_share": 0.41, "device": "cpu"})[:96]
        'machine: LOADED: the 1-minute load average was 9.7 at the start and 9.9 at the end, on 2 cores; '
    """
    cores, before, after = meta.get("cores"), meta.get("load_before"), meta.get("load_after")
    share = meta.get("cpu_share")
    if cores is None or before is None or after is None:
        return "machine: its load is unknown (no load average on this system)"
    loaded = max(before, after) > cores or (share is not None and meta.get("device") == "cpu"
                                            and share < 0.8 * min(meta.get("threads", 1) or 1, cores))
    text = (f"machine: {'LOADED: ' if loaded else ''}the 1-minute load average was {before:.1f} at the start and "
            f"{after:.1f} at the end, on {cores} cores")
    if share is not None:
        text += f"; this process used the CPU for {share:.0%} of the timed rounds' wall time"
    if loaded:
        text += (" (other work ran beside the benchmark: its times are longer and noisier than the step's own; "
                 "compare paired ratios, or measure again on an idle machine)")
    return text


def _x(ratio: float) -> str:
    """A ratio to eager in at most four characters below 1000: ``"0.06"``, ``"10.6"``, ``"123"``."""
    return f"{ratio:.2f}" if abs(ratio) < 10 else f"{ratio:.1f}" if abs(ratio) < 100 else f"{ratio:.0f}"


def _compile_cell(c: dict | None) -> str:
    if c is None:
        return "-"
    parts = " + ".join("-" if c["phases"].get(p) is None else f"{c['phases'][p]:.2f}" for p in PHASES)
    return f"{c['total']:.2f} = {parts}"


def _hits(c: dict | None) -> str:
    """A compile's cache hits and misses, ``"fxgraph_hit 1, aot_hit 1"`` (``""``: none counted)."""
    cache = (c or {}).get("cache") or {}
    return ", ".join(f"{k} {n}" for k, n in cache.items() if n)
