"""A compile's time by phase, from what torch records while it compiles.

torch times its compiler's steps in ``torch._dynamo.utils.compilation_time_metrics`` (``{name: [seconds, ...]}``,
nested: an outer step's time holds its inner steps') and counts cache hits in ``torch._dynamo.utils.counters``.
:func:`snapshot` before and after a compile and :func:`phases` of the two split the compile's seconds into
disjoint phases (functrain's own trace is timed by the caller, apart):

* ``aot_autograd``: AOTAutograd (``create_aot_dispatcher_function``) less the backend compiler it calls;
* ``inductor``: inductor's passes, lowering, scheduling and code generation (its forward/backward compiler) less
  the load of the generated module;
* ``kernels``: loading the generated module, which waits for its C++ / Triton kernels to compile
  (``PyCodeCache.load_by_key_path``);
* ``cache_load``: code loaded from AOTAutograd's cache instead (``AOTAutogradCache.inductor_load``);
* ``other``: the rest of the compile: imports on first use, functrain's per-graph lock and cache key, the fake
  inputs, inductor's passes before AOTAutograd (and, on the Dynamo path, Dynamo's own trace).

Example::

    >>> from functrain.bench.phases import phases
    >>> before = {"times": {}, "cache": {}}
    >>> after = {"times": {"create_aot_dispatcher_function": 3.0, "compile_fx.<locals>.fw_compiler_base": 2.9,
    ...                    "PyCodeCache.load_by_key_path": 2.2}, "cache": {"fxgraph_miss": 1}}
    >>> p = phases(before, after, compile_s=3.8, trace_s=0.1)
    >>> {k: round(v, 2) for k, v in p["phases"].items()}
    {'trace': 0.1, 'aot_autograd': 0.1, 'inductor': 0.7, 'kernels': 2.2, 'cache_load': 0.0, 'other': 0.8}
    >>> round(p["total"], 2), p["cache"]
    (3.9, {'fxgraph_miss': 1})
"""
from __future__ import annotations

from typing import Any

__all__ = ["snapshot", "phases", "CACHE_COUNTERS"]

# what each cache count is, in torch's counters: (group, key)
CACHE_COUNTERS = {"fxgraph_hit": ("inductor", "fxgraph_cache_hit"), "fxgraph_miss": ("inductor", "fxgraph_cache_miss"),
                  "aot_hit": ("aot_autograd", "autograd_cache_hit"), "aot_miss": ("aot_autograd", "autograd_cache_miss")}
_AOT = "create_aot_dispatcher_function"
_BACKEND = ("compile_fx.<locals>.fw_compiler_base", "compile_fx.<locals>.bw_compiler")
_LOAD = "PyCodeCache.load_by_key_path"
_CACHED = "AOTAutogradCache.inductor_load"


def snapshot() -> dict[str, dict]:
    """``{"times": {name: seconds so far}, "cache": {count: n so far}}`` of this process's compiles."""
    from torch._dynamo.utils import compilation_time_metrics, counters

    times = {name: float(sum(values)) for name, values in compilation_time_metrics.items()}
    cache = {name: int(counters[group].get(key, 0)) for name, (group, key) in CACHE_COUNTERS.items()}
    return {"times": times, "cache": cache}


def phases(before: dict, after: dict, *, compile_s: float, trace_s: float | None) -> dict[str, Any]:
    """The compile between the snapshots ``before`` and ``after`` by phase: ``{"total": seconds, "phases":
    {phase: seconds}, "cache": {count: n}}``; ``compile_s``: its seconds after the trace (the runner's
    ``progress.compile_s``), ``trace_s``: functrain's trace (``None``: not apart, the Dynamo path)."""
    def spent(name: str) -> float:
        return max(0.0, after["times"].get(name, 0.0) - before["times"].get(name, 0.0))

    backend = sum(spent(n) for n in _BACKEND)
    cache_load = spent(_CACHED)
    kernels = max(0.0, spent(_LOAD) - cache_load)  # (a cached load's module load is inside cache_load)
    inductor = max(0.0, backend - kernels)
    aot = max(0.0, spent(_AOT) - backend)
    other = max(0.0, compile_s - aot - inductor - kernels - cache_load)
    cache = {k: after["cache"].get(k, 0) - before["cache"].get(k, 0) for k in CACHE_COUNTERS}
    return {"total": compile_s + (trace_s or 0.0),
            "phases": {"trace": trace_s, "aot_autograd": aot, "inductor": inductor, "kernels": kernels,
                       "cache_load": cache_load, "other": other},
            "cache": {k: n for k, n in cache.items() if n}}
