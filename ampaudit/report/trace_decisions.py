"""A trace's ``decision`` events (trace version 3: decision ops against FP32 on the watch's divergence checks): one
row per decision site, the sites whose choices precision flips, the advice, and their lines in the terminal.

    data = collect(events)               # ampaudit.report.trace_summary: fills data.decisions with decision_row()
    decision_summary(data)
    # {"sites": 2, "flagged": [{"module": "moe.router", "op": "topk", "source": "model.py:21", "kind": "topk",
    #   "what": "rows pick another top-k set", "share_flipped": 0.055, "flipped": 28, "decisions": 512,
    #   "step": 0, "checks": 3, "used": True}], "quiet": [...]}
    decision_advice(summary)             # a recommendation dict (kind "decisions") or None

A site is flagged when, at its worst check, the forward used the result and the share flipped reaches
``[decisions] min_share`` with at least ``min_flipped`` flips (rules/policy/settings.toml: the limits of
``check --calibrate``'s AMP702, :func:`ampaudit.runtime.decisions.flagged`). Tolerant like the rest of the
summary: malformed fields become ``None`` or 0 and such an event is never flagged.
"""
from __future__ import annotations

import json
from typing import Any

from ampaudit.report.trace_data import finite

SHOW = 5


def decision_row(ev: dict, step: int | None) -> dict:
    """One ``decision`` event as a row (module, op, source, kind, decisions, flipped, share_flipped, used, step)."""
    def text(key: str) -> str | None:
        return ev.get(key) if isinstance(ev.get(key), str) else None
    share = finite(ev.get("share_flipped"))
    return {"step": step, "module": text("module") or "", "op": text("op") or "?", "source": text("source"),
            "kind": text("kind"), "decisions": int(finite(ev.get("decisions")) or 0),
            "flipped": int(finite(ev.get("flipped")) or 0), "share_flipped": share if share is not None else 0.0,
            "used": ev.get("used") is True}


def decision_summary(data: Any) -> dict:
    """``{"sites", "flagged", "quiet"}`` of a :class:`~ampaudit.report.trace_summary.TraceData`: per site (module,
    op, source) its worst check; flagged ones worst first."""
    from ampaudit.runtime.decisions import decision_limits, flagged, what

    limits = decision_limits()
    sites: dict[tuple, dict] = {}
    for row in data.decisions:
        key = (row["module"], row["op"], row["source"])
        seen = sites.get(key)
        if seen is None:
            sites[key] = {**row, "checks": 1, "what": what(row["kind"] or "")}
            continue
        seen["checks"] += 1
        if row["share_flipped"] > seen["share_flipped"]:
            seen.update({k: row[k] for k in ("step", "decisions", "flipped", "share_flipped")})
        seen["used"] = seen["used"] or row["used"]
    rows = sorted(sites.values(), key=lambda r: -r["share_flipped"])
    return {"sites": len(rows), "flagged": [r for r in rows if flagged(r, limits)],
            "quiet": [r for r in rows if not flagged(r, limits)]}


def _where(r: dict) -> str:
    return f"{r['module'] or '<top>'} ({r['op']}" + (f" at {r['source']})" if r.get("source") else ")")


def decision_advice(summary: dict) -> dict | None:
    """The recommendation when precision flips the decisions of some site the forward uses, else None."""
    dec = summary.get("decisions") or {}
    rows = dec.get("flagged") or []
    if not rows:
        return None
    dtype = (summary.get("meta") or {}).get("dtype") or "low-precision"
    shown = "; ".join(f"{r['share_flipped']:.1%} of the {r['decisions']} decisions of {_where(r)} differ from FP32 "
                      f"({r['flipped']} {r['what']}, step {r['step']})" for r in rows[:SHOW])
    modules = list(dict.fromkeys(r["module"] for r in rows))
    return {"kind": "decisions", "severity": "warning", "modules": modules,
            "message": f"decisions flipped by {dtype} autocast: {shown}. The values they are made on are a rounding "
                       "error off, the choices a whole expert, level or side of the threshold off: compute the "
                       "scores in fp32 (a torch.autocast(device_type, enabled=False) block on .float() inputs), "
                       "or keep these modules in fp32",
            "code": f"ampaudit.keep_fp32(model, {json.dumps(modules)})"}


def decision_evidence(summary: dict) -> dict[str, list[str]]:
    """Module -> what the run saw of its flipped decisions, for confirming ``check`` findings (AMP702)."""
    ev: dict[str, list[str]] = {}
    for r in (summary.get("decisions") or {}).get("flagged") or []:
        ev.setdefault(r["module"], []).append(f"{r['share_flipped']:.1%} of its {r['op']} decisions differ from "
                                              f"FP32 at step {r['step']}")
    return ev


def render_decisions(dec: dict, console: Any) -> None:
    """The decisions section of ``ampaudit report`` in the terminal: flagged sites, then how many are quiet."""
    from rich.markup import escape

    sites = f"{dec['sites']} decision site" + ("s" if dec["sites"] != 1 else "")
    console.print(f"\n[bold]Decisions vs FP32[/] ({sites}; the share flipped at the worst check)")
    for r in dec["flagged"][:SHOW]:
        console.print(f"  [yellow]![/] {r['share_flipped']:.1%} of {r['decisions']}: {escape(_where(r))}, "
                      f"{escape(r['what'])} (step {r['step']})")
    used = [r for r in dec["quiet"] if r["used"]]
    returned = [r for r in dec["quiet"] if not r["used"]]
    if used:
        console.print(f"  {len(used)} used site(s) below the line (at most {used[0]['share_flipped']:.1%} flipped)")
    if returned:
        console.print(f"  {len(returned)} site(s) only returned, not used by the forward (at most "
                      f"{returned[0]['share_flipped']:.1%} flipped): {escape(_where(returned[0]))}")


__all__ = ["decision_advice", "decision_evidence", "decision_row", "decision_summary", "render_decisions"]
