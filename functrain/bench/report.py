"""What :func:`functrain.bench.benchmark` measured: a :class:`Report` of one :class:`VariantResult` per variant.

``str(report)`` is a markdown table (and the lines under it: warm compiles, recompiles, notes);
``report.to_dict()`` / ``report.to_json()`` hold every number (every round's time too), for a machine.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any

from .stats import fmt_bytes, fmt_time

__all__ = ["Report", "VariantResult", "PHASES"]

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
            ``torch``, ``backend``, ``path``, ``cache``, ``date``).
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
        out = [f"ft.benchmark: {m['rounds']} rounds x {m['steps']} steps per variant, interleaved (warm-up "
               f"{m['warmup']}, {m['batches']} batch{'es' if m['batches'] != 1 else ''}); {m['device']}, "
               f"{m['threads']} threads, torch {m['torch']}; backend {m['backend']} ({m['path']} path); "
               f"compile cache: {m['cache']}", ""]
        phases = " + ".join(_PHASE_TITLES[p] for p in PHASES)
        out.append(f"| variant | call | per step: median [IQR] (min–max) | x eager: median [IQR] (min–max) "
                   f"| compile s: total = {phases} | graphs | syncs/step | a call allocates: estimated · measured |")
        out.append("|" + "---|" * 8)
        for v in self.variants.values():
            t = v.time
            per = (f"{fmt_time(t['median'])} [{fmt_time(t['q1'])}–{fmt_time(t['q3'])}] "
                   f"({fmt_time(t['min'])}–{fmt_time(t['max'])})") if t else "-"
            if v.ratio is not None:
                r = v.ratio
                ratio = f"{r['median']:.2f} [{r['q1']:.2f}–{r['q3']:.2f}] ({r['min']:.2f}–{r['max']:.2f})"
            else:
                ratio = "1" if v.name == "eager" else "-"
            syncs = "-" if v.syncs_per_step is None else f"{v.syncs_per_step:g}"
            est = "-" if v.memory_estimated is None else fmt_bytes(v.memory_estimated["allocated"])
            graphs = "-" if v.graphs is None else str(v.graphs)
            out.append(f"| {v.name} | `{v.call}` | {per} | {ratio} | {_compile_cell(v.compile)} | {graphs} "
                       f"| {syncs} | {est} · {fmt_bytes(v.memory_measured)} |")
        warm = [v for v in self.variants.values() if v.warm_compile is not None]
        if warm:
            out.append("")
            out += [f"warm compile of {v.name} (the caches the first compile filled): {_compile_cell(v.warm_compile)} s"
                    for v in warm]
        again = [(v.name, r["reason"]) for v in self.variants.values() for r in v.recompiles]
        if again:
            out.append("")
            out += [f"recompile of {name}: {reason}" for name, reason in again]
        if self.notes:
            out.append("")
            out += [f"- {n}" for n in self.notes]
        return "\n".join(out)


def _compile_cell(c: dict | None) -> str:
    if c is None:
        return "-"
    parts = " + ".join("-" if c["phases"].get(p) is None else f"{c['phases'][p]:.2f}" for p in PHASES)
    cache = c.get("cache") or {}
    hits = ", ".join(f"{k} {n}" for k, n in cache.items() if n)
    return f"{c['total']:.2f} = {parts}" + (f" ({hits})" if hits else "")
