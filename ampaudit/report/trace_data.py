"""A trace's events as normalised values, the ground floor of the report's modules: field readers (:func:`num`,
:func:`finite`, :func:`text`, :func:`as_step`), the number format people read (:func:`fmt`), and
:class:`TraceData`, the events grouped by kind that every reader of one kind fills and reads.

    from ampaudit.report.trace_data import TraceData, finite, fmt, num
    num("inf"), finite("nan"), fmt(0.01234)     # inf, None, "0.0123"

The rows of each kind are built by its own module (``ampaudit.report.trace_fp8``, ``trace_eval``, ...), grouped by
:func:`ampaudit.report.trace_summary.collect`; this module imports none of them, so each may import it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

# A divergence scope ranks modules by the error they add themselves ("local") before the error they carry from
# upstream ("global"); "grad" compares parameter gradients and is ranked on its own.
SCOPE_PREFERENCE = ("local", "global")


def num(value: Any) -> float | None:
    """A trace field as a float: numbers, and the strings "inf"/"-inf"/"nan" the writer uses; else ``None``."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str) and value.strip().lower() in ("inf", "-inf", "+inf", "nan", "infinity", "-infinity"):
        return float(value.strip().lower())
    return None


def finite(value: Any) -> float | None:
    """Like :func:`num`, but ``None`` for inf/NaN."""
    x = num(value)
    return x if x is not None and math.isfinite(x) else None


def text(value: Any) -> str | None:
    """A trace field as a string, else ``None``."""
    return value if isinstance(value, str) else None


def log2(x: float | None) -> float | None:
    """log2 of a positive finite number, else ``None``."""
    return math.log2(x) if x is not None and x > 0 and math.isfinite(x) else None


@dataclass
class StepRow:
    """One ``step`` event, normalised."""

    step: int
    loss: float | None
    scale: float | None
    skipped: bool
    grad_norm: float | None
    clipped: bool
    lr: float | None
    time: float | None


@dataclass
class TraceData:
    """The events of one trace grouped by kind, with fields normalised. Build with :func:`collect`."""

    meta: dict = field(default_factory=dict)
    steps: list[StepRow] = field(default_factory=list)
    stats: list[dict] = field(default_factory=list)
    nonfinite: list[dict] = field(default_factory=list)
    divergence: list[dict] = field(default_factory=list)
    skips: list[dict] = field(default_factory=list)
    grad_hist: list[dict] = field(default_factory=list)     # rows of ampaudit.report.grad_hist
    checkpoints: list[dict] = field(default_factory=list)
    halts: list[dict] = field(default_factory=list)
    fp8: list[dict] = field(default_factory=list)           # rows of ampaudit.report.trace_fp8
    fp8_budget: list[dict] = field(default_factory=list)
    recipes: list[dict] = field(default_factory=list)       # rows of ampaudit.report.trace_recipes
    fallbacks: list[dict] = field(default_factory=list)
    evals: list[dict] = field(default_factory=list)         # rows of ampaudit.report.trace_eval
    swamping: list[dict] = field(default_factory=list)      # rows of ampaudit.report.trace_swamping
    overflows: list[dict] = field(default_factory=list)     # state_overflow rows (same module)
    preflight: list[dict] = field(default_factory=list)     # state checks that did not pass (same module)
    decisions: list[dict] = field(default_factory=list)     # rows of ampaudit.report.trace_decisions
    precursors: list[dict] = field(default_factory=list)    # rows of ampaudit.report.trace_precursors
    unknown: dict[str, int] = field(default_factory=dict)

    @property
    def skipped_steps(self) -> list[int]:
        """Steps skipped by the loss scaler, from ``step`` rows and ``skip`` events, sorted."""
        found = {r.step for r in self.steps if r.skipped}
        found.update(s["step"] for s in self.skips if s["step"] is not None)
        return sorted(found)

    def divergence_scope(self) -> str | None:
        """The scope modules are ranked by: local, else global, else any non-grad scope present."""
        scopes = {d["scope"] for d in self.divergence if d["scope"] != "grad"}
        for scope in SCOPE_PREFERENCE:
            if scope in scopes:
                return scope
        return sorted(s for s in scopes if s)[0] if any(scopes) else None


def as_step(value: Any) -> int | None:
    """A step number: an int, or a float that is one; else ``None``."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def fmt(value: Any, spec: str = ".3g", none: str = "-") -> str:
    """A summary number for people: ``None`` as ``-``, inf/NaN strings kept as they are."""
    x = num(value)
    if x is None:
        return none
    if x != x or x in (float("inf"), float("-inf")):
        return str(value)
    return format(x, spec)
