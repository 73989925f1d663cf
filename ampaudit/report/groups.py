"""Repeated findings as one group: the same rule, severity and message up to its numbers (BatchNorm in every block
of a ResNet, a channel count off the multiple in every block of a RexNet).

    groups = group_findings(report.findings)
    groups[0].rule, groups[0].count, groups[0].pattern      # "AMP301", 53, "bn1, layer*.*.bn*, layer*.0.downsample.1"
    group_ids(report.findings)                              # [0, 0, 1, ...]: the group of each finding

The terminal table prints one row per group; JSON keeps every finding with its group id, SARIF every location.
Groups are ordered by their first finding, so execution order survives.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ampaudit.findings import Finding, group_ids, group_key  # noqa: F401  (group_ids: the report's too)

# Module patterns of one group shown in the table before "and N more patterns".
MAX_PATTERNS = 3


@dataclass
class Group:
    rule: str
    severity: str
    message: str
    findings: list[Finding] = field(default_factory=list)

    @property
    def count(self) -> int:
        return len(self.findings)

    @property
    def modules(self) -> list[str]:
        return list(dict.fromkeys(f.module for f in self.findings))

    @property
    def pattern(self) -> str:
        return module_pattern(self.modules)

    @property
    def locations(self) -> list[dict]:
        located = [f.location for f in self.findings if f.location]
        return list({(loc["file"], loc["line"]): loc for loc in located}.values())   # first-seen order


_key = group_key


def group_findings(findings: list[Finding]) -> list[Group]:
    """Findings with the same rule, severity and message, in order of their first occurrence."""
    groups: dict[tuple, Group] = {}
    for f in findings:
        g = groups.get(_key(f))
        if g is None:
            g = groups[_key(f)] = Group(f.rule, f.severity, f.message)
        g.findings.append(f)
    return list(groups.values())


def module_pattern(modules: list[str]) -> str:
    """One glob per path depth: ``layer1.0.bn1, layer2.1.bn2`` -> ``layer*.*.bn*``; ``""`` is ``<top>``."""
    by_depth: dict[int, list[list[str]]] = {}
    for m in modules:
        parts = m.split(".") if m else ["<top>"]
        by_depth.setdefault(len(parts), []).append(parts)
    patterns = [".".join(_merge(column) for column in zip(*rows)) for rows in by_depth.values()]
    shown = ", ".join(patterns[:MAX_PATTERNS])
    return shown + (f" and {len(patterns) - MAX_PATTERNS} more patterns" if len(patterns) > MAX_PATTERNS else "")


def _merge(values: tuple[str, ...]) -> str:
    distinct = list(dict.fromkeys(values))
    if len(distinct) == 1:
        return distinct[0]
    # Keep what all names share up front (layer1, layer2 -> layer*; bn1, bn2 -> bn*).
    prefix = distinct[0]
    for v in distinct[1:]:
        while not v.startswith(prefix):
            prefix = prefix[:-1]
    return f"{prefix}*"
