"""Target autocast policies as data: which dtype each op computes in on a device, for a low-precision dtype.

    policy = Policy.load("cuda", "float16")
    policy.category("softmax")      # "fp32_output"
    policy.low                      # torch.float16
    policy.alignment                # 8

The tables live in ``rules/policy/<device>.toml`` and ``rules/policy/ops.toml``; nothing here names an op.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import torch

# DTypeLimits, unit_roundoff and low_dtype live in ampaudit.dtypes; imported from here by older callers.
from ampaudit.dtypes import DTypeLimits, dtype_of, limits, low_dtype, name_of, short_name, unit_roundoff  # noqa: F401
from ampaudit.errors import RuleError, UsageError
# rules_dir and read_toml live in ampaudit.datafiles (no torch); imported from here by older callers.
from ampaudit.datafiles import read_toml, rules_dir  # noqa: F401

DEVICES = ("cuda", "cpu")
# check's targets: float8 runs its non-GEMM ops in bf16.
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float8": torch.bfloat16}
CATEGORIES = ("lower", "fp32", "fp32_output", "promote", "banned")


@lru_cache(maxsize=None)
def op_names() -> dict:
    """``{"modules": {class name: op}, "aliases": {...}, "casts": {...}}`` from rules/policy/ops.toml."""
    return read_toml(rules_dir() / "policy" / "ops.toml")


@lru_cache(maxsize=None)
def settings() -> dict:
    return read_toml(rules_dir() / "policy" / "settings.toml")


@lru_cache(maxsize=None)
def devices() -> dict:
    """rules/policy/devices.toml: which compute capability has which Tensor Cores, which CPU flags mean what."""
    return read_toml(rules_dir() / "policy" / "devices.toml")


@lru_cache(maxsize=None)
def precursors() -> dict:
    """rules/policy/precursors.toml: thresholds of the instability precursors (attention and output logits, massive
    activations, loss spikes) with their citations; one table per signal."""
    return read_toml(rules_dir() / "policy" / "precursors.toml")


@lru_cache(maxsize=None)
def kernels() -> dict:
    """rules/policy/kernels.toml: what the kernels do with fp16/bf16 tensors (hazard per op, see the file), and
    ``simulated_in_fp32``: ``{aten op: frozenset of dtype names}`` the CUDA simulation computes in fp32."""
    data = read_toml(rules_dir() / "policy" / "kernels.toml")
    hazard = {op: name for name, ops in data.get("hazard", {}).items() for op in ops}
    in_fp32 = data.get("simulated_in_fp32", {})
    return {"hazard": hazard, "wide_range": frozenset(data.get("wide_range", {}).get("dtypes", [])),
            "simulated_in_fp32": {op: frozenset(in_fp32.get("dtypes", [])) for op in in_fp32.get("ops", [])}}


def divergence_thresholds(dtype: torch.dtype | str | None) -> tuple[float, float]:
    """(warning, error) relative-L2 thresholds of a module's own error in ``dtype``: multiples of its unit
    roundoff (rules/policy/settings.toml [calibration]); fp16 when the dtype is unknown or not 16-bit."""
    dtype = low_dtype(dtype)
    cfg, u = settings()["calibration"], unit_roundoff(dtype)
    return cfg["divergence_warning_u"] * u, cfg["divergence_error_u"] * u


def kernel_hazard(op: str, dtype: torch.dtype) -> str | None:
    """What remains hazardous when ``op``'s kernel runs on ``dtype`` tensors: "range", "conditioning",
    "storage", or None for ops the table does not know. A range hazard in a dtype with fp32's range (bf16) is
    only one of storage."""
    hazard = kernels()["hazard"].get(op)
    if hazard == "range" and name_of(dtype) in kernels()["wide_range"]:
        return "storage"
    return hazard


@dataclass(frozen=True)
class Policy:
    """The autocast policy of one device for one low-precision dtype."""

    device: str
    dtype_name: str
    low: torch.dtype
    alignment: int
    table: dict = field(hash=False, compare=False)
    gemm_dtype: torch.dtype | None = None  # float8 targets run GEMMs in fp8, the rest in ``low``

    @classmethod
    def load(cls, device: str, dtype: str) -> "Policy":
        return _load_policy(device, dtype)

    def category(self, op: str) -> str | None:
        """``lower``/``fp32``/``fp32_output``/``promote``/``banned``, or None when the op follows its inputs."""
        return self.table.get(op)

    @property
    def limits(self) -> DTypeLimits:
        return limits(self.low)

    def short(self) -> str:
        return short_name(self.dtype_name)

    def describe(self) -> dict:
        return {"device": self.device, "dtype": self.dtype_name}


@lru_cache(maxsize=None)
def _load_policy(device: str, dtype: str) -> Policy:
    if device not in DEVICES:
        raise UsageError(f"unknown device {device!r}", hint=f"use --device {' or '.join(DEVICES)}")
    if dtype not in DTYPES:
        raise UsageError(f"unknown dtype {dtype!r}", hint=f"use --dtype {', '.join(DTYPES)}")
    path = rules_dir() / "policy" / f"{device}.toml"
    data = read_toml(path)
    table: dict[str, str] = {}
    for category in CATEGORIES:
        ops = data.get(category, [])
        if not isinstance(ops, list) or not all(isinstance(o, str) for o in ops):
            raise RuleError(f"{path.name}: key {category!r} must be a list of op names", hint="fix the policy file")
        for op in ops:
            table.setdefault(op, category)
    align = settings()["alignment"]
    gemm = None
    if dtype == "float8":
        gemm = dtype_of(settings()["float8"]["gemm_dtype"])
    return Policy(device=device, dtype_name=dtype, low=DTYPES[dtype], alignment=int(align[dtype]), table=table,
                  gemm_dtype=gemm)


def round_up(value: int, multiple: int) -> int:
    return int(math.ceil(value / multiple) * multiple)
