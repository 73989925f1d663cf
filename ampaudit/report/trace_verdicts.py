"""The verdicts ``ampaudit report`` gives on a training run, as rows a check can turn into findings: the tensors
the swamping advice warns about, and the precursor signals that crossed their line, with the published fixes.

    verdicts = training_verdicts(events)     # the events of a trace (ampaudit.train.probe.train_events)
    verdicts["swamping"]      # [{"tensor", "module", "kind", "dtype", "share_rounded", "realized_ratio",
                              #   "first_step", "last_step", "why", "fix", "source", ...}], worst first
    verdicts["precursors"]    # [{"signal", "family", "module", "crossed_step", "crossed_value", "threshold",
                              #   "max", "max_step", "severity", "fixes", "producer" (output signals)}],
                              #   earliest first
    verdicts["diverged_step"], verdicts["steps"]

The same functions as the report (:mod:`ampaudit.report.trace_swamping`, :mod:`ampaudit.report.trace_precursors`):
a row here is a warning there.
"""
from __future__ import annotations

from typing import Any, Iterable

from ampaudit.policy import precursors as precursor_policy


def _family(signal: str) -> str:
    return "output" if signal.startswith("output") else signal


def training_verdicts(events: Iterable[dict]) -> dict[str, Any]:
    """See the module docstring."""
    from ampaudit.report.trace_precursors import precursor_advice, precursor_summary
    from ampaudit.report.trace_summary import collect
    from ampaudit.report.trace_swamping import swamping_advice, swamping_summary

    data = collect(events)
    summary = {"swamping": swamping_summary(data), "precursors": precursor_summary(data)}
    advice = swamping_advice(summary)
    swamped = summary["swamping"]["tensors"] if advice is not None and advice["kind"] == "swamping" else []
    warned = {_family(rec["signal"]): rec["severity"] for rec in precursor_advice(summary)
              if rec["kind"] == "precursor"}
    cfg = precursor_policy()
    crossed = []
    for row in summary["precursors"]["signals"]:
        family = _family(row["signal"])
        if row["crossed_step"] is None or family not in warned:
            continue
        section = "output_logit" if family == "output" else family
        made = row.get("producer")      # the output's: the module that made it, when the trace names one
        fixes = [f.format(module=made) for f in cfg[section]["module_fixes"]] if made else cfg[section]["fixes"]
        crossed.append({**row, "family": family, "severity": warned[family], "fixes": "; ".join(fixes)})
    return {"swamping": swamped, "precursors": crossed, "diverged_step": summary["precursors"]["diverged_step"],
            "steps": len(data.steps)}


__all__ = ["training_verdicts"]
