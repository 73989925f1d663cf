"""Matchers over what ``check --calibrate`` measured (``ctx.calibration``); silent without calibration.

A module's range is judged against the dtype its output is stored in under the target's autocast
(:func:`ampaudit.analysis.calibrate.judge_range`): an fp32 island's output is not held to fp16's 65504.

A module is reported for its *own* code: for divergence and range, a module whose descendants already cross the
threshold is left out (they explain it); for non-finite values the locator already names the op that turned
finite inputs into inf/NaN.
"""
from __future__ import annotations

import math
import re
from typing import Iterator

import torch

from ampaudit.graph_meta import SourceLoc
from ampaudit.policy import divergence_thresholds, settings, unit_roundoff
from ampaudit.rules.registry import Hit, MatchContext, matcher

_SOURCE_RE = re.compile(r"^(?P<file>.+):(?P<line>\d+)$")
# How kernels word a dtype mismatch ("expected both vectors to have same dtype", "expected scalar type BFloat16").
_DTYPE_MISMATCH_RE = re.compile(r"dtype|scalar type|type promot", re.IGNORECASE)


def _source(text: str | None) -> SourceLoc | None:
    m = _SOURCE_RE.match(text or "")
    if not m:
        return None
    import linecache
    import os

    path = os.path.abspath(m["file"])
    return SourceLoc(path, int(m["line"]), linecache.getline(path, int(m["line"])).strip())


def _bad(value) -> bool:
    return isinstance(value, float) and math.isnan(value)


def _own(cal, module: str, flagged) -> bool:
    """True when no module below ``module`` is itself flagged."""
    prefix = f"{module}." if module else ""
    return not any(other != module and other.startswith(prefix) and flagged(other) for other in cal.modules)


@matcher("calibrated_nonfinite", fields={"kind", "error", "source", "phase"})
def calibrated_nonfinite(ctx: MatchContext, rule) -> Iterator[Hit]:
    cal = ctx.calibration
    if cal is None:
        return
    want = rule.param("check", "nonfinite")
    for ev in cal.nonfinite:
        is_error = ev.get("kind") == "error"
        if is_error != (want == "error"):
            continue
        op = (ev.get("op") or "").replace("aten.", "") or "forward"
        phase = " in the backward pass" if ev.get("phase") == "backward" else ""
        message = ev.get("message") or ""
        variant = "dtypes" if is_error and _DTYPE_MISMATCH_RE.search(message) else None
        yield Hit(None, {"kind": ev.get("kind"), "error": message, "source": ev.get("source") or "",
                         "phase": phase},
                  module=ev.get("module") or "", op=op, source=_source(ev.get("source")), variant=variant)


def _range_rows(ctx: MatchContext) -> Iterator[tuple[str, dict]]:
    cal = ctx.calibration
    for name in cal.order:
        yield name, cal.modules[name]


@matcher("calibrated_range", fields={"what", "absmax", "max", "headroom", "share", "flush", "extra"})
def calibrated_range(ctx: MatchContext, rule) -> Iterator[Hit]:
    cal = ctx.calibration
    if cal is None:
        return
    cfg = settings()["calibration"]
    tmax = float(torch.finfo(cal.policy.low).max)
    check = rule.param("check", "overflow")
    dtype = str(cal.policy.low).replace("torch.", "")
    tests = {
        "overflow": lambda r: (r.get("overflow") or 0) > 0,
        "headroom": lambda r: not (r.get("overflow") or 0) and r.get("headroom_bits", 99) < cfg["headroom_warning_bits"],
        "underflow": lambda r: r.get("underflow_share", 0) >= cfg["underflow_warning"],
    }
    test = tests[check]
    hits: list[tuple[int, Hit]] = []
    for i, (name, row) in enumerate(_range_rows(ctx)):
        if test(row) and _own(cal, name, lambda other: test(cal.modules[other])):
            # calibrate judged the row against the dtype the output is stored in under autocast (judge_range)
            judged = row.get("range_dtype", dtype)
            details = {"what": "output", "absmax": row.get("absmax", 0.0),
                       "max": float(torch.finfo(getattr(torch, judged)).max),
                       "headroom": row.get("headroom_bits", 0.0), "share": row.get("underflow_share", 0.0),
                       "flush": row.get("flush_share", 0.0), "extra": ""}
            if judged != dtype:
                details["dtype"] = judged
            hits.append((i, Hit(None, details, module=name, op="output")))
    if check == "overflow":
        order = {name: i for i, name in enumerate(cal.order)}
        for buf in cal.buffers:
            details = {"what": buf["buffer"], "absmax": buf["absmax"], "max": tmax, "headroom": 0.0, "share": 0.0,
                       "flush": 0.0, "extra": "; it becomes inf when the model is cast to " + dtype}
            hits.append((order.get(buf["module"], len(order)), Hit(None, details, module=buf["module"], op="buffer")))
    for _, hit in sorted(hits, key=lambda t: t[0]):
        yield hit


def first_jump(cal, warn: float) -> str | None:
    """The first module, in execution order, whose accumulated (global) error crosses ``warn``."""
    for name in cal.order:
        v = cal.modules[name].get("rel_l2")
        if name and v is not None and (_bad(v) or v >= warn):
            return name
    return None


@matcher("calibrated_divergence", fields={"rel_l2", "cosine", "sqnr_db", "max_abs", "units", "rank", "jump"})
def calibrated_divergence(ctx: MatchContext, rule) -> Iterator[Hit]:
    """Modules whose own error is beyond what the dtype's rounding explains, worst first: the first is the
    culprit of a fault that stays finite. ``jump`` notes where the accumulated error first crosses the line."""
    cal = ctx.calibration
    if cal is None:
        return
    warn, err = divergence_thresholds(cal.policy.low)
    u = unit_roundoff(cal.policy.low)

    def own(name: str):
        row = cal.modules[name]
        return row.get("local_rel_l2", row.get("rel_l2"))

    def over(name: str) -> bool:
        v = own(name)
        return v is not None and (_bad(v) or v >= warn)

    flagged = [n for n in cal.order if over(n) and _own(cal, n, over)]
    flagged.sort(key=lambda n: -(math.inf if _bad(own(n)) else own(n)))
    jump = first_jump(cal, warn)
    for rank, name in enumerate(flagged, 1):
        row, rel = cal.modules[name], own(name)
        sev = "error" if _bad(rel) or rel >= err else None
        note = ""
        if jump is not None and rank == 1:
            note = f"; the model's accumulated error first crosses {warn:.2g} at {jump or '<top>'}"
        yield Hit(None, {"rel_l2": rel, "cosine": row.get("local_cosine", row.get("cosine", float("nan"))),
                         "sqnr_db": row.get("local_sqnr_db", row.get("sqnr_db", float("nan"))),
                         "max_abs": row.get("local_max_abs", row.get("max_abs", float("nan"))),
                         "units": (math.inf if _bad(rel) else rel / u), "rank": rank, "jump": note},
                  severity=sev, module=name, op="output")
