"""What benchmarks/hybrid_cpu.py's rounds mean: medians, paired speedups, the issue's targets, the tables.

Kept apart from the spawned job so that a saved JSON can be analysed again: ``report(doc["models"], run)``.
"""

from __future__ import annotations

import statistics
from typing import Any, Dict, List, Optional, Tuple

from benchmarks.common import Run, median_ms, median_ratio, probe_speedup
from pipeddp.tools.simulate import bubble_bound

STAGES = 2
PIPEDDP = ("pipeddp-replica", "pipeddp-stage")
TORCH = ("torch-gpipe@cut", "torch-1f1b@cut", "torch-gpipe@naive", "torch-1f1b@naive")


def _series(row: Dict[str, Any], name: str) -> Optional[str]:
    """The configuration whose times stand for ``name`` (following aliases: naive cut == pipeddp's cut)."""
    if name in row["times_s"]:
        return name
    alias = (row["torch_pipelining"].get(name) or {}).get("alias_of")
    return alias if alias in row["times_s"] else None


def _clean_median_ms(row: Dict[str, Any], name: str) -> Optional[float]:
    """Median over the undisturbed steps of ``name`` (all steps if none was undisturbed)."""
    src = _series(row, name)
    if src is None:
        return None
    t = row["times_s"][src]
    return median_ms([v for v, ok in zip(t, row["undisturbed"][src]) if ok] or t)


def _pair_ratio(row: Dict[str, Any], base: str, other: str) -> Tuple[Optional[float], int]:
    """Median of base/other over the rounds where both steps were undisturbed (all rounds if there is none)."""
    b, o = _series(row, base), _series(row, other)
    if b is None or o is None:
        return None, 0
    tb, to = row["times_s"][b], row["times_s"][o]
    both = [i for i, (u, v) in enumerate(zip(row["undisturbed"][b], row["undisturbed"][o])) if u and v]
    use = both or list(range(len(tb)))
    return median_ratio([tb[i] for i in use], [to[i] for i in use]), len(both)


def analyse(row: Dict[str, Any]) -> Dict[str, Any]:
    """Medians (undisturbed steps) and per-round speedups of every pipeddp configuration over each baseline."""
    names = list(row["times_s"]) + [t for t in TORCH if t not in row["times_s"]]
    bound = bubble_bound(STAGES, len(row["microbatch_sizes"]))
    speed: Dict[str, Dict[str, Any]] = {}
    for p in [n for n in row["times_s"] if n.startswith("pipeddp")]:
        entry: Dict[str, Any] = {"rounds": {}}
        for base in ("accum", "whole-1t", "whole-2t", "ddp") + TORCH:
            entry[base], entry["rounds"][base] = _pair_ratio(row, base, p)
        entry["bound"] = bound
        entry["efficiency"] = entry["accum"] / bound if entry["accum"] is not None else None
        speed[p] = entry
    host = None
    if "host_solo" in row["times_s"]:  # too short for the CPU-time reading: every round counts
        host = probe_speedup(row["times_s"]["host_solo"], row["times_s"]["host_both"], STAGES)
    return {"median_ms": {n: _clean_median_ms(row, n) for n in names}, "bound": bound, "speedup": speed,
            "torch_speedup_vs_accum": {t: _pair_ratio(row, "accum", t)[0] for t in TORCH},
            "accum_over_whole": _pair_ratio(row, "accum", "whole-1t")[0], "host_parallel_speedup": host}


def _met(values: Dict[Any, Any], floor: float) -> bool:
    flat = [v for d in values.values() for v in (d.values() if isinstance(d, dict) else [d])]
    return all(v is not None and v >= floor for v in flat)


def targets(model: str, rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The issue's targets, per pipeddp mode: met / not met, with the numbers they were judged on."""
    out: List[Dict[str, Any]] = []
    for p in PIPEDDP:
        if not all(p in r["analysis"]["speedup"] for r in rows):
            continue
        sp = {r["m"]: r["analysis"]["speedup"][p] for r in rows}
        same = {m: {t: s[t] for t in TORCH[:2]} for m, s in sp.items()}
        checks = [(">= 95% of the bubble bound vs accumulation at every m", {m: s["efficiency"] for m, s in sp.items()},
                   0.95), ("never slower than torch pipelining with the same cut", same, 1.0)]
        if 16 in sp:
            checks.append((">= 1.1x faster than torch pipelining (same cut) at m=16", same[16], 1.1))
        naive = {m: {t: s[t] for t in TORCH[2:]} for m, s in sp.items() if m in (8, 16)}
        if model == "resnet50" and naive:
            checks.append((">= 1.2x faster than torch pipelining with the naive cut at m=8 and m=16", naive, 1.2))
        out += [{"model": model, "mode": p, "target": t, "values": v, "met": _met(v, f)} for t, v, f in checks]
    return out


def _x(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _ms(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.0f}" if v >= 100 else f"{v:.1f}"


def _short(name: str) -> str:
    """A column name: "pdp replica", "tGPipe @cut", "whole 1t"."""
    for long, short in (("pipeddp-", "pdp "), ("torch-gpipe", "tGPipe "), ("torch-1f1b", "t1F1B "), ("-", " ")):
        name = name.replace(long, short)
    return name


def _times_table(name: str, res: Dict[str, Any], run: Run) -> None:
    rows = res["by_m"]
    cols = ["whole-1t", "whole-2t", "accum", "ddp", "pipeddp-replica", "pipeddp-stage"]
    cols += sorted({n for r in rows for n in r["times_s"] if n.startswith("pipeddp") and n not in cols}) + list(TORCH)
    run.table(f"{name}: ms per training step (median over undisturbed steps of the interleaved rounds)",
              ["m", "pipeddp cut", "naive cut", "rounds"] + [_short(c) for c in cols],
              [[r["m"], str(r["balance"]), str(r["naive_balance"]),
                f"{min(r['pairs_undisturbed'].values(), default=0)}/{r['rounds_run']}"]
               + [_ms(r["analysis"]["median_ms"].get(c)) for c in cols] for r in rows],
              caption=f"{res['workload']}. 1 intra-op thread per process or stage thread (whole 2t: 2); "
                      "@cut: given pipeddp's cut, @naive: len(model)//2; rounds = fewest undisturbed rounds of any "
                      "pipeddp-vs-baseline pair / rounds run. The columns: benchmarks/README.md")


def _speedup_table(name: str, rows: List[Dict[str, Any]], run: Run) -> None:
    out = []
    for r in rows:
        a = r["analysis"]
        for i, p in enumerate(sorted(a["speedup"], key=lambda s: (s.replace("replica", "a"), s))):
            s = a["speedup"][p]
            out.append([r["m"] if i == 0 else "", _short(p), _x(s["accum"]), _x(s["bound"]), f"{s['efficiency']:.0%}",
                        _x(s["whole-1t"]), _x(s["whole-2t"]), _x(s["ddp"])] + [_x(s[t]) for t in TORCH]
                       + [_x(a["host_parallel_speedup"]) if i == 0 else ""])
    run.table(f"{name}: pipeddp speedups (median of per-round ratios; > 1 = pipeddp faster)",
              ["m", "pipeddp", "vs accum", "bound", "efficiency", "vs whole 1t", "vs whole 2t", "vs ddp"]
              + [f"vs {_short(t)}" for t in TORCH] + ["host 2-core"], out,
              caption="bound = 2m/(m+1); efficiency = (vs accum) / bound; host 2-core = a 1-thread matmul kernel on "
                      "both cores at once vs alone, interleaved with the steps (ideal 2.00x)")


def _breakdown_table(name: str, rows: List[Dict[str, Any]], run: Run) -> None:
    out = []
    for r in rows:
        for cname, b in r["breakdown"].items():
            busy = [s["F_ms"] + s["B_ms"] for s in b["stages"]]
            out.append([r["m"], _short(cname), f"{b['step_ms']:.0f}",
                        " / ".join(f"{s['F_ms']:.0f}+{s['B_ms']:.0f}" for s in b["stages"]),
                        " / ".join(f"{max(0.0, 1 - v / b['step_ms']):.0%}" for v in busy),
                        f"{sum(busy) / r['analysis']['median_ms']['accum']:.2f}",
                        f"{max(busy) / (sum(busy) / len(busy)):.2f}"])
    if out:
        run.table(f"{name}: where the pipelines' time goes (medians over the undisturbed rounds)",
                  ["m", "config", "step ms", "stage0 / stage1 F+B ms", "idle s0 / s1", "busy / accum", "imbalance"],
                  out, caption="F/B = time inside each stage's forward/backward (torch: *_one_chunk); idle = "
                               "1 - busy / step; busy / accum > 1: the same work got slower on two busy cores")


def _notes(name: str, rows: List[Dict[str, Any]], run: Run) -> None:
    """Failed torch cuts, disturbed steps left out, and whether the waiting rank really waited."""
    for r in rows:
        for k, v in r["torch_pipelining"].items():
            failed = [a["cut"] for a in v["attempts"] if not a["ok"]]
            if failed:
                run.console.print(f"[yellow]{name} m={r['m']}: {k} failed on cut(s) {failed}, used cut "
                                  f"{v['used_cut']}[/yellow]")
        judged = [n for n in r["undisturbed"] if not n.startswith("host_")]  # the probe is too short to judge
        kept = [f for n in judged for f, ok in zip(r["foreign_cores"][n], r["undisturbed"][n]) if ok]
        steal = [v for n in judged for v in r["steal_cores"][n]]
        left = sum(not ok for n in judged for ok in r["undisturbed"][n])
        run.console.print(f"{name} m={r['m']}: {r['rounds_run']} timed rounds, {left} disturbed step(s) left out; "
                          f"other processes used at most {max(kept, default=0):.2f} cores during the steps kept; "
                          f"hypervisor steal median {statistics.median(steal) if steal else 0:.2f}, "
                          f"max {max(steal, default=0):.2f} cores")
    idle = [r["rank1_idle_cpu_frac"] for r in rows if r["rank1_idle_cpu_frac"] is not None]
    if idle:
        run.console.print(f"{name}: rank 1 used {max(idle):.1%} of a core (worst median over an m) while waiting in "
                          "the barrier during rank 0's single-process steps")


def _values(v: Any) -> str:
    if isinstance(v, dict):
        return ", ".join(f"{k}: {_values(x)}" for k, x in v.items())
    return "-" if v is None else f"{v:.2f}"


def report(models: Dict[str, Any], run: Run) -> List[Dict[str, Any]]:
    """Analyse every row (adds ``analysis``), print the tables, judge the targets; returns them all."""
    found: List[Dict[str, Any]] = []
    for name, res in models.items():
        for row in res["by_m"]:
            row["analysis"] = analyse(row)
        _times_table(name, res, run)
        _speedup_table(name, res["by_m"], run)
        _breakdown_table(name, res["by_m"], run)
        res["targets"] = targets(name, res["by_m"])
        found += res["targets"]
        _notes(name, res["by_m"], run)
    if found:
        run.table("targets from the issue (pipeddp's default 1F1B)", ["model", "pipeddp", "target", "met", "values"],
                  [[t["model"], t["mode"], t["target"], "met" if t["met"] else "NOT met", _values(t["values"])]
                   for t in found])
    return found
