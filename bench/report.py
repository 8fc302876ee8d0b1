"""The markdown report of bench/steps.py (the statistics are the library's: functrain.bench.stats)."""
from __future__ import annotations

from typing import Any

from functrain.bench.stats import bootstrap_ci, fmt_time, median, paired_ratios

__all__ = ["median", "bootstrap_ci", "fmt_time", "summarise", "markdown", "sweep_table", "TARGETS"]

# (workload, variant, kind, bound): kind "speedup" = torch_eager / variant >= bound,
# "ratio" = variant / torch_eager <= bound (medians of the paired per-round ratios)
TARGETS = [
    ("W1", "functrain_compiled", "speedup", 1.5),
    ("W1", "functrain_eager", "ratio", 1.3),
    ("W2", "functrain_compiled", "ratio", 1.0),
    ("W3", "functrain_compiled", "speedup", 1.5),
]


def fmt_sci(x: float | None) -> str:
    return "-" if x is None else f"{x:.1e}"


def summarise(res: dict[str, Any], base: str = "torch_eager") -> None:
    """Add medians, paired ratios and intervals to one workload's result (in place)."""
    per = res["variants"]
    b = per.get(base)
    for name, v in per.items():
        t = v["round_s_per_update"]
        v["median_s"] = median(t)
        v["min_s"], v["max_s"] = min(t), max(t)
        v["cpu_wall"] = sum(v["round_cpu_s"]) / sum(v["round_wall_s"])
        v["other_load"] = median(v["round_other_load"])
        # compile estimate: the warm-up's wall time less what its updates take in steady state
        if v.get("warmup_s") is not None:
            v["compile_est_s"] = max(0.0, v["warmup_s"] - res["warmup"] * v["median_s"])
        if b is not None and name != base:
            ratios = paired_ratios(t, b["round_s_per_update"])
            v["ratio"] = median(ratios)
            v["ratio_ci"] = bootstrap_ci(ratios)
            v["ratio_minmax"] = (min(ratios), max(ratios))
            cr = paired_ratios(v["round_cpu_s_per_update"], b["round_cpu_s_per_update"])
            v["cpu_ratio"], v["cpu_ratio_ci"] = median(cr), bootstrap_ci(cr)
        elif name == base:
            v["ratio"], v["ratio_ci"], v["ratio_minmax"] = 1.0, (1.0, 1.0), (1.0, 1.0)
            v["cpu_ratio"], v["cpu_ratio_ci"] = 1.0, (1.0, 1.0)


def _target_rows(results: dict[str, Any]) -> list[str]:
    rows = []
    for wl, var, kind, bound in TARGETS:
        v = results.get(wl, {}).get("variants", {}).get(var)
        if v is None or "ratio" not in v:
            continue
        r, (lo, hi) = v["ratio"], v["ratio_ci"]
        if kind == "speedup":
            want = f"{var} ≥ {bound:g}x faster than torch_eager"
            got = f"{1 / r:.2f}x faster [{1 / hi:.2f}–{1 / lo:.2f}]"
            ok, sure = 1 / r >= bound, 1 / hi >= bound or 1 / lo < bound
        else:
            want = (f"{var} not slower than torch_eager" if bound == 1.0
                    else f"{var} ≤ {bound:g}x the time of torch_eager")
            got = f"{r:.2f}x the time [{lo:.2f}–{hi:.2f}]"
            ok, sure = r <= bound, hi <= bound or lo > bound
        verdict = ("met" if ok else "NOT met") + ("" if sure else " (the 95% CI straddles the bound)")
        rows.append(f"| {wl} | {want} | {got} | {verdict} |")
    return rows


def sweep_table(results: dict[str, Any]) -> list[str]:
    """The transformer depth sweep: per variant, time/update, paired ratio and compile time at each depth."""
    lm = [(r["layers"], r) for r in results.values() if r.get("kind") == "lm"]
    if len(lm) < 2:
        return []
    lm.sort(key=lambda x: x[0])
    names = [n for n in lm[0][1]["variants"] if all(n in r["variants"] for _, r in lm)]
    head = " | ".join(f"{d} layers: time/update · ratio [95% CI]" for d, _ in lm)
    chead = " | ".join(f"{d} layers: first call · warm-up excess" for d, _ in lm)
    out = [f"| variant | {head} | {chead} |", "|---|" + "---|" * (2 * len(lm))]
    for n in names:
        cells, comp = [], []
        for _, r in lm:
            v = r["variants"][n]
            lo, hi = v["ratio_ci"]
            cells.append(f"{fmt_time(v['median_s'])} · " + ("1" if n == "torch_eager" else
                                                             f"{v['ratio']:.2f} [{lo:.2f}–{hi:.2f}]"))
            comp.append(f"{fmt_time(v['first_call_s'])} · {fmt_time(v.get('compile_est_s'))}" if v["compiled"]
                        else "eager")
        out.append(f"| {n} | " + " | ".join(cells) + " | " + " | ".join(comp) + " |")
    return out


def markdown(meta: dict[str, Any], results: dict[str, Any]) -> str:
    out = [f"Run {meta['date']}: {meta['machine']}; Python {meta['python']}, torch {meta['torch']}, "
           f"functrain {meta['functrain']}; threads={meta['threads']}, device={meta['device']}; "
           f"inductor cache: {meta['inductor_cache']}; {meta['wall_min']:.1f} min in all"
           + (f"; prewarm (each compiled variant once on a tiny 1-layer LM, not in any first call) {meta['prewarm_s']:.1f} s"
              if meta.get("prewarm_s") is not None else "") + ".", ""]
    out.append("| workload | variant | time/update, median [min–max] | ratio to torch_eager [95% CI] "
               "| speed-up | CPU-time ratio [95% CI] | CPU/wall · other load | first call (compile) · warm-up excess | graphs "
               "| recompiles in rounds | syncs/update | max \\|Δw\\| vs torch_eager: after warm-up · at end "
               "| max \\|Δema\\| at end | eval loss at end |")
    out.append("|" + "---|" * 14)
    for key, res in results.items():
        first = True
        for name, v in res["variants"].items():
            wl = f"{key} {res['title']}<br>{res['rounds']} rounds x {res['k']} updates" if first else ""
            first = False
            if name == "torch_eager":
                ratio, speed, cratio = "1", "1", "1"
            else:
                lo, hi = v["ratio_ci"]
                ratio, speed = f"{v['ratio']:.2f} [{lo:.2f}–{hi:.2f}]", f"{1 / v['ratio']:.2f}x"
                clo, chi = v["cpu_ratio_ci"]
                cratio = f"{v['cpu_ratio']:.2f} [{clo:.2f}–{chi:.2f}]"
            t = f"{fmt_time(v['median_s'])} [{fmt_time(v['min_s'])}–{fmt_time(v['max_s'])}]"
            first_call = (f"{fmt_time(v['first_call_s'])} · {fmt_time(v.get('compile_est_s'))}" if v["compiled"]
                          else "eager")
            graphs = "-" if v["graphs"] is None else str(v["graphs"])
            recomp = "-" if not v["compiled"] else str(v["recompiles_in_rounds"])
            dw = "reference" if name == "torch_eager" else f"{fmt_sci(v['max_dw_warmup'])} · {fmt_sci(v['max_dw'])}"
            de = "-" if v["max_dema"] is None else ("reference" if name == "torch_eager" else fmt_sci(v["max_dema"]))
            out.append(f"| {wl} | {name} | {t} | {ratio} | {speed} | {cratio} | {v['cpu_wall']:.2f} · {v['other_load']:.2f} "
                       f"| {first_call} | {graphs} "
                       f"| {recomp} | {v['syncs']} | {dw} | {de} | {v['eval_loss']:.5g} |")
    sweep = sweep_table(results)
    if sweep:
        out += ["", *sweep]
    rows = _target_rows(results)
    if rows:
        out += ["", "| workload | target | measured (paired ratio, 95% CI) | verdict |", "|---|---|---|---|", *rows]
    notes = [n for res in results.values() for n in res.get("notes", [])]
    if notes:
        out += ["", *[f"- {n}" for n in notes]]
    return "\n".join(out)
