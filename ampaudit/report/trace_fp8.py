"""A trace's float8 layers: the latest cast statistics of each torchao Float8Linear (``fp8`` events) and the layers
that left the plan's flush budget (``fp8_budget`` events), normalised for the summary.

    data = collect(events)                  # ampaudit.report.trace_summary: fills data.fp8, data.fp8_budget
    fp8_summary(data)
    # {"layers": [{"module": "fc1", "step": 51, "input": {"amax": 1.9e6, "scale": 2.4e-4, "flushed_share": 0.97,
    #              "clipped_share": 0.0}, "weight": {...}, "grad_output": {...}}, ...],
    #  "budget": [{"step": 1, "module": "fc1", "role": "input", "flushed_share": 0.97, "max_flushed_share": 0.5,
    #              "fallback": False}]}

Tolerant like the rest of the summary: missing or malformed fields become ``None``; a role absent from the event
(no gradient reached the layer) is absent from its row. The event fields are documented in
:mod:`ampaudit.runtime.fp8_stats`.
"""
from __future__ import annotations

from typing import Any

from ampaudit.report.trace_data import num

ROLES = ("input", "weight", "grad_output")
FIELDS = ("amax", "scale", "flushed_share", "clipped_share")


def fp8_row(ev: dict, step: int | None) -> dict:
    """One ``fp8`` event as a row: step, module, and per role present its four numbers."""
    row: dict[str, Any] = {"step": step, "module": ev.get("module") if isinstance(ev.get("module"), str) else ""}
    for role in ROLES:
        cast = ev.get(role)
        if isinstance(cast, dict):
            row[role] = {f: num(cast.get(f)) for f in FIELDS}
    return row


def budget_row(ev: dict, step: int | None) -> dict:
    """One ``fp8_budget`` event as a row."""
    text = {k: ev.get(k) if isinstance(ev.get(k), str) else None for k in ("module", "role")}
    return {"step": step, **text, "flushed_share": num(ev.get("flushed_share")),
            "max_flushed_share": num(ev.get("max_flushed_share")), "fallback": ev.get("fallback") is True}


def fp8_summary(data: Any) -> dict:
    """``{"layers": latest row per module (in first-seen order), "budget": every budget row}``."""
    latest: dict[str, dict] = {}
    for row in data.fp8:
        if row["module"] not in latest or (row["step"] or 0) >= (latest[row["module"]]["step"] or 0):
            latest[row["module"]] = row
    return {"layers": list(latest.values()), "budget": list(data.fp8_budget)}
