"""A trace's low-precision recipes (``recipe_stats`` and ``fallback`` events of ``ampaudit train --plan``,
:mod:`ampaudit.runtime.recipe_stats` and :mod:`ampaudit.runtime.fallback`): the latest statistics per layer, and
when and why a layer fell back to a safer recipe.

    data = collect(events)                  # ampaudit.report.trace_summary: fills data.recipes, data.fallbacks
    recipes_summary(data)
    # {"layers": [{"module": "fc1", "step": 50, "recipe": "float8_rowwise", "sqnr_db": 27.6,
    #              "input": {"amax": 8.9e5, "flushed_share": 0.69, "amax_growth": 0.47}, "grad_output": {...}}],
    #  "fallbacks": [{"step": 2, "module": "fc1", "from": "float8_tensorwise", "to": "float8_rowwise",
    #                 "reason": "input_flushed", "value": 0.97, "limit": 0.5, "why": "97% of its input ..."}]}
    render_recipes(summary["recipes"], console)
    fallback_advice(summary)                # a recommendation dict (kind "fallback") or None

Tolerant like the rest of the summary: malformed fields become ``None``.
"""
from __future__ import annotations

from typing import Any

from ampaudit.report.trace_data import num

ROLES = ("input", "grad_output")
FIELDS = ("amax", "flushed_share", "amax_growth")


def _text(ev: dict, key: str) -> str | None:
    return ev.get(key) if isinstance(ev.get(key), str) else None


def recipe_row(ev: dict, step: int | None) -> dict:
    """One ``recipe_stats`` event as a row."""
    row: dict[str, Any] = {"step": step, "module": _text(ev, "module") or "", "recipe": _text(ev, "recipe"),
                           "sqnr_db": num(ev.get("sqnr_db"))}
    for role in ROLES:
        if isinstance(ev.get(role), dict):
            row[role] = {f: num(ev[role].get(f)) for f in FIELDS}
    return row


def fallback_row(ev: dict, step: int | None) -> dict:
    """One ``fallback`` event as a row."""
    return {"step": step, **{k: _text(ev, k) for k in ("module", "from", "to", "reason", "why")},
            "value": num(ev.get("value")), "limit": num(ev.get("limit"))}


def recipes_summary(data: Any) -> dict:
    """``{"layers": latest row per module (first-seen order), "fallbacks": every fallback row}``."""
    latest: dict[str, dict] = {}
    for row in data.recipes:
        if row["module"] not in latest or (row["step"] or 0) >= (latest[row["module"]]["step"] or 0):
            latest[row["module"]] = row
    return {"layers": list(latest.values()), "fallbacks": list(data.fallbacks)}


def fallback_advice(summary: dict) -> dict | None:
    """The note that plan layers left their recipe during training (when, why, where they ended), else None."""
    falls = (summary.get("recipes") or {}).get("fallbacks") or []
    if not falls:
        return None
    first: dict[str, dict] = {}
    last: dict[str, dict] = {}
    for f in falls:
        first.setdefault(f["module"], f)
        last[f["module"]] = f
    parts = [f"{m or '<top>'} {first[m]['from']} -> {last[m]['to']} (from step {first[m]['step']}: "
             f"{first[m]['why'] or first[m]['reason']})" for m in first]
    return {"kind": "fallback", "severity": "info", "modules": list(first),
            "message": f"{len(first)} plan layer(s) left their recipe during training: " + "; ".join(parts)
                       + ". Fix: none needed for this run; later runs can start from the plan file --fallback "
                         "rewrote, which holds the switched recipes"}


def render_recipes(summary: dict, console: Any) -> None:
    """The recipes section of ``ampaudit report`` in the terminal: one line per layer, one per fallback."""
    from rich.markup import escape

    from ampaudit.report.trace_data import fmt

    console.print(f"\n[bold]Low-precision recipes[/] (latest statistics, {len(summary['layers'])} layers)")
    now = {f["module"]: f["to"] for f in summary["fallbacks"]}       # the rows are in step order
    for r in summary["layers"]:
        inp, go = r.get("input") or {}, r.get("grad_output") or {}
        later = f" (now {escape(str(now[r['module']]))})" if now.get(r["module"], r["recipe"]) != r["recipe"] else ""
        console.print(f"  {escape(r['module'] or '<top>')}: {escape(str(r['recipe']))}{later} at step {r['step']}, output "
                      f"SQNR {fmt(r['sqnr_db'], '.1f')} dB, input flushed {fmt(inp.get('flushed_share'), '.1%')} "
                      f"(amax x{fmt(inp.get('amax_growth'), '.3g')}), grad_output flushed "
                      f"{fmt(go.get('flushed_share'), '.1%')} (amax x{fmt(go.get('amax_growth'), '.3g')})")
    if summary["fallbacks"]:
        console.print("[bold]Fallbacks[/] (each from the next step on)")
    for f in summary["fallbacks"]:
        console.print(f"  [yellow]![/] step {f['step']}: [bold]{escape(f['module'] or '<top>')}[/] "
                      f"{escape(str(f['from']))} -> {escape(str(f['to']))}: {escape(f['why'] or str(f['reason']))}")
