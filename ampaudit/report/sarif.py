"""SARIF 2.1.0 for GitHub code scanning: one run, one reportingDescriptor per rule, stable partialFingerprints.

    doc = to_sarif(report, rules)       # a dict; json.dump it

A result has a physical location only on a line of the user's code; a finding on an installed library's line (a
transformers model's own code) is not the project's to annotate: its result has the logical location of its
module path instead, and says the library's ``file:line`` in its message and properties (docs/locations.md).
"""
from __future__ import annotations

import hashlib

from ampaudit import __version__
from ampaudit.findings import Report, location_text
from ampaudit.rules.loader import Rule

SCHEMA = "https://json.schemastore.org/sarif-2.1.0.json"
_LEVEL = {"error": "error", "warning": "warning", "info": "note"}


def _fingerprint(f) -> str:
    # Line numbers move with every edit above a finding; module path, rule and op do not.
    key = f"{f.rule}|{f.module}|{f.op}|{(f.location or {}).get('file', '')}|{f.details.get('dim', '')}"
    return hashlib.sha256(key.encode()).hexdigest()[:32]


def to_sarif(report: Report, rules: list[Rule]) -> dict:
    used = sorted({f.rule for f in report.findings})
    by_id = {r.id: r for r in rules}
    descriptors = []
    for rid in used:
        r = by_id[rid]
        desc = {"id": r.id, "name": r.name, "shortDescription": {"text": r.name.replace("-", " ")},
                "fullDescription": {"text": " ".join(r.why.split())},
                "defaultConfiguration": {"level": _LEVEL[r.severity]},
                "help": {"text": f"{' '.join(r.why.split())}\nFix: {r.fix or ''}"},
                "properties": {"family": r.family, "tags": ["mixed-precision", r.family]}}
        if r.references:
            desc["helpUri"] = r.references[0]
        descriptors.append(desc)
    index = {rid: i for i, rid in enumerate(used)}
    results = []
    for f in report.findings:
        res = {"ruleId": f.rule, "ruleIndex": index[f.rule], "level": _LEVEL[f.severity],
               "message": {"text": f"{f.message} [module: {f.module or '<top>'}]" + (f" Fix: {f.fix}" if f.fix else "")},
               "partialFingerprints": {"ampauditFinding/v1": _fingerprint(f)},
               "properties": {"module": f.module, "op": f.op, "family": f.family}}
        if f.library:
            res["message"]["text"] += f" [at {location_text(f.location)}]"
            res["properties"]["libraryLocation"] = dict(f.location)
        if f.location and not f.library:
            res["locations"] = [{"physicalLocation": {
                "artifactLocation": {"uri": f.location["file"].replace("\\", "/")},
                "region": {"startLine": max(1, int(f.location["line"]))}}}]
        else:
            res["locations"] = [{"logicalLocations": [{"fullyQualifiedName": f.module or "<top>", "kind": "module"}]}]
        results.append(res)
    return {
        "$schema": SCHEMA,
        "version": "2.1.0",
        "runs": [{
            "tool": {"driver": {"name": "ampaudit", "version": __version__, "semanticVersion": __version__,
                                "informationUri": "https://github.com/ampaudit/ampaudit", "rules": descriptors}},
            "results": results,
            # What the audit could not look into: without it, no result would read as clean.
            "invocations": [{"executionSuccessful": True, "toolExecutionNotifications": [
                {"level": "warning", "message": {"text": f"not audited: {n}"}} for n in report.unaudited]}],
            "properties": {"target": report.target, "policy": report.policy, "capture": report.capture},
        }],
    }
