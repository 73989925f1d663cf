"""A trace's swamping (``swamping`` events, :mod:`ampaudit.runtime.swamping`) and the precision preflight's warnings
about state that will change without an FP32 master (``preflight`` events): per tensor, the advice, the terminal
section.

    data = collect(events)              # ampaudit.report.trace_summary: fills data.swamping, .overflows, .preflight
    swamping_summary(data)
    # {"tensors": [{"tensor": "teacher.0.weight", "module": "teacher.0", "kind": "param", "dtype": "bfloat16",
    #               "steps": 4, "first_step": 1, "last_step": 40, "share_rounded": 0.96, "realized_ratio": 0.52,
    #               "update_rel": 1.9e-4, "half_ulp_rel": 0.0039, "why": "...", "fix": "..."}, ...],
    #  "preflight": [{"name": "updates", "status": "warn", "message": "...", "hint": "..."}],
    #  "overflows": [{"tensor": "bn.running_var", "module": "bn", "dtype": "float16", "first_step": 0, ...}]}
    swamping_advice(summary)            # a recommendation (kind "swamping", or "preflight") or None
    overflow_advice(summary)            # kind "state_overflow": state beyond its dtype's range (state_overflow)

A tensor's row holds its last measured step's numbers (the state it ended in) and the highest share rounded seen.
Tolerant like the rest of the summary: a malformed event is skipped, missing numbers become ``None``.
"""
from __future__ import annotations

from typing import Any

from ampaudit.report.trace_data import finite, fmt

# Preflight checks about training state that changes (ampaudit.train.preflight_state.STATE_CHECKS, written here
# so report does not import the trainer); the others are the distributed run's, reported by the trainer itself.
STATE_CHECKS = ("updates", "optimizer state")
SHOWN = 5


def _state_row(ev: dict, step: int | None, numbers: tuple[str, ...]) -> dict | None:
    # A state event's row: its text fields (None where not a string) and ``numbers`` (None where not finite).
    tensor = ev.get("tensor")
    if not isinstance(tensor, str):
        return None
    text = {k: ev.get(k) if isinstance(ev.get(k), str) else None
            for k in ("module", "kind", "dtype", "why", "fix", "source")}
    return {"step": step, "tensor": tensor, **text, **{k: finite(ev.get(k)) for k in numbers}}


def swamping_row(ev: dict, step: int | None) -> dict | None:
    """One ``swamping`` event as a row; None without a tensor name."""
    return _state_row(ev, step, ("share_rounded", "realized_ratio", "update_rel", "half_ulp_rel", "elements", "numel"))


def overflow_row(ev: dict, step: int | None) -> dict | None:
    """One ``state_overflow`` event as a row; None without a tensor name."""
    return _state_row(ev, step, ("elements", "numel", "fp32_absmax", "limit"))


def _overflows(data: Any) -> list[dict]:
    """One row per tensor that overflowed: its first step, the most elements and the largest FP32 value seen."""
    by_tensor: dict[str, dict] = {}
    for row in getattr(data, "overflows", []):
        seen = by_tensor.setdefault(row["tensor"], {**row, "first_step": row["step"], "steps": 0})
        seen["steps"] += 1
        for key in ("elements", "fp32_absmax"):
            if row[key] is not None:
                seen[key] = max(seen[key] or 0, row[key])
    for r in by_tensor.values():
        r.pop("step", None)
    return list(by_tensor.values())


def overflow_advice(summary: dict) -> dict | None:
    """The warning naming each tensor whose stored value overflowed while FP32 held it finite, else None."""
    rows = (summary.get("swamping") or {}).get("overflows") or []
    if not rows:
        return None
    first = rows[0]
    where = "; ".join(f"{r['tensor']} ({r['kind'] or '?'} of {r['module'] or '<top>'}, {r['dtype'] or '?'}): "
                      f"its FP32 updates reach {fmt(r['fp32_absmax'], '.3g', none='?')}, beyond "
                      f"{fmt(r['limit'], '.6g', none='?')}, from step {r['first_step']}" for r in rows[:SHOWN])
    return {"kind": "state_overflow", "severity": "warning", "modules": sorted({r["module"] or "<top>" for r in rows}),
            "tensors": [r["tensor"] for r in rows],
            "message": f"{len(rows)} tensor(s) of training state overflow their storage while FP32 holds them "
                       f"finite: {where}. Why: {first['why'] or 'the value is beyond the dtype range'}. "
                       f"Fix: {first['fix'] or 'keep it in float32'}"}


def preflight_rows(ev: dict) -> list[dict]:
    """The state checks of a ``preflight`` event that did not pass."""
    checks = ev.get("checks") if isinstance(ev.get("checks"), list) else []
    return [{k: str(c.get(k) or "") for k in ("name", "status", "message", "hint")} for c in checks
            if isinstance(c, dict) and c.get("name") in STATE_CHECKS and c.get("status") in ("warn", "fail")]


def swamping_summary(data: Any) -> dict:
    """``{"tensors": [...], "preflight": [...]}`` of a TraceData; tensors worst first (least movement kept)."""
    by_tensor: dict[str, dict] = {}
    for row in data.swamping:
        seen = by_tensor.get(row["tensor"])
        if seen is None:
            seen = by_tensor[row["tensor"]] = {**row, "steps": 0, "first_step": row["step"], "max_share": None}
        seen.update({k: v for k, v in row.items() if v is not None})
        seen["steps"] += 1
        seen["last_step"] = row["step"]
        if row["share_rounded"] is not None:
            seen["max_share"] = max(seen["max_share"] or 0.0, row["share_rounded"])
    tensors = sorted(by_tensor.values(), key=lambda r: (r["realized_ratio"] if r["realized_ratio"] is not None
                                                        else 1.0, -(r["share_rounded"] or 0.0)))
    for r in tensors:
        r.pop("step", None)
    return {"tensors": tensors, "preflight": list(data.preflight), "overflows": _overflows(data)}


def _pct(x: float | None) -> str:
    return fmt(x, ".0%", none="?")


def _line(r: dict) -> str:
    return (f"{r['tensor']} ({r['kind'] or '?'} of {r['module'] or '<top>'}, {r['dtype'] or '?'}): "
            f"{_pct(r['share_rounded'])} of its updates rounded away, {_pct(r['realized_ratio'])} of the FP32 "
            f"movement kept (step {r['last_step']})")


def swamping_advice(summary: dict) -> dict | None:
    """The warning when low-precision state lost its updates (or the preflight said it would), else None."""
    sw = summary.get("swamping") or {}
    tensors, checks = sw.get("tensors") or [], sw.get("preflight") or []
    if tensors:
        worst = tensors[0]
        modules = sorted({r["module"] or "<top>" for r in tensors})
        more = f"; {len(tensors) - SHOWN} more tensors" if len(tensors) > SHOWN else ""
        return {"kind": "swamping", "severity": "warning", "modules": modules,
                "tensors": [r["tensor"] for r in tensors],
                "message": f"{len(tensors)} tensor(s) stored in low precision without an FP32 master lose their "
                           f"updates (swamping), in {', '.join(modules[:SHOWN])}: "
                           + "; ".join(_line(r) for r in tensors[:SHOWN]) + more
                           + f". Why: {worst['why'] or 'updates below half an ulp of the value'}. "
                           f"Fix: {worst['fix'] or 'keep it in float32, or give it an FP32 master'}"}
    if checks:
        return {"kind": "preflight", "severity": "warning",
                "message": "preflight: " + "; ".join(f"{c['name']}: {c['message']}"
                                                     + (f" -> {c['hint']}" if c["hint"] else "") for c in checks)}
    return None


def render_swamping(sw: dict, console: Any) -> None:
    """The swamping section of ``ampaudit report`` in the terminal: one line per tensor, worst first."""
    from rich.markup import escape

    tensors = sw.get("tensors") or []
    for r in sw.get("overflows") or []:
        console.print(f"\n[bold]State overflow[/] [red]![/] [bold]{escape(r['tensor'])}[/] "
                      f"({escape(r['kind'] or '?')}, {escape(r['dtype'] or '?')}): FP32 updates reach "
                      f"{fmt(r['fp32_absmax'], '.3g', none='?')}, beyond {fmt(r['limit'], '.6g', none='?')}")
    if not tensors:
        return
    console.print(f"\n[bold]Swamping[/] (low-precision state whose updates round away; {len(tensors)} tensors)")
    for r in tensors[:10]:
        rel = "" if r["update_rel"] is None else (f", updates ~{r['update_rel']:.1e} of the value vs half an ulp "
                                                   f"{(r['half_ulp_rel'] or 0):.1e}")
        console.print(f"  [yellow]![/] [bold]{escape(r['tensor'])}[/] ({escape(r['kind'] or '?')}, "
                      f"{escape(r['dtype'] or '?')}): rounded {_pct(r['share_rounded'])}, kept "
                      f"{_pct(r['realized_ratio'])}{escape(rel)}, {r['steps']} sampled steps")


__all__ = ["STATE_CHECKS", "overflow_advice", "overflow_row", "preflight_rows", "render_swamping", "swamping_advice",
           "swamping_row", "swamping_summary"]
