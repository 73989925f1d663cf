"""A trace's mixed-precision health as one plain dict: steps, skips, loss scale, first non-finite, divergence,
headroom, float8 layers (:mod:`ampaudit.report.trace_fp8`), gradient magnitudes (:mod:`ampaudit.report.grad_hist`),
swamping of low-precision state (:mod:`ampaudit.report.trace_swamping`), instability precursors and loss spikes
(:mod:`ampaudit.report.trace_precursors`), recommendations.

    from ampaudit.report.trace_summary import summarize_trace
    summary = summarize_trace("run.jsonl", top=5)
    summary["scale"]["min_log2"], summary["first_nonfinite"]["module"], summary["recommendations"][0]["message"]

``collect(events)`` groups the raw events into a :class:`TraceData` (what the HTML page plots); ``summarize`` turns
that into the dict (what the terminal prints and ``--json`` emits). Both are tolerant: unknown events and fields are
ignored, missing or malformed fields become ``None``, never an exception. Non-finite floats in the dict are written
as the strings ``"inf"``/``"-inf"``/``"nan"`` (as the trace itself does) so it is always valid JSON.
"""
from __future__ import annotations

import math
import os
import statistics
from typing import Any, Iterable

from ampaudit.report.trace_data import StepRow, TraceData, as_step, finite, log2, num, text
from ampaudit.runtime.trace import jsonable, read_trace
from ampaudit.runtime.trace_schema import ENVELOPE, TRACE_VERSION

SUMMARY_VERSION = 1

# A binary file read as a trace has a problem per line; the summary keeps the first ones and the count.
MAX_PROBLEMS = 50


def collect(events: Iterable[dict]) -> TraceData:
    """Group events by kind. A step event without a step number gets the previous one plus one."""
    # The readers of one kind load only when a trace is read (grad_hist imports torch).
    from ampaudit.report.grad_hist import hist_row
    from ampaudit.report.trace_decisions import decision_row
    from ampaudit.report.trace_eval import eval_row
    from ampaudit.report.trace_fp8 import budget_row, fp8_row
    from ampaudit.report.trace_precursors import precursor_row
    from ampaudit.report.trace_swamping import overflow_row, preflight_rows, swamping_row
    from ampaudit.report.trace_recipes import fallback_row, recipe_row

    # Kinds read by their own module's row function into one TraceData list (a None row is skipped).
    rows = {"grad_hist": (hist_row, "grad_hist"), "fp8": (fp8_row, "fp8"), "fp8_budget": (budget_row, "fp8_budget"),
            "eval": (eval_row, "evals"), "swamping": (swamping_row, "swamping"), "precursor": (precursor_row,
            "precursors"), "state_overflow": (overflow_row, "overflows"), "decision": (decision_row, "decisions"),
            "recipe_stats": (recipe_row, "recipes"), "fallback": (fallback_row, "fallbacks"),
            "stats": (_stats_row, "stats"), "nonfinite": (_nonfinite_row, "nonfinite"),
            "divergence": (_divergence_row, "divergence")}
    data = TraceData()
    last_step = 0
    for ev in events:
        if not isinstance(ev, dict):
            continue
        kind = ev.get("event")
        step = as_step(ev.get("step"))
        if kind == "meta":
            if not data.meta:
                data.meta = {k: v for k, v in ev.items() if k not in ENVELOPE}
        elif kind == "step":
            step = step if step is not None else last_step + 1
            last_step = step
            scale = finite(ev.get("scale"))
            data.steps.append(StepRow(
                step=step, loss=num(ev.get("loss")), scale=scale if scale and scale > 0 else None,
                skipped=ev.get("skipped") is True, grad_norm=num(ev.get("grad_norm")),
                clipped=ev.get("clipped") is True, lr=finite(ev.get("lr")), time=finite(ev.get("time"))))
        elif kind == "skip":
            mods = ev.get("modules")
            params = ev.get("params")
            data.skips.append({
                "step": step, "scale": finite(ev.get("scale")),
                "modules": [m for m in mods if isinstance(m, str)] if isinstance(mods, list) else [],
                "params": [p for p in params if isinstance(p, str)] if isinstance(params, list) else []})
        elif kind == "checkpoint":
            data.checkpoints.append({"step": step, "path": text(ev.get("path"))})
        elif kind == "halt":
            diag = ev.get("diagnosis")
            data.halts.append({"step": step, "reason": text(ev.get("reason")),
                               "diagnosis": diag if isinstance(diag, dict) else None})
        elif kind in rows:
            read, into = rows[kind]
            row = read(ev, step)
            if row is not None:
                getattr(data, into).append(row)
        elif kind == "preflight":
            data.preflight += preflight_rows(ev)
        else:
            name = str(kind)
            data.unknown[name] = data.unknown.get(name, 0) + 1
    return data


def _stats_row(ev: dict, step: int | None) -> dict:
    numel = finite(ev.get("numel"))
    return {
        "step": step, "module": text(ev.get("module")) or "", "phase": text(ev.get("phase")) or "forward",
        "absmax": num(ev.get("absmax")), "headroom_bits": num(ev.get("headroom_bits")),
        "inf": finite(ev.get("inf")) or 0.0, "nan": finite(ev.get("nan")) or 0.0,
        # finite values above the dtype's max (an fp32 tensor that would not fit), and passes whose
        # output held inf/NaN (counted even on passes without full counts)
        "overflow": finite(ev.get("overflow")) or 0.0,
        "nonfinite_passes": finite(ev.get("nonfinite_passes")) or 0.0,
        "subnormal_frac": (finite(ev.get("subnormal")) or 0.0) / numel if numel else None,
        "zeros_frac": (finite(ev.get("zeros")) or 0.0) / numel if numel else None,
        "dtype": text(ev.get("dtype"))}          # the output's own dtype; None before v6


def _nonfinite_row(ev: dict, step: int | None) -> dict:
    return {
        "step": step, "phase": text(ev.get("phase")), "module": text(ev.get("module")),
        "op": text(ev.get("op")), "source": text(ev.get("source")), "kind": text(ev.get("kind")),
        # the loss scaler's probing (gone with the gradient unscaled), not a fault; absent before v6
        "scaled_only": ev.get("scaled_only") is True}


def _divergence_row(ev: dict, step: int | None) -> dict:
    return {
        "step": step, "module": text(ev.get("module")) or "", "scope": text(ev.get("scope")) or "global",
        "param": text(ev.get("param")), "rel_l2": num(ev.get("rel_l2")), "cosine": num(ev.get("cosine")),
        "max_abs": num(ev.get("max_abs")), "sqnr_db": num(ev.get("sqnr_db")),
        "input_rel_l2": num(ev.get("input_rel_l2")), "output_rel_l2": num(ev.get("output_rel_l2")),
        "fp32_moved": num(ev.get("fp32_moved"))}       # absent before v7


def _steps_summary(data: TraceData) -> dict:
    rows = data.steps
    skipped = data.skipped_steps
    losses = [r.loss for r in rows if r.loss is not None]
    finite_losses = [x for x in losses if math.isfinite(x)]
    norms = [r.grad_norm for r in rows if r.grad_norm is not None]
    finite_norms = [x for x in norms if math.isfinite(x)]
    times = [r.time for r in rows if r.time is not None]
    return {
        "steps": {
            "count": len(rows),
            "first": rows[0].step if rows else None,
            "last": rows[-1].step if rows else None,
            "skipped": len(skipped),
            "skipped_steps": skipped,
            "skip_rate": len(skipped) / len(rows) if rows else None,
            "clipped": sum(r.clipped for r in rows),
            "mean_time": statistics.fmean(times) if times else None,
        },
        "loss": {
            "first": finite_losses[0] if finite_losses else None,
            "last": finite_losses[-1] if finite_losses else None,
            "min": min(finite_losses) if finite_losses else None,
            "nonfinite": len(losses) - len(finite_losses),
        },
        "grad_norm": {
            "median": statistics.median(finite_norms) if finite_norms else None,
            "max": max(finite_norms) if finite_norms else None,
            "nonfinite": len(norms) - len(finite_norms),
        },
    }


def _scale_summary(data: TraceData) -> dict:
    scales = [(r.step, r.scale) for r in data.steps if r.scale is not None]
    if not scales:
        return {"used": False}
    values = [s for _, s in scales]
    backoffs = sum(1 for a, b in zip(values, values[1:]) if b < a)
    growths = sum(1 for a, b in zip(values, values[1:]) if b > a)
    lo, hi = min(values), max(values)
    return {
        "used": True, "initial": values[0], "final": values[-1], "min": lo, "max": hi,
        "initial_log2": log2(values[0]), "final_log2": log2(values[-1]),
        "min_log2": log2(lo), "max_log2": log2(hi),
        "min_step": next(st for st, s in scales if s == lo),
        "backoffs": backoffs, "growths": growths,
    }


def _nonfinite_summary(data: TraceData) -> tuple[dict | None, dict]:
    # Overflows only the scaled gradient has are the scaler's skipped steps (the skip events), not a culprit.
    probes = sum(e["scaled_only"] for e in data.nonfinite)
    events = [e for e in data.nonfinite if not e["scaled_only"]]
    first = None
    if events:
        # Events arrive in order; a step number, when present, decides ties between producers.
        first = min(enumerate(events), key=lambda ie: (ie[1]["step"] if ie[1]["step"] is not None else math.inf,
                                                       ie[0]))[1]
    by_module: dict[str, int] = {}
    for e in events:
        key = e["module"] if e["module"] is not None else "?"
        by_module[key] = by_module.get(key, 0) + 1
    skip_modules: dict[str, int] = {}
    for s in data.skips:
        for m in s["modules"]:
            skip_modules[m] = skip_modules.get(m, 0) + 1
    first = {k: v for k, v in first.items() if k != "scaled_only"} if first else None
    return (first,
            {"count": len(events), "by_module": dict(sorted(by_module.items(), key=lambda kv: -kv[1])),
             "skip_modules": dict(sorted(skip_modules.items(), key=lambda kv: -kv[1])), "scaled_only": probes})


def headroom_table(data: TraceData) -> list[dict]:
    """One row per module: the least headroom (bits below the dtype's max) seen per phase and when; inf, NaN and
    above-max counts; passes with non-finite output; the largest subnormal fraction. Least headroom (forward
    first) first."""
    rows: dict[str, dict] = {}
    for s in data.stats:
        row = rows.setdefault(s["module"], {
            "module": s["module"], "forward_bits": None, "forward_step": None, "backward_bits": None,
            "backward_step": None, "max_absmax": None, "inf": 0.0, "nan": 0.0, "overflow": 0.0,
            "nonfinite_passes": 0.0, "subnormal_frac": None, "samples": 0, "dtypes": set()})
        row["samples"] += 1
        if s["dtype"]:
            row["dtypes"].add(s["dtype"])
        for key in ("inf", "nan", "overflow", "nonfinite_passes"):
            row[key] += s[key]
        if s["subnormal_frac"] is not None:
            row["subnormal_frac"] = max(row["subnormal_frac"] or 0.0, s["subnormal_frac"])
        if s["absmax"] is not None and not math.isnan(s["absmax"]):
            row["max_absmax"] = s["absmax"] if row["max_absmax"] is None else max(row["max_absmax"], s["absmax"])
        bits = s["headroom_bits"]
        phase = "backward" if s["phase"] == "backward" else "forward"
        if bits is not None and not math.isnan(bits):
            if row[f"{phase}_bits"] is None or bits < row[f"{phase}_bits"]:
                row[f"{phase}_bits"], row[f"{phase}_step"] = bits, s["step"]
    for row in rows.values():
        for key in ("inf", "nan", "overflow", "nonfinite_passes"):
            row[key] = int(row[key])
        # The module's output dtype where every sample agrees (a module computing in FP32 is "float32").
        dtypes = row.pop("dtypes")
        row["dtype"] = next(iter(dtypes)) if len(dtypes) == 1 else None
    return sorted(rows.values(), key=lambda r: (
        r["forward_bits"] if r["forward_bits"] is not None else math.inf,
        r["backward_bits"] if r["backward_bits"] is not None else math.inf))


def summarize(events: Iterable[dict] | TraceData, problems: Iterable[str] = (), *, top: int = 5,
              findings: list[dict] | None = None, trace: str | None = None) -> dict:
    """The summary dict of a run. ``findings`` (from ``ampaudit check --format json``) lets the
    recommendations name the check findings the run confirmed. ``top`` bounds the module tables."""
    from ampaudit.policy import divergence_thresholds
    from ampaudit.report.grad_hist import grad_hist_summary
    from ampaudit.report.trace_decisions import decision_summary
    from ampaudit.report.trace_divergence import (divergence_culprits, divergence_table, first_jump, not_judged,
                                                  rank_by_verdict)
    from ampaudit.report.trace_eval import eval_summary
    from ampaudit.report.trace_fp8 import fp8_summary
    from ampaudit.report.trace_precursors import precursor_summary
    from ampaudit.report.trace_swamping import swamping_summary
    from ampaudit.report.trace_recipes import recipes_summary

    data = events if isinstance(events, TraceData) else collect(events)
    problems = list(problems)
    version = data.meta.get("version")
    if isinstance(version, int) and version > TRACE_VERSION:
        problems.append(f"trace version {version} is newer than this ampaudit reads ({TRACE_VERSION}): "
                        "events it does not know are left out")
    top = max(1, int(top))
    first_nonfinite, nonfinite = _nonfinite_summary(data)
    scope = data.divergence_scope()
    # Own error is judged against the run's dtype: 1.6% is a fault in fp16 and rounding noise in bf16.
    high = divergence_thresholds(data.meta.get("dtype"))[0]
    tables = divergence_table(data, high)
    found = divergence_culprits(data, tables, scope)
    if scope:
        tables[scope] = rank_by_verdict(tables[scope], found)
    headroom = headroom_table(data)
    summary: dict[str, Any] = {
        "version": SUMMARY_VERSION,
        "trace": trace,
        "meta": data.meta,
        "problems": problems[:MAX_PROBLEMS],
        "problems_total": len(problems),
        **_steps_summary(data),
        "scale": _scale_summary(data),
        "first_nonfinite": first_nonfinite,
        "nonfinite": nonfinite,
        "divergence": {"scope": scope, "modules": len(tables.get(scope, [])) if scope else 0,
                       "top": tables.get(scope, [])[:top] if scope else [],
                       "grad_top": tables.get("grad", [])[:top], "threshold": high,
                       "culprits": [c.as_dict() for c in found],
                       "first_jump": first_jump(data, found, scope),
                       "not_judged": not_judged(data, scope)},
        "headroom": {"modules": len(headroom), "top": headroom[:top]},
        "fp8": fp8_summary(data),
        "recipes": recipes_summary(data),
        "grad_hist": grad_hist_summary(data, top=top),
        "eval": eval_summary(data),
        "swamping": swamping_summary(data),
        "decisions": decision_summary(data),
        "precursors": precursor_summary(data),
        "checkpoints": len(data.checkpoints),
        "last_checkpoint": data.checkpoints[-1]["path"] if data.checkpoints else None,
        "halt": data.halts[-1] if data.halts else None,
        "unknown_events": data.unknown,
    }
    # Advice looks at every module, not only the top rows shown.
    summary["recommendations"] = recommend(summary, data, culprits=found, all_headroom=headroom, findings=findings)
    return jsonable(summary)


def recommend(summary: dict, data: TraceData, *, culprits: list, all_headroom: list[dict],
              findings: list[dict] | None = None) -> list[dict]:
    """The recommendations of a summary (:mod:`ampaudit.report.trace_advice` lists the kinds), most severe first:
    the run-wide ones, then each kind's reader's."""
    from ampaudit.report.grad_hist import grad_hist_advice
    from ampaudit.report.trace_advice import run_advice
    from ampaudit.report.trace_decisions import decision_advice, decision_evidence
    from ampaudit.report.trace_eval import eval_advice
    from ampaudit.report.trace_precursors import precursor_advice
    from ampaudit.report.trace_recipes import fallback_advice
    from ampaudit.report.trace_swamping import overflow_advice, swamping_advice

    # Flipped decisions confirm findings too (AMP702); their advice is their own recommendation, not keep_fp32's.
    recs = run_advice(summary, data, culprits=culprits, all_headroom=all_headroom, findings=findings,
                      extra_evidence=decision_evidence(summary))
    recs += [grad_hist_advice(summary), eval_advice(summary), overflow_advice(summary), swamping_advice(summary),
             decision_advice(summary),
             *precursor_advice(summary), fallback_advice(summary)]
    order = {"error": 0, "warning": 1, "info": 2}
    return sorted((r for r in recs if r), key=lambda r: order[r["severity"]])


def summarize_trace(path: str | os.PathLike, *, top: int = 5, findings: list[dict] | None = None) -> dict:
    """Read a trace file and summarise it; unreadable lines end up in ``summary["problems"]``.
    Raises :class:`~ampaudit.errors.TraceError` when the file does not exist."""
    events, problems = read_trace(path)
    return summarize(events, problems, top=top, findings=findings, trace=str(path))


def probing_note(overflows: int) -> str:
    """What ``overflows`` non-finite events only the loss-scaled gradient had were (trace v6 ``scaled_only``): the
    dynamic scaler probing, not a fault; "" for none."""
    if not overflows:
        return ""
    many = overflows != 1
    return (f"{overflows} overflow{'s were' if many else ' was'} the loss scaler's own probing: "
            f"{'skipped steps' if many else 'a skipped step'}, as designed")
