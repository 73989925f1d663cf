"""Why loss scaling exists, from a trace: the run's activation gradients by magnitude against the dtype's range.

    data = collect(events)                   # ampaudit.report.trace_summary: fills data.grad_hist
    s = grad_hist_summary(data)
    s["unscaled"]["flushed_share"]           # share of nonzero gradients that round to 0 without loss scaling
    s["scaled"]["subnormal_share"]           # ... that are subnormal at the run's loss scale
    s["init_scale_log2"], s["fits"]          # an initial scale: lifts the low tail, keeps the max below overflow

``grad_hist`` events (:mod:`ampaudit.runtime.grad_hist`) count gradient values by ``floor(log2|g|)`` as measured,
at the loss scale ``scale`` they carried. Shifted down by ``log2(scale)`` (rounded to a whole power of two) they
are the gradients without scaling. An event without a scale takes the ``step`` events' scale at its step, else 1
(``scale_source`` says which). The run's totals sum the leaf modules only: a container's output gradient is
mostly its last child's again.

Against the dtype (the trace's ``meta`` dtype, from ``torch.finfo``; a gradient that stays fp32 under autocast is
judged as if it were in that dtype, as the ``stats`` counts are): a value below half the smallest subnormal
(2^-25 in fp16) rounds to zero ("flushed"), one below the smallest normal (2^-14) keeps fewer mantissa bits
("subnormal"), one from 2^(floor(log2 max) + 1) on overflows. The initial scale 2^k is the smallest that lifts
all but ``low_share`` of the nonzero gradients to the smallest normal, capped so the largest gradient stays
``headroom_bits`` below the max (``rules/policy/settings.toml`` [grad_hist]); ``fits`` is False when no scale
does both (then the cap is suggested, and bfloat16 fits the range).
"""
from __future__ import annotations

import bisect
import math
from typing import Any

import torch

from ampaudit.dtypes import by_name, name_of
from ampaudit.report.trace_advice import init_scale_code
from ampaudit.report.trace_data import finite, num


def hist_row(ev: dict, step: int | None) -> dict | None:
    """One ``grad_hist`` event as a row (None when its bins are unusable): exponent -> count, zeros, scale."""
    lo, counts = num(ev.get("lo")), ev.get("counts")
    if lo is None or not lo.is_integer() or not isinstance(counts, list):
        return None
    bins = {}
    for i, n in enumerate(counts):
        n = finite(n)
        if n is not None and n > 0:
            bins[int(lo) + i] = int(n)
    scale = finite(ev.get("scale"))
    module = ev.get("module")
    return {"step": step, "module": module if isinstance(module, str) else "",
            "phase": ev.get("phase") if isinstance(ev.get("phase"), str) else "backward", "bins": bins,
            "zeros": int(finite(ev.get("zeros")) or 0), "nonfinite": int(finite(ev.get("nonfinite")) or 0),
            "scale": scale if scale and scale > 0 else None}


def dtype_range(dtype: Any) -> dict:
    """log2 of the dtype's smallest subnormal and normal, and ``floor(log2 max)``; float16 when unknown."""
    from ampaudit.dtypes import limits

    dt = by_name(dtype) if isinstance(dtype, str) else None
    if dt not in (torch.float16, torch.bfloat16, torch.float32):
        dt = torch.float16
    lim = limits(dt)
    return {"dtype": name_of(dt), "min_subnormal_log2": round(math.log2(lim.subnormal)),
            "min_normal_log2": round(math.log2(lim.normal)), "max_log2": math.floor(math.log2(lim.max))}


def _leaves(modules: set[str]) -> set[str]:
    """The names without a child (another name below them after a dot); ``""`` is the parent of every other name."""
    parents = {m[:i] for m in modules for i, c in enumerate(m) if c == "."}
    if any(m != "" for m in modules):
        parents.add("")
    return modules - parents


def _scale_log2(row: dict, steps: list[int], scales: list[float | None]) -> tuple[int, str]:
    """log2 of the loss scale in ``row``'s counts, and where it came from (``steps``/``scales``: the step events)."""
    if row["scale"] is not None:
        return round(math.log2(row["scale"])), "trace"
    if not steps:
        return 0, "unknown"
    i = bisect.bisect_right(steps, row["step"]) - 1 if row["step"] is not None else len(steps) - 1
    scale = scales[max(i, 0)]
    # A step event without a scale: the run had no scaler.
    return (round(math.log2(scale)) if scale else 0), "steps"


def _add(into: dict[int, int], bins: dict[int, int], shift: int) -> None:
    for e, n in bins.items():
        into[e + shift] = into.get(e + shift, 0) + n


def shares(hist: dict[int, int], rng: dict) -> dict:
    """Shares of the nonzero finite values in ``hist`` (exponent -> count) that flush to 0, are subnormal (and
    not flushed), overflow; and the lowest and highest exponent."""
    total = sum(hist.values())
    if not total:
        return {"values": 0, "flushed_share": None, "subnormal_share": None, "overflow_share": None,
                "min_log2": None, "max_log2": None}
    cut = rng["min_subnormal_log2"] - 1             # below half the smallest subnormal: rounds to zero
    flushed = sum(n for e, n in hist.items() if e < cut)
    sub = sum(n for e, n in hist.items() if cut <= e < rng["min_normal_log2"])
    over = sum(n for e, n in hist.items() if e > rng["max_log2"])
    return {"values": total, "flushed_share": flushed / total, "subnormal_share": sub / total,
            "overflow_share": over / total, "min_log2": min(hist), "max_log2": max(hist)}


def fit_scale(hist: dict[int, int], rng: dict, *, low_share: float, headroom_bits: float) -> dict:
    """The initial loss scale 2^k for gradients ``hist`` (unscaled): see the module docstring."""
    total = sum(hist.values())
    if not total:
        return {"init_scale_log2": None, "needed_log2": None, "max_scale_log2": None, "fits": None}
    below, low = 0, min(hist)
    for e in sorted(hist):              # the lowest bin with at most low_share of the values below it
        if below + hist[e] > low_share * total:
            low = e
            break
        below += hist[e]
    needed = rng["min_normal_log2"] - low
    cap = math.floor(rng["max_log2"] - headroom_bits - max(hist))
    fits = needed <= cap
    k = min(max(needed, 0), cap)
    return {"init_scale_log2": k, "needed_log2": needed, "max_scale_log2": cap, "fits": fits}


def run_histograms(data: Any) -> dict:
    """The run's leaf-module histograms summed, unscaled and as measured; per module the unscaled ones."""
    rows = data.grad_hist
    leaves = _leaves({r["module"] for r in rows})
    unscaled: dict[int, int] = {}
    measured: dict[int, int] = {}
    per_module: dict[str, dict[int, int]] = {}
    zeros = nonfinite = 0
    sources: set[str] = set()
    used: list[int] = []               # log2 of the scale of each leaf row
    ordered = sorted(((r.step, r.scale) for r in data.steps if r.step is not None), key=lambda x: x[0])
    steps, step_scales = [st for st, _ in ordered], [sc for _, sc in ordered]
    for r in rows:
        k, source = _scale_log2(r, steps, step_scales)
        sources.add(source)
        per = per_module.setdefault(r["module"], {})
        _add(per, r["bins"], -k)
        if r["module"] not in leaves:
            continue
        used.append(k)
        _add(unscaled, r["bins"], -k)
        _add(measured, r["bins"], 0)
        zeros += r["zeros"]
        nonfinite += r["nonfinite"]
    source = "trace" if sources == {"trace"} else "unknown" if "unknown" in sources else "steps"
    return {"unscaled": unscaled, "measured": measured, "per_module": per_module, "zeros": zeros,
            "nonfinite": nonfinite, "scale_log2": used[-1] if used else None, "scale_source": source,
            "scaled_run": any(k != 0 for k in used)}


def grad_hist_summary(data: Any, *, top: int = 5, hists: dict | None = None) -> dict | None:
    """The summary's ``grad_hist`` section (see the module docstring); None when the trace has no histograms.
    ``hists``: :func:`run_histograms` of ``data`` when the caller has them already."""
    from ampaudit.policy import settings

    if not data.grad_hist:
        return None
    cfg = settings()["grad_hist"]
    rng = dtype_range(data.meta.get("dtype"))
    h = run_histograms(data) if hists is None else hists
    unscaled = shares(h["unscaled"], rng)
    counted = unscaled["values"] + h["zeros"]
    modules = []
    for name, hist in h["per_module"].items():
        s = shares(hist, rng)
        if s["values"]:
            modules.append({"module": name, **s})
    modules.sort(key=lambda m: (-(m["flushed_share"] or 0.0), -(m["subnormal_share"] or 0.0), m["module"]))
    return {**rng, "events": len(data.grad_hist), "modules": len(h["per_module"]), "numel": counted,
            "zeros_share": h["zeros"] / counted if counted else None, "nonfinite": h["nonfinite"],
            "scale_log2": h["scale_log2"], "scale_source": h["scale_source"], "scaled_run": h["scaled_run"],
            "unscaled": unscaled, "scaled": shares(h["measured"], rng),
            **fit_scale(h["unscaled"], rng, low_share=float(cfg["low_share"]),
                        headroom_bits=float(cfg["headroom_bits"])),
            "low_share": float(cfg["low_share"]), "top": modules[:top]}


def _pct(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.0%}" if x == 0 or x >= 0.01 or x == 1 else f"{x:.2%}" if x >= 1e-4 else "<0.01%"


def describe(g: dict) -> str:
    """One plain sentence: what flushes without scaling, what the run's scale left, the initial scale."""
    u, s = g["unscaled"], g["scaled"]
    text = (f"without loss scaling {_pct(u['flushed_share'])} of activation gradients flush to 0 in {g['dtype']} "
            f"and {_pct(u['subnormal_share'])} are subnormal")
    if g["scaled_run"]:
        text += (f"; at the run's loss scale 2^{g['scale_log2']}: {_pct(s['flushed_share'])} flush and "
                 f"{_pct(s['subnormal_share'])} are subnormal")
    if g["zeros_share"]:
        text += f"; {_pct(g['zeros_share'])} are exactly 0"
        if not g["scaled_run"] and g["dtype"] == "float16":
            text += " (in fp16 without a scaler, those include gradients flushed already)"
    k = g["init_scale_log2"]
    if k is not None:
        if g["fits"]:
            text += f"; an initial scale of 2^{k} fits" if k > 0 else "; no loss scale is needed"
        else:
            text += (f"; no scale fits the range (2^{g['needed_log2']} lifts the low tail, 2^{g['max_scale_log2']} "
                     f"is the most the largest gradient allows)")
    if g["scale_source"] == "unknown":
        text += " (loss scale unknown to the trace: pass scaler= to ampaudit.watch)"
    return text


def grad_hist_advice(summary: dict) -> dict | None:
    """A recommendation when gradients flush to zero: none in the run (the scale did its job) is no advice."""
    from ampaudit.policy import settings

    g = summary.get("grad_hist")
    if not g or g["init_scale_log2"] is None:
        return None
    cfg = settings()["grad_hist"]
    # What the run itself saw: as measured with a scaler, as they are without one.
    seen = g["scaled"] if g["scaled_run"] else g["unscaled"]
    lost, sub = seen["flushed_share"], seen["subnormal_share"]
    k, now = g["init_scale_log2"], g["scale_log2"] or 0
    if lost is not None and lost >= float(cfg["flushed_warning"]):
        severity = "warning"
        message = f"{_pct(lost)} of activation gradients flushed to 0 in {g['dtype']}: start the loss scale at 2^{k}"
    elif sub is not None and sub >= float(cfg["subnormal_warning"]) and k > now:
        severity = "info"
        message = (f"{_pct(sub)} of activation gradients were subnormal in {g['dtype']} (fewer mantissa bits) at "
                   f"loss scale 2^{now}: start it at 2^{k}")
    else:
        return None
    code = init_scale_code(summary, f"{2.0 ** k!r}", f"{2.0 ** k!r}")
    if not g["fits"]:
        message += ("; their range is wider than the dtype's, so bfloat16 (float32's exponent range) fits "
                    "them where the hardware supports it")
    return {"kind": "grad_scale", "severity": severity, "init_scale": 2.0 ** k, "message": message, "code": code}
