"""What to change after a run: modules to keep in fp32, a safer initial loss scale, whether the run is broken,
and which ``ampaudit check`` findings the run confirmed.

    from ampaudit.report.trace_advice import load_findings
    summary = summarize_trace("run.jsonl", findings=load_findings("findings.json"))
    for rec in summary["recommendations"]:
        print(rec["severity"], rec["message"], rec.get("code"))

Each recommendation is a dict: ``kind`` (broken | keep_fp32 | nonfinite_unlocated | confirmed_findings |
init_scale | fp32_range | bf16 | clipping | grad_scale | eval_gap | state_overflow | swamping | preflight | decisions |
precursor | loss_spike | fallback), ``severity`` (error | warning | info), ``message``, and, where there is one, ``code`` (a line to paste)
and ``modules`` / ``findings``. Thresholds are the table :data:`THRESHOLDS` (``grad_scale``, from the gradient
histograms: :mod:`ampaudit.report.grad_hist`; ``decisions``: :mod:`ampaudit.report.trace_decisions`; ``precursor``
and ``loss_spike``, with ``signal``, ``step`` and ``value``: :mod:`ampaudit.report.trace_precursors`, thresholds in
rules/policy/precursors.toml; ``fallback``: plan layers that left their recipe, :mod:`ampaudit.report.trace_recipes`).
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from ampaudit.errors import InputError

THRESHOLDS: dict[str, float] = {
    # Forward activations within 2x of the dtype's largest value: the next larger batch overflows.
    "low_headroom_bits": 1.0,
    # Consecutive skipped steps at the start that mean the initial scale was too high.
    "startup_skips": 3,
    # A loss scale at or below 2**this means gradients overflow even unscaled.
    "broken_scale_log2": 0.0,
    # Fraction of skipped steps over the last `tail_steps` steps that means the run no longer trains.
    "broken_tail_skip_rate": 0.5,
    "tail_steps": 20,
    # Fraction of steps clipped above which the clip threshold (or the learning rate) deserves a look.
    "frequent_clipping": 0.5,
}

# Families whose findings a run can confirm; alignment is about speed, which a numeric trace cannot show.
CONFIRMABLE_FAMILIES = frozenset({"sensitive-op", "normalization", "constant", "range", "nonfinite", "divergence"})


def load_findings(path: str | os.PathLike) -> list[dict]:
    """The findings of an ``ampaudit check --format json`` file (a bare, non-empty list of findings is accepted
    too); an InputError for anything else, an entry that is not a finding included."""
    p = Path(path)
    hint = "pass the output of `ampaudit check MODEL --format json > findings.json`"
    try:
        doc = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputError(f"findings file not found: {p}", hint=hint) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"cannot read findings file {p}: {exc}", hint=hint) from exc
    except json.JSONDecodeError as exc:
        raise InputError(f"findings file {p} is not JSON (line {exc.lineno}: {exc.msg})", hint=hint) from exc
    findings = doc.get("findings") if isinstance(doc, dict) else doc
    if not isinstance(findings, list):
        raise InputError(f"findings file {p} has no \"findings\" list", hint=hint)
    if not findings and not isinstance(doc, dict):
        # check's own output of a clean model is {"findings": []}; a bare [] says nothing of where it came from.
        raise InputError(f"findings file {p} is an empty list, not the output of ampaudit check", hint=hint)
    for i, f in enumerate(findings):
        if not isinstance(f, dict) or not isinstance(f.get("rule"), str):
            raise InputError(f"findings file {p}: entry {i} is not a finding (an object with a \"rule\")",
                             hint=hint)
    return findings


def _evidence(summary: dict, data: Any, culprits: list, all_headroom: list[dict]) -> dict[str, list]:
    """Module -> what the run saw there, strongest first. Modules named by ``skip`` events are not evidence on
    their own: a dynamic scaler overflows on purpose each time it probes a higher scale."""
    t = THRESHOLDS
    ev: dict[str, list[str]] = {}
    for e in data.nonfinite:
        # An overflow only the scaled gradient has is the scaler probing (its skip), not the module's fault.
        if e["module"] is None or e.get("scaled_only"):
            continue
        where = f"{e['kind'] or 'non-finite'} in {e['phase'] or '?'} at step {e['step']}"
        where += f", {e['op']}" if e["op"] else ""
        if where not in ev.get(e["module"], []):
            ev.setdefault(e["module"], []).append(where)
    for row in all_headroom:
        if row.get("dtype") == "float32":
            continue        # already computes in FP32: keep_fp32 cannot help it (see _fp32_range)
        bits = row["forward_bits"]
        if row["inf"] or row["nan"]:
            ev.setdefault(row["module"], []).append(f"{row['inf']} inf / {row['nan']} NaN values in stats")
        elif row["nonfinite_passes"]:
            ev.setdefault(row["module"], []).append(f"non-finite output in {row['nonfinite_passes']} passes")
        if row["overflow"]:
            ev.setdefault(row["module"], []).append(f"{row['overflow']} values above the dtype's max")
        # Backward headroom is left out on purpose: a dynamic loss scaler pushes gradients towards the max.
        if bits is not None and bits < t["low_headroom_bits"]:
            ev.setdefault(row["module"], []).append(
                f"forward headroom {_bits(bits)} at step {row['forward_step']}")
    scope = summary["divergence"]["scope"]
    for c in culprits:             # the verdict of ampaudit.runtime.attribution, as check --calibrate gives it
        at = next((r["max_step"] for r in summary["divergence"]["top"] if r["module"] == c.module), None)
        where = f" at step {at}" if at is not None else ""
        ev.setdefault(c.module, []).append(f"{'own' if scope == 'local' else scope} rel_l2 {c.rel_l2:.3g} vs FP32"
                                           f"{where}: {c.why}")
    return ev


def _bits(bits: float) -> str:
    return "overflowed" if bits == -math.inf else f"{bits:.2f} bits"


def _keep_fp32(evidence: dict[str, list[str]]) -> dict | None:
    modules = [m for m in evidence if m]
    if not modules:
        return None
    listed = ", ".join(f"{m} ({evidence[m][0]})" for m in modules[:6])
    more = f" and {len(modules) - 6} more" if len(modules) > 6 else ""
    note = " The top module's own code is affected too: look at its forward." if "" in evidence else ""
    return {"kind": "keep_fp32", "severity": "warning", "modules": modules,
            "message": f"keep in fp32: {listed}{more}.{note}",
            "code": f"ampaudit.keep_fp32(model, {json.dumps(modules)})"}


def _fp32_range(all_headroom: list[dict]) -> dict | None:
    """Modules whose FP32 output would not fit the run's low precision if cast to it: true and worth knowing
    (a later cast, a low-precision consumer), but not a keep_fp32 case, since they compute in FP32 already."""
    rows = [r for r in all_headroom if r.get("dtype") == "float32" and (
        r["overflow"] or (r["forward_bits"] is not None and r["forward_bits"] < 0))]
    if not rows:
        return None
    listed = ", ".join(f"{r['module'] or '<top>'} ({_peak(r)}{r['overflow']} values above the max)"
                       for r in rows[:6])
    return {"kind": "fp32_range", "severity": "info",
            "message": f"already in float32, but their outputs would not fit the run's low precision if cast to "
                       f"it: {listed}. Keep any later cast of them (or their consumers) in float32."}


def _peak(row: dict) -> str:
    return f"up to {row['max_absmax']:.3g}, " if row["max_absmax"] is not None else ""


def init_scale_code(summary: dict, flag: str, scaler: str) -> str:
    """The line that sets the initial loss scale, given as ``flag`` to ``--init-scale`` and as ``scaler`` to
    GradScaler (both formatted already): a run of `ampaudit train` takes the flag; a run watched in the user's own
    loop uses torch's scaler."""
    meta = summary.get("meta", {})
    device = str(meta.get("device") or "cuda").split(":")[0]
    return (f"ampaudit train ... --init-scale {flag}" if meta.get("source") == "train"
            else f"torch.amp.GradScaler({device!r}, init_scale={scaler})")


def _init_scale(summary: dict, data: Any) -> dict | None:
    rows = data.steps
    run = 0
    for r in rows:
        if not r.skipped:
            break
        run += 1
    if run < THRESHOLDS["startup_skips"] or run == len(rows) or not summary["scale"].get("used"):
        return None
    reached = rows[run].scale  # a step row records the scale that step ran with: the first one that worked
    if reached is None:
        return None
    k = math.floor(math.log2(reached))
    code = init_scale_code(summary, f"{2 ** k:g}", f"{2.0 ** k:.1f}")
    start = summary["scale"]["initial_log2"]
    began = f" from 2^{start:g}" if start is not None else ""
    return {"kind": "init_scale", "severity": "info", "init_scale": 2.0 ** k,
            "message": f"the first {run} steps were skipped while the scale fell{began}: "
                       f"start at init_scale=2**{k} ({2 ** k:g})",
            "code": code}


def _broken(summary: dict, data: Any, evidence: dict[str, list[str]]) -> dict | None:
    t = THRESHOLDS
    reasons = []
    scale = summary["scale"]
    if scale.get("used") and scale["min_log2"] is not None and scale["min_log2"] <= t["broken_scale_log2"]:
        reasons.append(f"the loss scale fell to 2^{scale['min_log2']:.3g} at step {scale['min_step']}")
    tail = data.steps[-int(t["tail_steps"]):]
    if len(tail) >= t["tail_steps"] // 2:
        rate = sum(r.skipped for r in tail) / len(tail)
        if rate >= t["broken_tail_skip_rate"]:
            reasons.append(f"{rate:.0%} of the last {len(tail)} steps were skipped")
    if data.steps and data.steps[-1].loss is not None and not math.isfinite(data.steps[-1].loss):
        reasons.append("the last loss is not finite")
    if summary["halt"]:
        reasons.append(f"training halted at step {summary['halt']['step']}: {summary['halt']['reason'] or '?'}")
    if not reasons:
        return None
    # A scale this low means values overflow before the scale is applied: no scaler setting helps.
    nxt = ("keep the modules below in fp32" if any(evidence) else
           "find the first non-finite op with ampaudit.watch (stats and divergence per module)")
    return {"kind": "broken", "severity": "error",
            "message": "the run is likely broken: " + "; ".join(reasons) + f". Next: {nxt}."}


def _bf16(summary: dict, data: Any, evidence: dict[str, list[str]]) -> dict | None:
    dtype = str(summary["meta"].get("dtype") or "")
    forward = [e for e in data.nonfinite if e["phase"] == "forward"]
    low = any("forward headroom" in x for xs in evidence.values() for x in xs)
    if "16" not in dtype or "bf" in dtype or not (forward or low):
        return None
    return {"kind": "bf16", "severity": "info",
            "message": "activations reach float16's range limit in forward; bfloat16 has float32's exponent "
                       "range and needs no loss scaler, where the hardware supports it"}


def _clipping(summary: dict) -> dict | None:
    steps = summary["steps"]
    if not steps["count"] or steps["clipped"] / steps["count"] < THRESHOLDS["frequent_clipping"]:
        return None
    return {"kind": "clipping", "severity": "info",
            "message": f"gradients were clipped on {steps['clipped']} of {steps['count']} steps: the clip "
                       "threshold is below the usual gradient norm, or the learning rate is high"}


def _unlocated(data: Any) -> dict | None:
    # A producer that could not name the module (an op outside any module's forward) still saw the value.
    events = [e for e in data.nonfinite if e["module"] is None]
    if not events or any(e["module"] is not None for e in data.nonfinite):
        return None
    first = events[0]
    return {"kind": "nonfinite_unlocated", "severity": "warning",
            "message": f"{first['kind'] or 'non-finite'} values appeared at step {first['step']}, outside any "
                       "module the trace could name: run a step under ampaudit.watch to find the op"}


def _confirmed(findings: list[dict], evidence: dict[str, list[str]]) -> dict | None:
    confirmed = []
    for f in findings:
        module = f.get("module")
        if not isinstance(module, str) or f.get("family") not in CONFIRMABLE_FAMILIES:
            continue
        # Exact match only: check and the runtime both name the module whose own code runs the op, and trouble
        # in a submodule says nothing about code in its parent.
        if module in evidence:
            confirmed.append({"rule": f.get("rule"), "family": f.get("family"), "module": module,
                              "message": f.get("message"), "evidence": evidence[module][0]})
    if not confirmed:
        return None
    names = ", ".join(f"{c['rule']} at {c['module'] or '<top>'}" for c in confirmed[:5])
    return {"kind": "confirmed_findings", "severity": "warning", "findings": confirmed,
            "message": f"the run confirmed {len(confirmed)} of {len(findings)} check findings: {names}"}


def run_advice(summary: dict, data: Any, *, culprits: list, all_headroom: list[dict], findings: list[dict] | None,
               extra_evidence: dict[str, list[str]]) -> list[dict | None]:
    """The run-wide recommendations (broken, keep_fp32, fp32_range, nonfinite_unlocated, confirmed_findings, init_scale, bf16,
    clipping), None where one does not apply. ``extra_evidence``: module -> what else the run saw there (flipped
    decisions), which confirms findings too but is not keep_fp32's evidence. The readers of one kind add theirs:
    :func:`ampaudit.report.trace_summary.recommend`."""
    evidence = _evidence(summary, data, culprits, all_headroom)
    confirming = {**evidence}
    for module, seen in extra_evidence.items():
        confirming[module] = [*confirming.get(module, []), *seen]
    return [_broken(summary, data, evidence), _keep_fp32(evidence), _fp32_range(all_headroom), _unlocated(data),
            _confirmed(findings or [], confirming),
            _init_scale(summary, data), _bf16(summary, data, evidence), _clipping(summary)]
