"""Rewrite passes behind ``ampaudit fix``: FP32 islands (networkx partitioning of flagged nodes), alignment
padding, verification and the writer of the fixed model file; and ``keep_fp32`` for eager models.

    result = ampaudit.fix(model, x, device="cuda")          # ampaudit.rewrite.api.fix
    ampaudit.keep_fp32(model, ["encoder.*.attn"])          # ampaudit.precision.keep_fp32.keep_fp32

The package is named ``rewrite`` (not ``fix``) so that ``ampaudit.fix`` stays the function: a subpackage of the
same name would become the package attribute the moment it is imported.
"""
from ampaudit.rewrite.api import FixResult, fix
from ampaudit.precision.keep_fp32 import keep_fp32

__all__ = ["FixResult", "fix", "keep_fp32"]
