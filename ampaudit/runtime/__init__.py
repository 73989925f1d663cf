"""Runtime instrumentation: ``watch`` (hooks for any training loop), ``locate_nonfinite`` and
``compare_to_fp32`` (one-batch checks, used by ``check --calibrate``), and the JSON Lines trace.

Names are imported lazily: ``ampaudit.runtime.trace`` stays importable without loading the hooks.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "watch": "ampaudit.runtime.watch",
    "Watch": "ampaudit.runtime.watch",
    "NonFiniteError": "ampaudit.runtime.watch",
    "locate_nonfinite": "ampaudit.runtime.locate",
    "compare_to_fp32": "ampaudit.runtime.compare",
    "TraceWriter": "ampaudit.runtime.trace",
    "read_trace": "ampaudit.runtime.trace",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ampaudit.runtime' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
