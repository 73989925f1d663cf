"""Findings and the report that holds them; the JSON form is the versioned output contract of ``check``.

    report.findings[0].rule        # "AMP201"
    report.to_dict()               # {"version", "target", "capture", "policy", "findings", "summary"}
    report.worst()                 # "error" | "warning" | "info" | None
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

# 1.1: each finding has "group"; 1.2: a library's location says "library": true; 1.3: "unaudited" lists what the
# audit could not look into (also among the notes)
REPORT_VERSION = "1.3"
SEVERITY_RANK = {"info": 0, "warning": 1, "error": 2}
# Families about speed (a slower kernel), not about wrong numbers: safety gates (assert_amp_safe, the pytest
# fixture) leave them out unless asked to (speed=True).
SPEED_FAMILIES = frozenset({"alignment"})


@dataclass
class Finding:
    """One hazard: which rule, which module, which op, which source line, why it matters and how to fix it."""

    rule: str
    name: str
    family: str
    severity: str
    module: str
    op: str
    message: str
    location: dict | None = None          # {"file": str, "line": int}, and "library": True on a library's line
    fix: str | None = None
    why: str = ""
    details: dict[str, Any] = field(default_factory=dict)
    code: str = ""                        # the source line itself, for the console
    node: str | None = None               # name of the fx node it was found on (what `fix` rewrites)
    autofix: dict = field(default_factory=lambda: {"kind": "none"})   # the rule's: how `fix` treats it
    fix_nodes: list[str] = field(default_factory=list)                 # more nodes the fix changes with `node`

    @property
    def library(self) -> bool:
        """True when the finding's line is an installed library's (a transformers model's own code)."""
        return bool(self.location and self.location.get("library"))

    @property
    def is_speed(self) -> bool:
        """True for a speed finding (a slower kernel) rather than a safety one (wrong or non-finite numbers)."""
        return self.family in SPEED_FAMILIES

    def as_dict(self) -> dict:
        return {"rule": self.rule, "name": self.name, "family": self.family, "severity": self.severity,
                "module": self.module, "op": self.op, "message": self.message, "location": self.location,
                "fix": self.fix, "why": self.why, "node": self.node, "details": _jsonable(self.details),
                "autofix": {k: self.autofix[k] for k in ("kind", "safety") if k in self.autofix}}


def location_text(location: dict | None, short=lambda path: path) -> str:
    """``file:line`` of a finding's location (``short`` shortens a user's path), ``file:line (library)`` for an
    installed library's, "-" for none."""
    if not location:
        return "-"
    if location.get("library"):
        return f"{location['file']}:{location['line']} (library)"
    return f"{short(location['file'])}:{location['line']}"


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and value != value:
        return "nan"
    if isinstance(value, float) and value in (float("inf"), float("-inf")):
        return str(value)
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


@dataclass
class Report:
    """What one audit found, in execution order of the graph."""

    target: str
    capture: str
    policy: dict
    findings: list[Finding] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    suppressed: int = 0
    nodes: int = 0
    calibration: dict | None = None      # with --calibrate: batches, origin, backward (what was differentiated)
    # What the audit could not look into (a wrapped function fx keeps opaque, ops without a fake kernel), each said in
    # the notes too: without findings, the report does not call such a model clean.
    unaudited: list[str] = field(default_factory=list)

    def worst(self) -> str | None:
        if not self.findings:
            return None
        return max((f.severity for f in self.findings), key=SEVERITY_RANK.__getitem__)

    def at_or_above(self, severity: str) -> list[Finding]:
        return [f for f in self.findings if SEVERITY_RANK[f.severity] >= SEVERITY_RANK[severity]]

    def summary(self) -> dict:
        by_sev = {s: 0 for s in SEVERITY_RANK}
        by_family: dict[str, int] = {}
        for f in self.findings:
            by_sev[f.severity] += 1
            by_family[f.family] = by_family.get(f.family, 0) + 1
        return {"total": len(self.findings), "by_severity": by_sev, "by_family": by_family,
                "suppressed": self.suppressed, "nodes": self.nodes}

    def to_dict(self) -> dict:
        # Every finding, each with the id of its group (the rows of the terminal table).
        findings = [{**f.as_dict(), "group": g} for f, g in zip(self.findings, group_ids(self.findings))]
        return {"version": REPORT_VERSION, "target": self.target, "capture": self.capture, "policy": self.policy,
                "findings": findings, "summary": self.summary(), "notes": self.notes, "unaudited": self.unaudited,
                **({"calibration": self.calibration} if self.calibration is not None else {})}


_NUMBER = re.compile(r"\d+(\.\d+)?(e[-+]?\d+)?%?")


def group_key(f: Finding) -> tuple:
    """Findings of one rule that differ only in their numbers (a misaligned channel count per layer, a share) are
    one group: one pattern and one row of the table (:mod:`ampaudit.report.groups`); JSON keeps each one's
    numbers."""
    return (f.rule, f.severity, _NUMBER.sub("#", f.message))


def group_ids(findings: list[Finding]) -> list[int]:
    """The group index of each finding, groups numbered in order of their first finding."""
    index: dict[tuple, int] = {}
    return [index.setdefault(group_key(f), len(index)) for f in findings]
