"""Matchers over what ``check --calibrate`` learned by running the model as training will (``ctx.calibration``:
``swamping``, ``precursors``, ``trained``; filled by :mod:`ampaudit.train.probe` and
:mod:`ampaudit.report.trace_verdicts`); silent without calibration.

``calibrated_swamping``: per module, the tensor stored in fp16/bf16 without an FP32 master (at the opt level of
``check --opt-level``) whose in-place updates lost the most: a warning when the runtime's swamping meter found
them rounding away (in the calibration forward, or over the ``--train-steps`` steps: variant ``trained``), an
info when the forward writes it but its update on the calibration batch was kept or not measurable (``at_risk``).
``trained_precursor``: per module, the precursor signal (``check``: attn_logit, output, massive_activation) that
crossed its line during the training steps, with the step it crossed and the published fixes; variant ``no_fp8``
(an info) when the report calls it one (massive activations in a run without fp8 layers).
"""
from __future__ import annotations

from typing import Iterator

from ampaudit.dtypes import dtype_of, unit_roundoff
from ampaudit.rules.matchers.calibrated import _source
from ampaudit.rules.registry import Hit, MatchContext, matcher

_WORDS = {"param": "parameter", "buffer": "buffer", "optimizer_state": "optimizer state"}
# The fix of a tensor the forward writes whose update this calibration could not size (the preflight's words).
_KEEP = ("keep {tensor} in float32 (.float() after the model is cast), or give it an FP32 master; Kahan summation "
         "or stochastic rounding also keep the small updates")


def _rank(row: dict) -> tuple:
    """Worst first: measured over training, then flagged, then the least movement kept."""
    kept = row.get("realized_ratio")
    return (row["origin"] != "training", not row.get("flagged", True), kept if kept is not None else 2.0)


def _per_module(rows: list[dict]) -> Iterator[tuple[dict, int]]:
    """Per module, the worst row of its tensors that lose their updates (and how many do), and the worst of those
    only at risk; a tensor measured over training steps is judged by those, not by the forward."""
    trained = {r["tensor"] for r in rows if r["origin"] == "training"}
    kept = [r for r in rows if r["origin"] == "training" or r["tensor"] not in trained]
    groups: dict[tuple[str, bool], list[dict]] = {}
    for r in sorted(kept, key=_rank):
        lost = r["origin"] == "training" or r.get("flagged", False)
        groups.setdefault((r.get("module") or "", lost), []).append(r)
    for group in groups.values():
        yield group[0], len(group)


@matcher("calibrated_swamping", variants={"trained", "at_risk"},
         fields={"tensor", "kind", "storage", "opt_level", "share", "kept", "half", "where", "more", "cause",
                 "remedy", "measured", "first", "last", "steps"},
         nullable=set())
def calibrated_swamping(ctx: MatchContext, rule) -> Iterator[Hit]:
    cal = ctx.calibration
    if cal is None:
        return
    steps = (cal.trained or {}).get("steps")
    for row, count in _per_module(list(cal.swamping)):
        storage = row.get("dtype") or "?"
        dtype = dtype_of(storage)
        half = row.get("half_ulp_rel") or (unit_roundoff(dtype) if dtype is not None else float("nan"))
        trained = row["origin"] == "training"
        flagged = trained or row.get("flagged", False)
        more = f"; so do {count - 1} more tensor(s) of {row.get('module') or 'the model'}" if count > 1 else ""
        if not row.get("moved", True):
            measured = "FP32 would not move it either on the calibration batch, so its loss is not measured yet"
        elif not flagged:
            measured = (f"on the calibration batch {row['share_rounded']:.0%} of its update rounded away, "
                        f"{row['realized_ratio']:.0%} of the FP32 movement kept")
        else:
            measured = ""
        details = {"tensor": row["tensor"], "kind": _WORDS.get(row.get("kind") or "", row.get("kind") or "tensor"),
                   "storage": storage, "opt_level": cal.opt_level, "half": half, "more": more,
                   "where": "the calibration forward" if not trained else f"the {steps} training steps",
                   "cause": row.get("why") or "", "remedy": row.get("fix") or _KEEP.format(tensor=row["tensor"]),
                   "measured": measured}
        # Only what was measured: a tensor FP32 would not move has no share; the forward has no steps (the
        # variant each hit takes uses only the fields it has).
        numbers = {"share": row.get("share_rounded"), "kept": row.get("realized_ratio"), "first": row.get("first_step"),
                   "last": row.get("last_step"), "steps": steps if trained else None}
        details.update({k: v for k, v in numbers.items() if v is not None})
        variant = "trained" if trained else (None if flagged else "at_risk")
        yield Hit(None, details, module=row.get("module") or "", source=_source(row.get("source")),
                  variant=variant)


def _broke(row: dict, diverged: int | None) -> str:
    if diverged is None:
        return ""
    if row["crossed_step"] < diverged:
        return f", {diverged - row['crossed_step']} steps before the loss broke at step {diverged}"
    return f"; the loss broke at step {diverged}"


@matcher("trained_precursor", params={"check": ("attn_logit", "output", "massive_activation")}, variants={"no_fp8"},
         fields={"signal", "value", "threshold", "step", "peak", "peak_step", "steps", "broke", "fixes"},
         nullable={"value", "peak_step"})
def trained_precursor(ctx: MatchContext, rule) -> Iterator[Hit]:
    cal = ctx.calibration
    if cal is None or cal.trained is None:
        return
    want = rule.param("check", "attn_logit")
    diverged = cal.trained.get("diverged_step")
    seen: set[str] = set()
    for row in cal.precursors:          # earliest first: one finding per module, at the signal it crossed first
        # The output's signals are on the module that made the output, where the run named one (else the top module).
        module = row.get("producer") or row["module"]
        if row["family"] != want or module in seen:
            continue
        seen.add(module)
        yield Hit(None, {"signal": row["signal"], "value": row.get("crossed_value"), "threshold": row["threshold"],
                         "step": row["crossed_step"],
                         "peak": row["max"] if row.get("max") is not None else row["crossed_value"],
                         "peak_step": row.get("max_step"),
                         "steps": cal.trained["steps"], "broke": _broke(row, diverged), "fixes": row["fixes"]},
                  module=module, variant="no_fp8" if row.get("severity") == "info" else None)
