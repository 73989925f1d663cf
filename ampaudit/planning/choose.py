"""Choosing each Linear's precision from what was measured: float8 where aligned, faster and within the error
budget forward and backward; else bfloat16; float32 where even bf16 is off by more than check's divergence line.

    layers = choose(measures, recipe="tensorwise", speed_model="h100")    # [LayerPlan, ...], module order
    layers[0].choice, layers[0].reasons                                  # "bfloat16", ["input: 31% of ... flushed"]

The reasons are written for the person reading the plan: each names the measured number and the line it crossed.
Thresholds are data (rules/policy/settings.toml [plan] and [calibration]).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch

from ampaudit.policy import divergence_thresholds, settings

CHOICES = ("float8", "bfloat16", "float32")
BACKWARD = ("grad_input", "grad_weight")


@dataclass
class Budget:
    """Minimum SQNR in dB against FP32 for a layer to train in float8."""

    forward_db: float
    backward_db: float

    @classmethod
    def default(cls) -> "Budget":
        cfg = settings()["plan"]
        return cls(float(cfg["budget_forward_db"]), float(cfg["budget_backward_db"]))

    def to_dict(self) -> dict:
        return {"forward_db": self.forward_db, "backward_db": self.backward_db}


@dataclass
class LayerPlan:
    """One Linear's choice, why, and the numbers behind it."""

    module: str
    choice: str
    reasons: list[str]
    in_features: int
    out_features: int
    tokens: int
    metrics: dict = field(default_factory=dict)
    stats: dict = field(default_factory=dict)
    speedup: float | None = None          # predicted fp8 / bf16 step speedup of this layer's three GEMMs
    padded: dict | None = None            # {"in_features": 32, ...} when --pad makes it fit
    # Planned without --pad: {dim: padded size} when alignment was the layer's only reason to stay out of float8
    # (``train --pad`` pads it and trains it in float8).
    float8_if_padded: dict | None = None
    torchao: bool | None = None           # what torchao's own filter would choose (True: float8)
    speed: dict | None = None             # speed.linear_times: predicted seconds in bf16 and fp8
    gemms: dict | None = None             # {"output": .., "grad_input": .., "grad_weight": ..} where they differ
    speed_bf16: float | None = None       # predicted bf16 seconds of its three GEMMs (the plan's speed baseline)

    def to_dict(self) -> dict:
        from ampaudit.runtime.trace import jsonable

        return jsonable({"module": self.module, "choice": self.choice, "reasons": self.reasons,
                         "shape": {"in_features": self.in_features, "out_features": self.out_features,
                                   "tokens": self.tokens},
                         "metrics": self.metrics, "stats": self.stats, "speedup": self.speedup,
                         "padded": self.padded, "float8_if_padded": self.float8_if_padded,
                         "torchao_filter": self.torchao}
                        | ({"gemms": self.gemms} if self.gemms else {}))


def _sqnr(metrics: dict, dtype: str, role: str) -> tuple[float, str]:
    """(dB, what) of the lower of the tensor's SQNR and its median row's (tokens): either losing bits is a loss."""
    entry = metrics.get(dtype, {}).get(role, {})
    values = [(float(entry[k]), what) for k, what in (("sqnr_db", "SQNR"), ("row_sqnr_db", "median-row SQNR"))
              if isinstance(entry.get(k), (int, float))]
    if not values or any(math.isnan(v) for v, _ in values):
        return float("nan"), "SQNR"
    return min(values)


def misaligned_dims(measure: Any) -> dict[str, int]:
    """{dim: padded size} for the weight dims that are not multiples of the fp8 multiple ([plan] fp8_multiple)."""
    multiple = int(settings()["plan"]["fp8_multiple"])
    out = {}
    for dim in ("in_features", "out_features"):
        size = getattr(measure, dim)
        if size % multiple:
            out[dim] = -(-size // multiple) * multiple
    return out


def _flush_note(stats: dict, role: str) -> str:
    share = (stats.get(role) or {}).get("flushed_share")
    if isinstance(share, (int, float)) and share >= 0.01:
        return f"; {share:.0%} of its nonzero {role.replace('_', ' ')} values flush to 0 in fp8"
    return ""


def _bf16_fails(measure: Any) -> str | None:
    warning, _ = divergence_thresholds(torch.bfloat16)
    for role in ("output",) + BACKWARD:
        rel = measure.metrics.get("bfloat16", {}).get(role, {}).get("rel_l2")
        if isinstance(rel, (int, float)) and rel > warning:        # NaN: the FP32 reference is not finite
            return (f"bf16 {role.replace('_', ' ')} is off by {rel:.1%} (over check's divergence line "
                    f"{warning:.1%}): keep it in fp32")
    return None


def choose_layer(measure: Any, *, budget: Budget, speed: dict | None = None, pad: bool = False,
                 flagged: str | None = None) -> LayerPlan:
    """The plan for one measured layer (a ``measure.LayerMeasure``); ``speed`` from ``speed.linear_times``."""
    plan = LayerPlan(measure.module, "float8", [], measure.in_features, measure.out_features, measure.tokens,
                     metrics=measure.metrics, stats=measure.stats,
                     speedup=speed["speedup"] if speed else None, speed=speed)
    if flagged:
        plan.choice = "float32"
        plan.reasons.append(flagged)
        return plan
    bf16 = _bf16_fails(measure)
    if bf16:
        plan.choice = "float32"
        plan.reasons.append(bf16)
        return plan
    misaligned = misaligned_dims(measure)
    if misaligned and pad:
        plan.padded = misaligned
    elif misaligned:
        dims = ", ".join(f"{d} {getattr(measure, d)}" for d in misaligned)
        multiple = int(settings()["plan"]["fp8_multiple"])
        plan.reasons.append(f"{dims} not a multiple of {multiple} (--pad pads it without changing results)")
    for role, floor in (("output", budget.forward_db), *((r, budget.backward_db) for r in BACKWARD)):
        if role not in measure.metrics.get("float8", {}):
            continue                # no gradient reached this layer: its backward is not trained
        sqnr, what = _sqnr(measure.metrics, "float8", role)
        source = "input" if role == "output" else "grad_output"
        if math.isnan(sqnr):
            plan.reasons.append(f"fp8 {role.replace('_', ' ')} not measurable (the FP32 reference is not finite)")
        elif not sqnr >= floor:
            plan.reasons.append(f"fp8 {role.replace('_', ' ')} {what} {sqnr:.1f} dB < {floor:g} dB budget"
                                + _flush_note(measure.stats, source))
    cap = float(settings()["plan"]["max_flushed_share"])
    # rowwise casts input and grad_output a second time along the tokens for the weight gradient.
    for role in ("input", "grad_output", "input_for_grad_weight", "grad_output_for_grad_weight"):
        share = (measure.stats.get(role) or {}).get("flushed_share")
        if isinstance(share, (int, float)) and share > cap and not any(role.replace("_", " ") in r for r in plan.reasons):
            plan.reasons.append(f"{share:.0%} of the nonzero {role.replace('_', ' ')} values flush to 0 in fp8 "
                                f"(over {cap:.0%}; the SQNR does not show values this small)")
    if speed is not None and speed["speedup"] < 1.0:
        # Few tokens or a narrow layer: the amax and cast passes cost more than the faster GEMMs save.
        plan.reasons.append(f"predicted {1 / speed['speedup']:.2f}x slower in fp8 ({speed['bound']}-bound at "
                            f"{measure.tokens} tokens)")
    if misaligned and not pad and len(plan.reasons) == 1:
        plan.float8_if_padded = misaligned   # alignment alone keeps it out
    if plan.reasons:
        plan.choice = "bfloat16"
    else:
        plan.reasons.append("aligned, within budget forward and backward"
                            + (f", {speed['speedup']:.2f}x faster" if speed else ""))
    return plan


def choose(measures: Iterable[Any], *, budget: Budget | None = None, speeds: dict[str, dict] | None = None,
           pad: bool = False, flagged: dict[str, str] | None = None) -> list[LayerPlan]:
    """Plans for every measured layer. ``speeds``: module -> ``linear_times`` result (None: speed not modelled);
    ``flagged``: module -> a reason it must stay fp32 (check's findings)."""
    budget = budget or Budget.default()
    return [choose_layer(m, budget=budget, speed=(speeds or {}).get(m.module), pad=pad,
                         flagged=(flagged or {}).get(m.module)) for m in measures]
