"""One line of the precision preflight, the form every check returns (:mod:`ampaudit.train.preflight`,
:mod:`ampaudit.train.preflight_state`).

    c = Check("reduce", "fail", "bf16 gradient reduction over 64 ranks", "reduce_dtype=torch.float32")
    c.line()            # "FAIL reduce: bf16 gradient reduction over 64 ranks -> reduce_dtype=torch.float32"
    failed([c])         # [c]
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Check:
    """One preflight line. ``status``: "ok", "warn" or "fail"; ``hint``: what to change (failures, warnings)."""

    name: str
    status: str
    message: str
    hint: str = ""

    def line(self) -> str:
        tag = {"ok": "ok  ", "warn": "warn", "fail": "FAIL"}[self.status]
        return f"{tag} {self.name}: {self.message}" + (f" -> {self.hint}" if self.hint and self.status != "ok" else "")

    def to_dict(self) -> dict:
        return asdict(self)


def failed(checks: Sequence[Check]) -> list[Check]:
    return [c for c in checks if c.status == "fail"]
