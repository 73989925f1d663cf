"""How ampaudit plan chooses a Linear's precision from what was measured (no torchao needed here)."""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from ampaudit.planning.choose import Budget, choose, choose_layer


def _metrics(fp8=(28.0, 22.0, 22.0), bf16_rel=0.004):
    roles = ("output", "grad_input", "grad_weight")
    return {"float8": {r: {"sqnr_db": v, "rel_l2": 10 ** (-v / 20)} for r, v in zip(roles, fp8)},
            "bfloat16": {r: {"sqnr_db": 48.0, "rel_l2": bf16_rel} for r in roles},
            "float16": {r: {"sqnr_db": 66.0, "rel_l2": 5e-4} for r in roles}}


@dataclass
class Measured:            # what measure.LayerMeasure carries, as far as choose reads it
    module: str = "fc"
    in_features: int = 256
    out_features: int = 512
    tokens: int = 4096
    metrics: dict = field(default_factory=_metrics)
    stats: dict = field(default_factory=lambda: {"input": {"flushed_share": 0.0}, "weight": {"flushed_share": 0.0},
                                                 "grad_output": {"flushed_share": 0.0}})


BUDGET = Budget(20.0, 15.0)
FAST = {"bfloat16": 2e-5, "float8": 1.4e-5, "speedup": 1.43, "bound": "compute"}
SLOW = {"bfloat16": 2e-6, "float8": 4e-6, "speedup": 0.5, "bound": "memory"}


def test_aligned_within_budget_and_faster_is_float8():
    plan = choose_layer(Measured(), budget=BUDGET, speed=FAST)
    assert plan.choice == "float8" and "1.43x faster" in plan.reasons[0]


def test_misaligned_stays_bf16_unless_padded():
    layer = Measured(in_features=30)
    plan = choose_layer(layer, budget=BUDGET, speed=FAST)
    assert plan.choice == "bfloat16" and "in_features 30 not a multiple of 16" in plan.reasons[0]
    assert plan.float8_if_padded == {"in_features": 32}           # alignment alone: train --pad takes it
    padded = choose_layer(layer, budget=BUDGET, speed=FAST, pad=True)
    assert padded.choice == "float8" and padded.padded == {"in_features": 32} and padded.float8_if_padded is None
    worse = choose_layer(Measured(in_features=30, metrics=_metrics(fp8=(9.5, 22.0, 22.0))), budget=BUDGET, speed=FAST)
    assert worse.choice == "bfloat16" and len(worse.reasons) == 2 and worse.float8_if_padded is None


def test_over_budget_names_the_number_and_the_flushed_share():
    layer = Measured(metrics=_metrics(fp8=(9.5, 22.0, 22.0)))
    layer.stats["input"]["flushed_share"] = 0.31
    plan = choose_layer(layer, budget=BUDGET, speed=FAST)
    assert plan.choice == "bfloat16"
    assert plan.reasons == ["fp8 output SQNR 9.5 dB < 20 dB budget; 31% of its nonzero input values flush to 0 in fp8"]


def test_backward_budget_is_its_own():
    plan = choose_layer(Measured(metrics=_metrics(fp8=(28.0, 22.0, 12.0))), budget=BUDGET)
    assert plan.choice == "bfloat16" and plan.reasons[0].startswith("fp8 grad weight SQNR 12.0 dB < 15 dB")
    assert choose_layer(Measured(metrics=_metrics(fp8=(28.0, 22.0, 12.0))), budget=Budget(20, 10)).choice == "float8"


def test_predicted_slower_stays_bf16():
    plan = choose_layer(Measured(tokens=16), budget=BUDGET, speed=SLOW)
    assert plan.choice == "bfloat16" and plan.reasons == ["predicted 2.00x slower in fp8 (memory-bound at 16 tokens)"]
    assert choose_layer(Measured(tokens=16), budget=BUDGET, speed=None).choice == "float8"   # --speed-model off


def test_a_layer_bf16_cannot_hold_is_float32():
    plan = choose_layer(Measured(metrics=_metrics(bf16_rel=0.3)), budget=BUDGET, speed=FAST)
    assert plan.choice == "float32" and "bf16 output is off by 30.0%" in plan.reasons[0]


def test_nan_measurement_is_never_within_budget():
    plan = choose_layer(Measured(metrics=_metrics(fp8=(float("nan"), 22.0, 22.0))), budget=BUDGET)
    assert plan.choice == "bfloat16"


def test_check_findings_keep_a_layer_fp32():
    plans = choose([Measured(module="a"), Measured(module="b")], budget=BUDGET, flagged={"b": "AMP701 ..."})
    assert [p.choice for p in plans] == ["float8", "float32"] and plans[1].reasons == ["AMP701 ..."]


def test_default_budget_is_data():
    from ampaudit.policy import settings

    cfg = settings()["plan"]
    assert Budget.default() == Budget(cfg["budget_forward_db"], cfg["budget_backward_db"])


@pytest.mark.parametrize("choice", ["float8", "bfloat16", "float32"])
def test_to_dict_has_the_contract_keys(choice):
    plan = choose_layer(Measured(), budget=BUDGET, speed=FAST)
    plan.choice = choice
    d = plan.to_dict()
    assert set(d) >= {"module", "choice", "reasons", "metrics", "speedup", "shape", "torchao_filter"}


def test_gradients_mostly_flushed_keep_a_layer_out_even_at_a_fine_sqnr():
    layer = Measured()
    layer.stats["grad_output"]["flushed_share"] = 0.98
    plan = choose_layer(layer, budget=BUDGET, speed=FAST)
    assert plan.choice == "bfloat16" and plan.reasons[0].startswith("98% of the nonzero grad output values flush")


def test_a_layer_no_gradient_reaches_is_judged_on_its_forward():
    layer = Measured()
    for role in ("grad_input", "grad_weight"):
        del layer.metrics["float8"][role]
    assert choose_layer(layer, budget=BUDGET, speed=FAST).choice == "float8"


def test_a_non_finite_reference_is_not_a_bf16_failure():
    layer = Measured(metrics=_metrics(fp8=(float("nan"), 22.0, 22.0), bf16_rel=float("nan")))
    plan = choose_layer(layer, budget=BUDGET, speed=FAST)
    assert plan.choice == "bfloat16" and "not measurable" in plan.reasons[0]


def test_the_median_row_is_judged_too():
    """A few huge rows (an attention sink) carry the tensor's SQNR while every other token lost its bits."""
    layer = Measured()
    layer.metrics["float8"]["output"]["row_sqnr_db"] = 18.0
    plan = choose_layer(layer, budget=BUDGET, speed=FAST)
    assert plan.choice == "bfloat16" and plan.reasons[0].startswith("fp8 output median-row SQNR 18.0 dB < 20 dB")
