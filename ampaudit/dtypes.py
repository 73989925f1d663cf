"""The one table of dtype names: what users may write for a dtype, and how ampaudit prints one.

    by_name("bf16")            # torch.bfloat16 (None for an unknown name)
    name_of(torch.float16)     # "float16"; "?" for None
    parse_train_dtype("half")  # torch.float16, or a UsageError naming the choices

The autocast targets of ``check`` (float16, bfloat16, and float8, whose non-GEMM ops run in bf16) are the policy's
(``ampaudit.policy.DTYPES``); this table is the names of torch dtypes themselves.
"""
from __future__ import annotations

import torch

from ampaudit.errors import UsageError

NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float64": torch.float64, "double": torch.float64,
    "int64": torch.int64, "long": torch.int64, "int32": torch.int32, "int": torch.int32,
    "bool": torch.bool,
}
# What a training loop can run in: autocast's two 16-bit dtypes, or plain FP32.
TRAIN_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def by_name(name: str) -> torch.dtype | None:
    return NAMES.get(name.strip().lower().replace("torch.", ""))


def name_of(dtype: torch.dtype | None) -> str:
    return str(dtype).replace("torch.", "") if dtype is not None else "?"


def parse_train_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``"float16"``/``"bf16"``/``torch.bfloat16``... -> torch dtype, or a UsageError naming the choices."""
    found = dtype if isinstance(dtype, torch.dtype) else by_name(dtype) if isinstance(dtype, str) else None
    if found not in TRAIN_DTYPES:
        raise UsageError(f"unsupported training dtype {dtype!r}", hint="use float16, bfloat16 or float32")
    return found
