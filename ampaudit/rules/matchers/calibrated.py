"""Matchers over what ``check --calibrate`` measured (``ctx.calibration``); silent without calibration.

A module's range is judged against the dtype its output is stored in under the target's autocast
(:func:`ampaudit.analysis.calibrate.judge_range`): an fp32 island's output is not held to fp16's 65504.

A module is reported for its *own* code: for divergence, by its own error (:mod:`ampaudit.runtime.attribution`,
the verdict ``ampaudit report`` gives too); for range, a module whose descendants already cross the threshold is
left out (they explain it); for non-finite values the locator already names the op that turned finite inputs into
inf/NaN.
"""
from __future__ import annotations

import re
from typing import Iterator

from ampaudit.graph_meta import SourceLoc
from ampaudit.dtypes import max_of
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


def _own(cal, module: str, flagged) -> bool:
    """True when no module below ``module`` is itself flagged."""
    prefix = f"{module}." if module else ""
    return not any(other != module and other.startswith(prefix) and flagged(other) for other in cal.modules)


@matcher("calibrated_nonfinite", fields={"kind", "error", "source", "phase"}, params={"check": ("nonfinite", "error")},
         variants={"dtypes"})
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
        message = ev.get("message") or ""
        variant = "dtypes" if is_error and _DTYPE_MISMATCH_RE.search(message) else None
        details = {"kind": ev.get("kind"), "source": ev.get("source") or "",
                   "phase": "backward" if ev.get("phase") == "backward" else "forward"}
        if is_error:
            details["error"] = message
        yield Hit(None, details, module=ev.get("module") or "", op=op, source=_source(ev.get("source")),
                  variant=variant)


def _range_rows(ctx: MatchContext) -> Iterator[tuple[str, dict]]:
    cal = ctx.calibration
    for name in cal.order:
        yield name, cal.modules[name]


@matcher("calibrated_range", fields={"what", "absmax", "max", "headroom", "share", "flush", "extra"},
         params={"check": ("overflow", "headroom", "underflow"), "headroom_warning_bits": float,
                 "underflow_warning": float}, required={"headroom_warning_bits", "underflow_warning"})
def calibrated_range(ctx: MatchContext, rule) -> Iterator[Hit]:
    cal = ctx.calibration
    if cal is None:
        return
    tmax = cal.policy.limits.max
    check = rule.param("check", "overflow")
    dtype = str(cal.policy.low).replace("torch.", "")
    test = _range_test(rule, check)
    hits: list[tuple[int, Hit]] = []
    for i, (name, row) in enumerate(_range_rows(ctx)):
        if test(row) and _own(cal, name, lambda other: test(cal.modules[other])):
            # calibrate judged the row against the dtype the output is stored in under autocast (judge_range)
            judged = row.get("range_dtype", dtype)
            details = {"what": "output", "absmax": row.get("absmax", 0.0),
                       "max": max_of(judged),
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


def _range_test(rule, check: str):
    """Which calibration rows ``check`` flags: any overflow; under ``headroom_warning_bits`` of headroom; at least
    ``underflow_warning`` of the nonzero outputs below the smallest normal (the rule's parameters)."""
    if check == "overflow":
        return lambda r: (r.get("overflow") or 0) > 0
    if check == "headroom":
        bits = float(rule.params["headroom_warning_bits"])
        return lambda r: not (r.get("overflow") or 0) and r.get("headroom_bits", 99) < bits
    share = float(rule.params["underflow_warning"])
    return lambda r: r.get("underflow_share", 0) >= share


def first_jump(cal, found) -> str | None:
    """The first culprit in execution order (innermost first): where the model's error first shows."""
    from ampaudit.runtime.attribution import first_crossing, own_errors

    own, _ = own_errors(cal.order, cal.modules)
    row = first_crossing(found, ((n, None, own[n]) for n in cal.order))
    return None if row is None else row["module"]


@matcher("calibrated_divergence", fields={"rel_l2", "cosine", "sqnr_db", "max_abs", "units", "rank", "jump", "verdict"},
         variants={"relative"})
def calibrated_divergence(ctx: MatchContext, rule) -> Iterator[Hit]:
    """Modules whose own error is beyond what the dtype's rounding explains, or an outlier among the model's own
    errors (:mod:`ampaudit.runtime.attribution`, the same verdict ``ampaudit report`` gives), worst first: the
    first is the culprit of a fault that stays finite. ``jump`` notes the first culprit in execution order."""
    from ampaudit.runtime.attribution import calibration_culprits

    cal = ctx.calibration
    if cal is None:
        return
    found = calibration_culprits(cal.order, cal.modules, cal.policy.low)
    jump = first_jump(cal, found)
    for c in found:
        row = cal.modules[c.module]
        sev = "error" if c.severity == "error" else None       # None: the rule's own (warning)
        note = ""
        if jump is not None and c.rank == 1 and jump != c.module:
            note = f"; the first culprit in execution order is {jump or '<top>'}"
        yield Hit(None, {"rel_l2": c.rel_l2, "cosine": row.get("local_cosine", row.get("cosine", float("nan"))),
                         "sqnr_db": row.get("local_sqnr_db", row.get("sqnr_db", float("nan"))),
                         "max_abs": row.get("local_max_abs", row.get("max_abs", float("nan"))),
                         "units": c.units, "rank": c.rank, "jump": note, "verdict": c.why},
                  severity=sev, module=c.module, op="output", variant="relative" if c.rule == "relative" else None)
