"""What went wrong when the loss scaler skips steps: which parameters and modules had non-finite gradients.

Only skipped steps pay for this (one ``isfinite`` per gradient); :class:`SkipLog` counts, per module, in how many
skipped steps it overflowed, and :func:`halt_diagnosis` turns that plus the scale history into the dict the
``halt`` trace event, ``halt.json`` and the error message report.

    found = nonfinite_grads(named_params)        # ampaudit.runtime.grads
    log.record(step, scale, found["params"], found["modules"])
    diagnosis = halt_diagnosis(reason, step, scaler, log)
"""
from __future__ import annotations

import collections
from typing import Any

from ampaudit.train.scaler import LossScaler


class SkipLog:
    """Per-module overflow counts over the skipped steps of a run, and the most recent skip."""

    def __init__(self) -> None:
        self.modules: collections.Counter[str] = collections.Counter()
        self.last: dict[str, Any] | None = None

    def record(self, step: int, scale: float | None, params: list[str], modules: list[str]) -> None:
        self.modules.update(modules)
        self.last = {"step": step, "scale": scale, "params": params, "modules": modules}


def halt_diagnosis(reason: str, step: int, scaler: LossScaler, log: SkipLog, *,
                   loss: float | None = None) -> dict[str, Any]:
    """Plain-data diagnosis of a halted run: reason, counters, overflowing modules, scale history."""
    worst = [{"module": m, "skipped_steps": n} for m, n in log.modules.most_common(20)]
    return {"reason": reason, "step": step, "scale": scaler.get_scale(), "min_scale": scaler.min_scale,
            "consecutive_skips": scaler.consecutive_skips, "total_skips": scaler.total_skips,
            "steps": scaler.steps, "last_loss": loss, "overflowing_modules": worst,
            "last_skip": log.last, "scale_history": list(scaler.history)[-64:]}


def describe(diagnosis: dict[str, Any]) -> str:
    """One line naming the modules that overflowed most, for the error message."""
    mods = [m["module"] or "<top>" for m in diagnosis["overflowing_modules"][:5]]
    return f"non-finite gradients in: {', '.join(mods)}" if mods else "no parameter gradient was non-finite"
