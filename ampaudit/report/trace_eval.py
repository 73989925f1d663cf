"""A trace's evaluations (``eval`` events of ``ampaudit train --eval-every``): autocast against FP32 per eval, the
gaps beyond noise, the advice, and their lines in the terminal.

    data = collect(events)                  # ampaudit.report.trace_summary: fills data.evals with eval_row()
    eval_summary(data)
    # {"count": 2, "dtype": "float16", "last": {"step": 4, "batches": 8, "samples": 512,
    #   "quantities": {"loss": {"autocast": 2.36, "fp32": 0.0018, "gap": 2.36, "noise": 0.0002}, "top1": {...}}},
    #  "beyond_noise": [{"step": 2, "name": "loss", "autocast": ..., "fp32": ..., "gap": ..., "noise": ...,
    #                    "threshold": ...}, ...]}
    eval_advice(summary)                    # a recommendation dict (kind "eval_gap") or None

A gap is beyond noise when ``|gap|`` exceeds both ``noise_sigmas`` standard errors of the FP32 value and
``min_relative_gap`` of it (``rules/policy/settings.toml``, section ``evaluation``); a non-finite gap always is.
Tolerant like the rest of the summary: malformed fields become ``None`` and a quantity without both values is
never judged.
"""
from __future__ import annotations

import math
from typing import Any

from ampaudit.report.trace_data import fmt, num

VALUES = ("autocast", "fp32", "gap", "noise")


def eval_row(ev: dict, step: int | None) -> dict:
    """One ``eval`` event as a row: step, dtype, batches, samples, and ``quantities`` (the loss first)."""
    quantities: dict[str, dict] = {}
    metrics = ev.get("metrics") if isinstance(ev.get("metrics"), dict) else {}
    for name, q in [("loss", ev.get("loss")), *metrics.items()]:
        if isinstance(q, dict):
            quantities[str(name)] = {k: num(q.get(k)) for k in VALUES}
    return {"step": step, "dtype": ev.get("dtype") if isinstance(ev.get("dtype"), str) else None,
            "batches": num(ev.get("batches")), "samples": num(ev.get("samples")), "quantities": quantities}


def thresholds() -> dict[str, float]:
    """The ``evaluation`` section of ``rules/policy/settings.toml``: noise_sigmas, min_relative_gap, ..."""
    from ampaudit.policy import settings

    return {k: float(v) for k, v in settings()["evaluation"].items()}


def judge(q: dict, limits: dict[str, float]) -> float | None:
    """The largest gap within noise when the quantity's gap is beyond it (a non-finite gap always is), else None
    (within noise, or not judged: a value missing, or a non-finite FP32 value to hold the other against)."""
    amp, fp32, noise = q.get("autocast"), q.get("fp32"), q.get("noise")
    if amp is None or fp32 is None or not math.isfinite(fp32):
        return None
    if noise is not None and math.isfinite(noise):
        allowed = max(limits["noise_sigmas"] * noise, limits["min_relative_gap"] * abs(fp32))
    else:
        allowed = limits["relative_gap_without_noise"] * abs(fp32)
    gap = amp - fp32
    return allowed if not math.isfinite(gap) or abs(gap) > allowed else None


def eval_summary(data: Any) -> dict:
    """``{"count", "dtype", "last", "beyond_noise"}`` of a :class:`~ampaudit.report.trace_summary.TraceData`."""
    rows = list(data.evals)
    if not rows:
        return {"count": 0, "dtype": None, "last": None, "beyond_noise": []}
    limits = thresholds()
    beyond = []
    for row in rows:
        for name, q in row["quantities"].items():
            allowed = judge(q, limits)
            if allowed is not None:
                gap = q["autocast"] - q["fp32"]
                beyond.append({"step": row["step"], "name": name, "autocast": q["autocast"], "fp32": q["fp32"],
                               "gap": gap, "noise": q["noise"], "threshold": allowed})
    return {"count": len(rows), "dtype": rows[-1]["dtype"], "last": rows[-1], "beyond_noise": beyond}


def eval_advice(summary: dict) -> dict | None:
    """The recommendation when an evaluation under autocast differs from FP32 beyond noise, else None."""
    ev = summary.get("eval") or {}
    beyond = ev.get("beyond_noise") or []
    if not beyond:
        return None
    step = beyond[-1]["step"]
    flagged = [b for b in beyond if b["step"] == step]
    evals = len({b["step"] for b in beyond})
    shown = ", ".join(f"{b['name']} {fmt(b['autocast'], '.4g')} vs {fmt(b['fp32'], '.4g')} (gap {b['gap']:+.3g}, "
                      f"noise {fmt(b['noise'], '.4g')})" for b in flagged[:4])
    dtype = ev.get("dtype") or "low-precision"
    return {"kind": "eval_gap", "severity": "warning", "steps": sorted({b["step"] for b in beyond}),
            "message": f"evaluation under {dtype} autocast differs from FP32 beyond noise on {evals} of "
                       f"{ev['count']} evals (step {step}: {shown}): the same weights score differently, so report "
                       "the FP32 numbers, and find the layer that loses precision (ampaudit check --calibrate, "
                       "or ampaudit train --divergence-every N --trace FILE)"}


def render_eval(ev: dict, console: Any) -> None:
    """The evaluation section of ``ampaudit report`` in the terminal: the last eval, and the gaps beyond noise."""
    from rich.markup import escape

    last = ev["last"]
    console.print(f"\n[bold]Evaluation[/] ({ev['count']} evals, {escape(str(ev.get('dtype') or '?'))} autocast | "
                  f"FP32; last at step {last['step']}, {int(last['samples'] or 0)} samples)")
    flagged = {(b["step"], b["name"]) for b in ev["beyond_noise"]}
    for name, q in last["quantities"].items():
        mark = "[yellow]![/]" if (last["step"], name) in flagged else " "
        gap = "-" if q["gap"] is None else f"{q['gap']:+.3g}"
        console.print(f"  {mark} {escape(name)}: {fmt(q['autocast'], '.4g')} | {fmt(q['fp32'], '.4g')}  gap {gap}  "
                      f"noise {fmt(q['noise'], '.4g')}")


__all__ = ["eval_advice", "eval_row", "eval_summary", "judge", "render_eval", "thresholds"]
