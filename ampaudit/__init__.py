"""ampaudit: make PyTorch mixed-precision training safe and fast.

    import ampaudit
    report = ampaudit.check(model, x, device="cuda", dtype="float16")
    for f in report.findings:
        print(f.severity, f.rule, f.module, f.location, f.message)
    with ampaudit.watch(model, trace="run.jsonl", every=50) as w:
        ...  # your training loop

Names are imported lazily so ``import ampaudit`` stays cheap.
"""
from __future__ import annotations

from ampaudit.lazy_names import lazy_getattr

__version__ = "0.1.0"

_EXPORTS = {
    "check": "ampaudit.api",
    "Report": "ampaudit.findings",
    "Finding": "ampaudit.findings",
    "watch": "ampaudit.runtime.watch",
    "Watch": "ampaudit.runtime.watch",
    "Trainer": "ampaudit.train.trainer",
    "LossScaler": "ampaudit.train.scaler",
    "TrainResult": "ampaudit.train.trainer",
    "fix": "ampaudit.rewrite.api",
    "FixResult": "ampaudit.rewrite.api",
    "keep_fp32": "ampaudit.precision.keep_fp32",
    "AmpAuditError": "ampaudit.errors",
    "NonFiniteError": "ampaudit.runtime.watch",
    "locate_nonfinite": "ampaudit.runtime.locate",
    "compare_to_fp32": "ampaudit.runtime.compare",
    "plan": "ampaudit.planning.api",
    "Plan": "ampaudit.planning.api",
    "doctor": "ampaudit.machine",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


__getattr__ = lazy_getattr(__name__, globals(), _EXPORTS)
