"""What ampaudit knows about dtypes: their names, which are low precision, and what each can hold.

    by_name("bf16")            # torch.bfloat16 (None for an unknown name)
    dtype_of("float8_e4m3fn")  # any torch dtype by name or alias, or the dtype itself (None: not a dtype)
    name_of(torch.float16)     # "float16"; "?" for None
    parse_train_dtype("half")  # torch.float16, or a UsageError naming the choices
    is_low(torch.bfloat16)     # True: a float narrower than fp32 (fp16, bf16, the fp8s)
    is_half(torch.float8_e4m3fn)  # False: only autocast's two 16-bit dtypes
    limits(torch.float16).max  # 65504.0; also .normal, .subnormal, .eps, .bits
    unit_roundoff(torch.float16)   # 2 ** -11, the relative error of one rounding
    exact_int_limit(torch.bfloat16)  # 256: every integer in [0, 256] is exact in bf16

The autocast targets of ``check`` (float16, bfloat16, and float8, whose non-GEMM ops run in bf16) are the policy's
(``ampaudit.policy.DTYPES``); this module is about torch dtypes themselves. Every number comes from
``torch.finfo``: nothing else in ampaudit reads it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

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
# How torch's C++ messages name a dtype ("not implemented for 'Half'").
CPP_NAMES = {"Half": "float16", "BFloat16": "bfloat16", "Float": "float32"}
# Short names, as reports and plans print them (float8 is the policy's target: fp8 GEMMs, bf16 elsewhere).
SHORT = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float8": "fp8"}
# What a training loop can run in: autocast's two 16-bit dtypes, or plain FP32.
TRAIN_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# The dtypes autocast lowers to.
HALF = (torch.float16, torch.bfloat16)
FLOAT8 = tuple(d for d in (getattr(torch, n, None) for n in (
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")) if d is not None)
# Every float dtype narrower than FP32 that torch has.
LOW_FLOATS = frozenset(HALF + FLOAT8)


def by_name(name: str) -> torch.dtype | None:
    return NAMES.get(name.strip().lower().replace("torch.", ""))


def dtype_of(value: str | torch.dtype | None) -> torch.dtype | None:
    """A dtype, or its name: an alias of :data:`NAMES` or any torch dtype's own name ("float8_e4m3fn",
    "torch.half"); None for anything else."""
    if isinstance(value, torch.dtype):
        return value
    if not isinstance(value, str):
        return None
    found = by_name(value)
    if found is None:
        found = getattr(torch, value.strip().replace("torch.", ""), None)
    return found if isinstance(found, torch.dtype) else None


def name_of(dtype: torch.dtype | None) -> str:
    return str(dtype).replace("torch.", "") if dtype is not None else "?"


def short_name(name: str | torch.dtype) -> str:
    """``"bfloat16"`` / ``torch.bfloat16`` -> ``"bf16"``; a name without a short form is returned as it is."""
    name = name_of(name) if isinstance(name, torch.dtype) else name
    return SHORT.get(name, name)


def parse_train_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``"float16"``/``"bf16"``/``torch.bfloat16``... -> torch dtype, or a UsageError naming the choices."""
    found = dtype if isinstance(dtype, torch.dtype) else by_name(dtype) if isinstance(dtype, str) else None
    if found not in TRAIN_DTYPES:
        raise UsageError(f"unsupported training dtype {dtype!r}", hint="use float16, bfloat16 or float32")
    return found


def is_low(dtype: torch.dtype | None) -> bool:
    """Whether ``dtype`` is a float narrower than FP32: fp16, bf16 or an fp8 (None, ints, fp32, fp64: False)."""
    return isinstance(dtype, torch.dtype) and dtype.is_floating_point and dtype.itemsize < 4


def is_half(dtype: torch.dtype | None) -> bool:
    """Whether ``dtype`` is one of the two 16-bit floats autocast computes in (fp16, bf16)."""
    return dtype in HALF


def is_float(value: object) -> bool:
    """Whether ``value`` is a floating tensor (any width)."""
    return isinstance(value, torch.Tensor) and value.is_floating_point()


def is_low_tensor(value: object) -> bool:
    """Whether ``value`` is a tensor of a low-precision float dtype (:func:`is_low`)."""
    return isinstance(value, torch.Tensor) and is_low(value.dtype)


@dataclass(frozen=True)
class DTypeLimits:
    """What a float dtype can hold; the numbers come from torch.finfo."""

    dtype: torch.dtype
    max: float
    normal: float  # smallest positive normal
    subnormal: float  # smallest positive subnormal
    eps: float = 0.0  # the gap between 1 and the next value
    bits: int = 0

    @classmethod
    def of(cls, dtype: torch.dtype) -> "DTypeLimits":
        return limits(dtype)

    def as_dtype(self, value: float) -> float:
        """``value`` rounded to this dtype (inf when it overflows, 0 when it flushes)."""
        return float(torch.tensor(value, dtype=torch.float64).to(self.dtype))


@lru_cache(maxsize=None)
def limits(dtype: torch.dtype) -> DTypeLimits:
    """The :class:`DTypeLimits` of a float dtype (a TypeError for an integer dtype, as torch.finfo's)."""
    fi = torch.finfo(dtype)
    normal, eps = float(fi.smallest_normal), float(fi.eps)
    return DTypeLimits(dtype, float(fi.max), normal, normal * eps, eps, int(fi.bits))


def max_of(dtype: torch.dtype | str) -> float:
    """The largest finite value of ``dtype`` (or of the dtype named so): fp16 65504."""
    found = dtype_of(dtype)
    if found is None:
        raise TypeError(f"not a dtype: {dtype!r}")
    return limits(found).max


def unit_roundoff(dtype: torch.dtype) -> float:
    """Half the gap between 1 and the next ``dtype`` value: the relative error of one rounding (fp16 4.9e-4)."""
    return limits(dtype).eps / 2


def mantissa_bits(dtype: torch.dtype) -> int:
    """Stored fraction bits: fp16 10, bf16 7, fp32 23 (eps is 2 ** -bits)."""
    return round(-math.log2(limits(dtype).eps))


def exact_int_limit(dtype: torch.dtype) -> int:
    """The largest N such that every integer in [0, N] is exact in ``dtype``: fp16 2048, bf16 256."""
    return 2 ** (mantissa_bits(dtype) + 1)


def low_dtype(dtype: torch.dtype | str | None) -> torch.dtype:
    """``dtype`` (or its name) as the low-precision float dtype errors are judged in; fp16 when unknown or not
    narrower than fp32."""
    found = dtype_of(dtype)
    return found if is_low(found) else torch.float16


def narrower(a: torch.dtype, b: torch.dtype) -> bool:
    """Whether float dtype ``a`` holds less than ``b``: fewer bits, or as many with a smaller range (fp16 < bf16)."""
    la, lb = limits(a), limits(b)
    return (la.bits, la.max) < (lb.bits, lb.max)
