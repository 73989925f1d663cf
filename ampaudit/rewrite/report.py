"""What a fix did, as text for the console and a dict for ``fix.json``.

    print(result.report.to_text())
    result.report.to_dict()   # {"version", "target", "policy", "islands", "casts", "padding", "verification", ...}
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ampaudit.findings import Report

FIX_REPORT_VERSION = "1.0"

# Why island outputs are not cast back; printed in the summary and the written model.py.
OUTPUT_POLICY = ("island outputs stay fp32 (not cast back): a value computed in fp32 may not fit the low dtype, "
                 "and GEMMs downstream cast their inputs under autocast anyway")


@dataclass
class FixReport:
    target: str
    policy: dict
    before: Report | None = None
    islands: list = field(default_factory=list)        # IslandChange
    padding: list = field(default_factory=list)        # PadChange
    unfixed: list = field(default_factory=list)        # Finding
    verification: Any = None                           # Verification
    casts_per_op: int = 0
    flagged_ops: int = 0
    calibrated: bool = False
    notes: list[str] = field(default_factory=list)
    form: str = "graph"        # "graph": the rewritten forward; "modules": keep_fp32 and padding on the module tree

    @property
    def casts(self) -> int:
        return sum(c.casts for c in self.islands)

    def to_dict(self) -> dict:
        return {
            "version": FIX_REPORT_VERSION,
            "target": self.target,
            "policy": self.policy,
            "calibrated": self.calibrated,
            "form": self.form,
            "flagged_ops": self.flagged_ops,
            "islands": [{"index": c.index, "modules": c.modules, "ops": c.ops, "rules": c.rules, "casts": c.casts}
                        for c in self.islands],
            "casts": self.casts,
            "casts_per_op": self.casts_per_op,
            "output_policy": OUTPUT_POLICY,
            "padding": [c.as_dict() for c in self.padding],
            "unfixed": [{"rule": f.rule, "module": f.module, "op": f.op, "message": f.message} for f in self.unfixed],
            "verification": self.verification.as_dict() if self.verification is not None else None,
            "notes": self.notes,
        }

    def lines(self) -> list[str]:
        pol = f"{self.policy.get('dtype')} autocast on {self.policy.get('device')}"
        out = [f"ampaudit fix {self.target} [{pol}]"]
        if self.form == "modules":
            out.append("form: fixed on the module tree (fp32 modules and padded layers; the model keeps its own "
                       "forward, which torch.fx cannot rewrite)")
        if self.islands and self.form == "modules":
            out.append(f"{len(self.islands)} module(s) kept in fp32 (ampaudit.keep_fp32) over {self.flagged_ops} "
                       "finding(s): each runs whole in fp32 under autocast, its GEMMs too")
            out += [f"  {', '.join(c.modules)}: {', '.join(c.ops)} [{', '.join(c.rules)}]" for c in self.islands]
            out.append(f"  {OUTPUT_POLICY}")
        elif self.islands:
            out.append(f"{len(self.islands)} fp32 island(s) over {self.flagged_ops} flagged op(s), "
                       f"{self.casts} cast(s) added (one island per op would add {self.casts_per_op})")
            out += [f"  {c.describe()}" for c in self.islands]
            out.append(f"  {OUTPUT_POLICY}")
        else:
            out.append("no fp32 islands needed")
        if self.padding:
            out.append(f"padded {len(self.padding)} layer(s):")
            out += [f"  {c.describe()}" for c in self.padding]
        for f in self.unfixed:
            out.append(f"not fixed: {f.rule} {f.module or '<top module>'}: {f.message}")
        if self.verification is not None:
            out += [f"verify: {line}" for line in self.verification.lines()]
        return out + self.notes

    def to_text(self) -> str:
        return "\n".join(self.lines())
