"""Instability precursors in a trace: where each signal crossed its published line, loss spikes, and what to do.

    from ampaudit.report.trace_precursors import precursor_summary, precursor_advice
    s = precursor_summary(data)          # data: a TraceData (ampaudit.report.trace_summary.collect)
    s["signals"][0]["crossed_step"], s["spikes"]["first"], s["diverged_step"]
    recs = precursor_advice(summary)     # summary["precursors"] is s: one recommendation per signal that crossed

The signals are the ``precursor`` events of trace version 3 (:mod:`ampaudit.runtime.precursors`); loss spikes come
from the ``step`` events (OLMo 2's spike score). Thresholds and citations: rules/policy/precursors.toml. Rows are
judged here, against the table, not against the ``threshold`` the writer recorded: an old trace is judged by the
current lines.
"""
from __future__ import annotations

import math
import statistics
from typing import Any

from ampaudit.policy import precursors as precursor_policy
from ampaudit.report.trace_data import as_step, finite, fmt, num

SIGNALS = ("attn_logit", "output_logit", "output_lse", "massive_activation")


def precursor_row(ev: dict, step: int | None) -> dict | None:
    """One ``precursor`` event, normalised (None when it names no known signal)."""
    signal = ev.get("signal")
    if signal not in SIGNALS:
        return None
    module = ev.get("module")
    # An event covers an interval: the pass its largest value was seen at, and the first pass at or past the
    # writer's line, when the writer recorded them (else the interval's step stands for both).
    seen, crossed = as_step(ev.get("max_step")), as_step(ev.get("crossed_step"))
    producer = ev.get("producer")      # output signals: the module that made the output (absent before it was kept)
    return {"step": step, "signal": signal, "module": module if isinstance(module, str) else "",
            "value": num(ev.get("value")), "absmax": finite(ev.get("absmax")), "median": finite(ev.get("median")),
            "max_step": seen if seen is not None else step, "crossed_step": crossed,
            "producer": producer if isinstance(producer, str) and producer else None}


def _logit_limit(dtype: Any) -> float:
    from ampaudit.runtime.precursors import logit_limit  # torch-free until a trace has output logits

    return logit_limit(dtype if isinstance(dtype, str) else None)


def _crossed(signal: str, row: dict, cfg: dict, limit: float) -> bool:
    v = row["value"]
    if signal == "massive_activation":
        c = cfg["massive_activation"]
        return row["absmax"] is not None and row["absmax"] >= c["min_abs"] and v is not None and v >= c["ratio"]
    if v is None:
        return False
    if math.isnan(v):
        return True
    if signal == "attn_logit":
        return v >= cfg["attn_logit"]["warning"]
    return abs(v) >= limit


def _level(signal: str, value: float | None, cfg: dict) -> str | None:
    """For attention logits: the published range the value is in (degradation from ~1e3, divergence ~1e4)."""
    if signal != "attn_logit" or value is None:
        return None
    c = cfg["attn_logit"]
    if not value < c["divergence"]:
        return "divergence"
    return "degradation" if value >= c["degradation"] else None


def loss_spikes(steps: list, cfg: dict | None = None) -> list[dict]:
    """Steps whose loss is more than ``sigmas`` standard deviations above the rolling mean of the previous
    ``window`` finite losses (OLMo 2), once ``min_history`` losses are known; ``steps``: StepRow-like rows."""
    c = cfg or precursor_policy()["loss_spike"]
    window, need, sigmas = int(c["window"]), int(c["min_history"]), float(c["sigmas"])
    history: list[float] = []
    found = []
    for r in steps:
        x = r.loss
        if x is None or not math.isfinite(x):
            continue
        if len(history) >= need:
            mean, std = statistics.fmean(history), statistics.pstdev(history)
            if std > 0 and x > mean + sigmas * std:
                found.append({"step": r.step, "loss": x, "mean": mean, "sigmas": (x - mean) / std})
        history.append(x)
        if len(history) > window:
            del history[0]
    return found


def _signal_rows(data: Any, cfg: dict, limit: float) -> list[dict]:
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in data.precursors:
        groups.setdefault((r["signal"], r["module"]), []).append(r)
    rows = []
    for (signal, module), rs in groups.items():
        vals = [(r["max_step"], r["value"]) for r in rs if r["value"] is not None]
        first = rs[0]["value"]
        key = (lambda sv: abs(sv[1])) if signal == "output_lse" else (lambda sv: sv[1])
        worst = max(vals, key=lambda sv: math.inf if math.isnan(sv[1]) else key(sv), default=(None, None))
        crossed = next((r for r in rs if _crossed(signal, r, cfg, limit)), None)
        at = None if crossed is None else crossed["crossed_step"] if crossed["crossed_step"] is not None \
            else crossed["max_step"]
        row = {"signal": signal, "module": module, "samples": len(rs), "max": worst[1], "max_step": worst[0],
               "first": first, "last": rs[-1]["value"], "crossed_step": at,
               "crossed_value": crossed["value"] if crossed else None, "level": _level(signal, worst[1], cfg),
               "threshold": _threshold(signal, cfg, limit)}
        if signal == "output_lse" and first is not None and rs[-1]["value"] is not None:
            row["drift"] = rs[-1]["value"] - first
        if signal == "massive_activation":
            row["absmax"] = max((r["absmax"] for r in rs if r["absmax"] is not None), default=None)
        if signal.startswith("output"):     # the last module named (None: an old trace, or none made the output)
            row["producer"] = next((r["producer"] for r in reversed(rs) if r.get("producer")), None)
        rows.append(row)
    # Crossed first (earliest first), then the rest by signal.
    rows.sort(key=lambda r: (r["crossed_step"] is None, r["crossed_step"] or 0, SIGNALS.index(r["signal"]),
                             r["module"]))
    return rows


def _threshold(signal: str, cfg: dict, limit: float) -> float:
    if signal == "attn_logit":
        return cfg["attn_logit"]["warning"]
    if signal == "massive_activation":
        return cfg["massive_activation"]["ratio"]
    return limit


def runs_fp8(data: Any) -> bool:
    """Whether the traced run had fp8 layers or an fp8 target: ``fp8``/``fp8_budget`` events, a ``recipe_stats``
    row of an fp8 recipe (float8_*, mxfp8), or a header whose dtype or precision names float8."""
    if data.fp8 or data.fp8_budget:
        return True
    if any("fp8" in (r.get("recipe") or "") or (r.get("recipe") or "").startswith("float8") for r in data.recipes):
        return True
    return any(isinstance(data.meta.get(k), str) and ("float8" in data.meta[k] or "fp8" in data.meta[k])
               for k in ("dtype", "precision"))


def precursor_summary(data: Any) -> dict:
    """``{"signals": [...], "spikes": {...}, "diverged_step", "fp8"}``: one row per signal and module (the largest
    value, the first step it crossed its line), the loss spikes, the first step whose loss is not finite or spikes,
    and whether the run had fp8 layers (:func:`runs_fp8`: massive activations are a warning only then)."""
    cfg = precursor_policy()
    limit = _logit_limit(data.meta.get("dtype")) if any(r["signal"].startswith("output") for r in data.precursors) \
        else math.inf
    spikes = loss_spikes(data.steps, cfg["loss_spike"])
    judged = max(0, sum(1 for r in data.steps if r.loss is not None and math.isfinite(r.loss))
                 - int(cfg["loss_spike"]["min_history"]))
    nonfinite = next((r.step for r in data.steps if r.loss is not None and not math.isfinite(r.loss)), None)
    candidates = [s for s in (nonfinite, spikes[0]["step"] if spikes else None) if s is not None]
    return {"signals": _signal_rows(data, cfg, limit),
            "spikes": {"count": len(spikes), "score": len(spikes) / judged if judged else None,
                       "first": spikes[0] if spikes else None, "steps": [s["step"] for s in spikes[:50]],
                       "sigmas": cfg["loss_spike"]["sigmas"]},
            "diverged_step": min(candidates) if candidates else None, "fp8": runs_fp8(data)}


def where_of(row: dict) -> str:
    """A row's module in words: the output signals' module ``""`` is the model's output, and the module that made
    it, when the trace names one (``producer``), is what there is to act on."""
    if row["module"]:
        return row["module"]
    return f"{row['producer']}'s output (the model's output)" if row.get("producer") else "the model's output"


def _message(row: dict, cfg: dict, before: int | None, fp8: bool = True) -> str:
    where = where_of(row)
    at = f"crossed {fmt(row['threshold'])} at step {row['crossed_step']}"
    then = f" and reached {fmt(row['max'])} at step {row['max_step']}"
    ahead = f", {before - row['crossed_step']} steps before the loss broke at step {before}" \
        if before is not None and row["crossed_step"] is not None and row["crossed_step"] < before else ""
    if row["signal"] == "attn_logit":
        level = {"degradation": "; runs degrade from ~1e3", "divergence": "; runs past ~1e4 diverged"}.get(
            row["level"] or "", "; runs degrade from ~1e3 and diverge past ~1e4")
        return (f"attention logits grow in {where}: the largest pre-softmax logit {at}{then}{ahead}{level} "
                f"(Wortsman et al. 2023; Kimi K2 caps it at 100)")
    if row["signal"] in ("output_logit", "output_lse"):
        what = "largest top |logit| (a row's max)" if row["signal"] == "output_logit" else "mean log-sum-exp (log Z)"
        return (f"output logits diverge: the {what} of {where} {at}{then}{ahead}, where the run's dtype spaces "
                f"logits {cfg['output_logit']['max_spacing']:g} nats apart or more")
    return (f"massive activations in {where}: its |output| max over its median |x| {at}{then}{ahead}, with values "
            f"up to {fmt(row['absmax'])} (Sun et al. 2024: > {fmt(cfg['massive_activation']['min_abs'])} and ~1000x "
            "the median; one per-tensor fp8 scale then flushes the rest)"
            + ("" if fp8 else "; this run has no fp8 layers, so it matters only for fp8 scaling"))


def severity(signal: str, fp8: bool) -> str:
    """A crossed signal's severity: massive activations break per-tensor fp8 scaling (Sun et al. 2024), so they
    warn only in a run with fp8 layers and are an info otherwise; the other signals always warn."""
    return "info" if signal == "massive_activation" and not fp8 else "warning"


def precursor_advice(summary: dict) -> list[dict]:
    """One ``precursor`` recommendation per signal that crossed its line (the earliest module first, others
    listed), and one ``loss_spike`` when the loss spiked; each with the published fixes."""
    s = summary.get("precursors") or {}
    cfg = precursor_policy()
    before = s.get("diverged_step")
    fp8 = s.get("fp8", True)        # a summary without the field (an older caller's) keeps the warning
    recs = []
    by_signal: dict[str, list[dict]] = {}
    for row in s.get("signals", []):
        if row["crossed_step"] is not None:
            by_signal.setdefault("output" if row["signal"].startswith("output") else row["signal"], []).append(row)
    for family, rows in by_signal.items():
        first = rows[0]
        section = "output_logit" if family == "output" else family
        others = [r["module"] or "<output>" for r in rows[1:] if r["module"] != first["module"]]
        more = f" Also: {', '.join(others[:5])}." if others else ""
        made = first.get("producer") if family == "output" else None
        fixes = [f.format(module=made) for f in cfg[section]["module_fixes"]] if made else cfg[section]["fixes"]
        recs.append({"kind": "precursor", "severity": severity(first["signal"], fp8), "signal": first["signal"],
                     # the modules to act on: for the output, the one that made it where the trace says
                     "modules": sorted({r.get("producer") or r["module"] for r in rows}), "step": first["crossed_step"],
                     "value": first["crossed_value"], "max": first["max"],
                     "message": f"{_message(first, cfg, before, fp8)}.{more} Fix: {'; '.join(fixes)}."})
    spike = (s.get("spikes") or {}).get("first")
    if spike:
        count = s["spikes"]["count"]
        recs.append({"kind": "loss_spike", "severity": "warning", "step": spike["step"], "value": spike["loss"],
                     "message": f"the loss spiked at step {spike['step']}: {spike['loss']:.4g}, "
                                f"{spike['sigmas']:.1f} standard deviations above its rolling mean "
                                f"{spike['mean']:.4g} (OLMo 2 counts {s['spikes']['sigmas']:g}); {count} spike"
                                f"{'s' if count != 1 else ''} in all. Fix: "
                                f"{'; '.join(cfg['loss_spike']['fixes'])}."})
    return recs
