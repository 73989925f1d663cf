"""A trace's divergence events as tables and verdicts: one row per module and scope (worst, last, when it drifted),
the culprits of the ranked scope (:mod:`ampaudit.runtime.attribution`, the verdict ``check --calibrate`` gives) and
where the error first shows.

    tables = divergence_table(data, threshold)            # {scope: [row, ...]}, worst first
    found = divergence_culprits(data, tables, "local")    # [Culprit, ...]
    rows = rank_by_verdict(tables["local"], found)        # culprits first, each row with its "verdict"
    first_jump(data, found, "local")                      # {"module", "step", "rel_l2", "rule"} or None
    not_judged(data, "local")                             # [{"module", "fp32_moved"}]: FP32 does not determine them
"""
from __future__ import annotations

import math

from ampaudit.report.trace_data import TraceData


def _worst_first(row: dict) -> tuple[int, float]:
    # NaN is the worst a comparison can get; rows without any rel_l2 go last.
    v = row["max_rel_l2"]
    if v is None:
        return (2, 0.0)
    return (0, 0.0) if math.isnan(v) else (1, -v)


def divergence_table(data: TraceData, threshold: float) -> dict[str, list[dict]]:
    """Per scope, one row per module (per parameter for "grad"): worst/last rel_l2, when it first passed
    ``threshold``, lowest cosine and SQNR; rows sorted worst first."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for d in data.divergence:
        key = (d["param"] or d["module"]) if d["scope"] == "grad" else d["module"]
        groups.setdefault((d["scope"], key), []).append(d)
    tables: dict[str, list[dict]] = {}
    for (scope, _key), rows in groups.items():
        rel = [(r["step"], r["rel_l2"]) for r in rows if r["rel_l2"] is not None]
        worst = max(rel, key=lambda sr: sr[1] if not math.isnan(sr[1]) else math.inf, default=(None, None))
        cos = [r["cosine"] for r in rows if r["cosine"] is not None and not math.isnan(r["cosine"])]
        sqnr = [r["sqnr_db"] for r in rows if r["sqnr_db"] is not None and not math.isnan(r["sqnr_db"])]
        drift = next((st for st, v in rel if not (v < threshold)), None)  # NaN counts as drifted
        tables.setdefault(scope, []).append({
            "module": rows[0]["module"], "param": rows[0]["param"], "scope": scope, "samples": len(rows),
            "max_rel_l2": worst[1], "max_step": worst[0],
            "first_rel_l2": rel[0][1] if rel else None, "last_rel_l2": rel[-1][1] if rel else None,
            "min_cosine": min(cos) if cos else None, "min_sqnr_db": min(sqnr) if sqnr else None,
            "drift_step": drift})
    for rows in tables.values():
        rows.sort(key=_worst_first)
    return tables


def divergence_culprits(data: TraceData, tables: dict[str, list[dict]], scope: str | None) -> list:
    """The flagged modules of the ranked scope (:func:`ampaudit.runtime.attribution.culprits` on each module's
    worst value): the verdict ``check --calibrate`` gives. Own errors (scope "local") are judged on their own;
    other scopes accumulate from the input on and are judged as inherited (a module below explains its parents)."""
    from ampaudit.runtime.attribution import culprits, excused_nonfinite, rounding_around

    if scope is None:
        return []
    worst = {r["module"]: r["max_rel_l2"] for r in tables.get(scope, [])}
    rounding: dict[str, float] = {}
    # module -> whether every non-finite own error it had came on inputs already inf in the dtype, or on an
    # all-zero FP32 answer
    fed: dict[str, bool] = {}
    for d in data.divergence:
        if d["scope"] != scope:
            continue
        lost = rounding_around(d)
        if lost is not None and math.isfinite(lost):
            rounding[d["module"]] = max(lost, rounding.get(d["module"], 0.0))
        value = d.get("rel_l2")
        if value is not None and not math.isfinite(value):
            fed[d["module"]] = fed.get(d["module"], True) and excused_nonfinite(d)
    return culprits(worst, data.meta.get("dtype"), inherited=scope != "local", rounding=rounding,
                    fed_inf=[m for m, all_fed in fed.items() if all_fed],
                    unstable=[r["module"] for r in not_judged(data, scope)])


def not_judged(data: TraceData, scope: str | None) -> list[dict]:
    """The modules :func:`divergence_culprits` leaves out because FP32's own rounding moves their FP32 output past
    the line (``fp32_moved``, trace version 7), each with the largest value measured, in trace order."""
    from ampaudit.runtime.attribution import fp32_unstable

    out: dict[str, float] = {}
    for d in data.divergence:
        if d["scope"] == scope and fp32_unstable(d, data.meta.get("dtype")):
            out[d["module"]] = max(d["fp32_moved"], out.get(d["module"], 0.0))
    return [{"module": m, "fp32_moved": v} for m, v in out.items()]


def rank_by_verdict(rows: list[dict], found: list) -> list[dict]:
    """``rows`` (one scope of :func:`divergence_table`) with each culprit's verdict, culprits first in their rank."""
    by_name = {c.module: c for c in found}
    for r in rows:
        c = by_name.get(r["module"])
        r["verdict"] = None if c is None else {"rule": c.rule, "severity": c.severity, "rank": c.rank,
                                                "units": c.units, "ratio": c.ratio, "why": c.why}
    return sorted(rows, key=lambda r: (by_name[r["module"]].rank if r["module"] in by_name else math.inf,
                                       _worst_first(r)))


def first_jump(data: TraceData, found: list, scope: str | None) -> dict | None:
    """Where the error first shows: the earliest check in which a culprit's value in ``scope`` is past the line
    that flagged it, and in that check the first such culprit to finish (innermost first); None without culprits."""
    from ampaudit.runtime.attribution import first_crossing

    return first_crossing(found, ((d["module"], d["step"], d["rel_l2"]) for d in data.divergence
                                  if d["scope"] == scope))
