"""ampaudit.planning.measure and ampaudit.precision.fp8: per-Linear error in float8 / bf16 / fp16 against FP32."""
from __future__ import annotations

import copy
import dataclasses
import json
import logging
import math
import sys

import pytest
import torch
from torch import nn

from ampaudit.errors import UsageError
from ampaudit.precision import fp8
from ampaudit.planning.measure import error_metrics, measure_layers

try:
    fp8.import_torchao()
except UsageError:
    pytest.skip("torchao is not installed (the fp8 extra)", allow_module_level=True)

BF16_U = 2.0 ** -8          # bf16's unit roundoff
E5M2_RANGE_BITS = math.log2(57344 / 2.0 ** -16)   # max over smallest subnormal: 31.8


def _linear(n_in: int, n_out: int, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(n_in, n_out)


def _times_target(out, target):
    # d loss / d out == target: the test chooses the layer's grad_output exactly.
    return (out * target).sum()


def _sqnr(m, role="output", dtype="float8"):
    return m.metrics[dtype][role]["sqnr_db"]


@pytest.mark.parametrize("recipe", fp8.RECIPES)
def test_float8_numerics_are_torchaos(recipe):
    ao = fp8.import_torchao()
    lin = _linear(32, 48)
    x = torch.randn(2, 8, 32)
    g = torch.randn(2, 8, 48)
    (m,) = measure_layers(lin, [((x,), {}, g)], recipe=recipe, loss_fn=_times_target)

    ref_x = x.clone().requires_grad_(True)
    ref = lin(ref_x)
    ref_gi, ref_gw = torch.autograd.grad(ref, (ref_x, lin.weight), g)
    config = dataclasses.replace(ao.Float8LinearConfig.from_recipe_name(recipe), emulate=True)
    f8 = ao.convert_to_float8_training(copy.deepcopy(lin), config=config)
    assert type(f8).__name__ == "Float8Linear"
    x8 = x.clone().requires_grad_(True)
    y8 = f8(x8)
    gi8, gw8 = torch.autograd.grad(y8, (x8, f8.weight), g)
    assert m.metrics["float8"]["output"] == error_metrics(ref, y8)
    assert m.metrics["float8"]["grad_input"] == error_metrics(ref_gi, gi8)
    assert m.metrics["float8"]["grad_weight"] == error_metrics(ref_gw, gw8)
    assert not torch.equal(ref, y8)                 # float8 did something
    assert (m.module, m.in_features, m.out_features, m.tokens) == ("", 32, 48, 16)


def test_recipes_as_torchao_defines_them():
    ten, row = fp8.config("tensorwise"), fp8.config("rowwise")
    assert ten.emulate and row.emulate
    assert ten.cast_config_input.target_dtype == torch.float8_e4m3fn
    assert ten.cast_config_grad_output.target_dtype == torch.float8_e5m2
    assert not ten.round_scales_to_power_of_2
    # torchao 0.18's rowwise: e4m3 for gradients too, axiswise scales rounded down to powers of two.
    assert row.cast_config_grad_output.target_dtype == torch.float8_e4m3fn
    assert row.cast_config_input.scaling_granularity.value == "axiswise"
    assert row.round_scales_to_power_of_2
    with pytest.raises(UsageError):
        fp8.config("blockwise")


def _outlier_pair(ratio: float):
    """The same layer on an input without and with feature 5 ``ratio`` times the others. The weight column that
    reads feature 5 is divided by ``ratio``: the outlier carries as much of the output as any feature (as
    where a norm's gain blows a channel up and the next layer reads it back), so losing the others shows."""
    lin = _linear(64, 64)
    x = torch.randn(128, 64)
    big = copy.deepcopy(lin)
    with torch.no_grad():
        big.weight[:, 5] /= ratio
    xo = x.clone()
    xo[:, 5] *= ratio
    return (lin, x), (big, xo)


def test_outlier_feature_flushes_the_rest_in_tensorwise():
    (lin, x), (big, xo) = _outlier_pair(1e5)
    (plain,) = measure_layers(lin, [((x,), {})], dtypes=("float8",))
    (outlier,) = measure_layers(big, [((xo,), {})], dtypes=("float8",))
    assert _sqnr(plain) > 25
    assert _sqnr(outlier) < _sqnr(plain) - 12
    assert plain.stats["input"]["flushed_share"] == 0
    assert outlier.stats["input"]["flushed_share"] > 0.3
    assert outlier.stats["input"]["dynamic_range_bits"] > 20


def test_outlier_of_1e4_lands_in_subnormals():
    # e4m3 spans 2**17.8 down to its smallest subnormal: at 1e4 the other features mostly become subnormals
    # (fewer mantissa bits) and a few flush; the output loses dB, not the signal.
    (lin, x), (big, xo) = _outlier_pair(1e4)
    (plain,) = measure_layers(lin, [((x,), {})], dtypes=("float8",))
    (outlier,) = measure_layers(big, [((xo,), {})], dtypes=("float8",))
    assert outlier.stats["input"]["subnormal_share"] > 0.4
    assert 0 < outlier.stats["input"]["flushed_share"] < 0.2
    assert _sqnr(plain) - 5 < _sqnr(outlier) < _sqnr(plain)


def test_rowwise_on_an_outlier_feature():
    # Rowwise scales the input per row along K for the output GEMM: every row holds the outlier feature, so
    # it helps a little (each row's own amax), not much. The grad_weight GEMM casts the input per column
    # (along M): there the outlier feature has its own scale and nothing flushes.
    _, (big, xo) = _outlier_pair(1e5)
    (ten,) = measure_layers(big, [((xo,), {})], recipe="tensorwise", dtypes=("float8",))
    (row,) = measure_layers(big, [((xo,), {})], recipe="rowwise", dtypes=("float8",))
    assert _sqnr(ten) < _sqnr(row) < 20
    assert 0.05 < row.stats["input"]["flushed_share"] < ten.stats["input"]["flushed_share"]
    assert row.stats["input_for_grad_weight"]["flushed_share"] == 0
    assert "input_for_grad_weight" not in ten.stats        # a tensorwise scale is one whichever GEMM


def test_rowwise_isolates_an_outlier_token():
    lin = _linear(64, 64)
    x = torch.randn(128, 64)
    x[7] *= 1e6
    (ten,) = measure_layers(lin, [((x,), {})], recipe="tensorwise", dtypes=("float8",))
    (row,) = measure_layers(lin, [((x,), {})], recipe="rowwise", dtypes=("float8",))
    assert ten.stats["input"]["flushed_share"] > 0.9
    assert row.stats["input"]["flushed_share"] == 0


def test_gradients_beyond_e5m2_range_flush_in_tensorwise():
    lin = _linear(32, 32)
    x = torch.randn(64, 32)
    g = torch.randn(64, 32)
    g[0] *= 1e3                    # one token's gradient large, the others 1e10 times smaller
    g[1:] *= 1e-7
    (ten,) = measure_layers(lin, [((x,), {}, g)], recipe="tensorwise", loss_fn=_times_target, dtypes=("float8",))
    (row,) = measure_layers(lin, [((x,), {}, g)], recipe="rowwise", loss_fn=_times_target, dtypes=("float8",))
    go = ten.stats["grad_output"]
    assert go["dynamic_range_bits"] > E5M2_RANGE_BITS
    assert go["flushed_share"] > 0.9
    # Per row along N (rowwise's grad_input GEMM) each token has its own scale; along M it flushes again.
    assert row.stats["grad_output"]["flushed_share"] == 0
    assert row.stats["grad_output_for_grad_weight"]["flushed_share"] > 0.9
    # SQNR weighs by energy: the one large token's gradient is all it sees, so it stays at float8's usual level
    # although 98% of the values became 0. The flushed share is what tells.
    assert _sqnr(ten, "grad_input") > 20


def test_bf16_error_is_its_unit_roundoff():
    lin = _linear(64, 96)
    x = torch.randn(4, 32, 64)
    (m,) = measure_layers(lin, [((x,), {})])
    for role in ("output", "grad_input", "grad_weight"):
        rel = m.metrics["bfloat16"][role]["rel_l2"]
        assert BF16_U / 10 < rel < 2 * BF16_U, role
        assert _sqnr(m, role, "bfloat16") > _sqnr(m, role, "float8") + 15
        assert m.metrics["float16"][role]["rel_l2"] < rel / 4        # 3 more mantissa bits


def test_model_is_left_as_it_was():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(inplace=True), nn.Dropout(0.2),
                          nn.Linear(32, 8))
    model[4].weight.requires_grad_(False)
    model[0].weight.grad = torch.randn(32, 16)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    grads = {n: (p.grad, None if p.grad is None else p.grad.clone()) for n, p in model.named_parameters()}
    batches = [((torch.randn(24, 16),), {}) for _ in range(2)]
    rng = torch.get_rng_state()                               # Dropout draws: the caller's stream must not move
    measures = measure_layers(model, batches, recipe="rowwise")
    assert [m.module for m in measures] == ["0", "4"]
    assert all(set(m.metrics["float8"]) == {"output", "grad_input", "grad_weight"} for m in measures)
    assert model.training and model[1].training
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]), k                     # BatchNorm's running stats too
    for n, p in model.named_parameters():
        before, values = grads[n]
        assert p.grad is before and (values is None or torch.equal(p.grad, values)), n
    assert not model[4].weight.requires_grad
    assert torch.equal(torch.get_rng_state(), rng)
    assert not any(m._forward_hooks for m in model.modules())


def test_worst_batch_is_kept_and_nonfinite_is_reported():
    lin = _linear(16, 16)
    calm, hot = torch.randn(8, 16), torch.randn(8, 16) * 1e5     # fp16 overflows on the second
    (a,) = measure_layers(lin, [((calm,), {})], dtypes=("bfloat16", "float16"))
    (both,) = measure_layers(lin, [((calm,), {}), ((hot,), {})], dtypes=("bfloat16", "float16"))
    assert both.metrics["float16"]["output"] == {"sqnr_db": -math.inf, "rel_l2": math.inf, "row_sqnr_db": -math.inf}
    assert both.metrics["bfloat16"]["output"]["sqnr_db"] <= a.metrics["bfloat16"]["output"]["sqnr_db"]
    assert both.stats == {}                                      # float8 not measured
    data = json.loads(json.dumps(both.to_dict(), allow_nan=False))
    assert data["metrics"]["float16"]["output"] == {"sqnr_db": "-inf", "rel_l2": "inf", "row_sqnr_db": "-inf"}


def test_modules_selects_and_unknown_names_say_which():
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
    (m,) = measure_layers(model, [((torch.randn(4, 8),), {})], modules=["2"], dtypes=("bfloat16",))
    assert m.module == "2" and set(m.metrics) == {"bfloat16"}
    with pytest.raises(UsageError, match="'fc'") as err:
        measure_layers(model, [((torch.randn(4, 8),), {})], modules=["fc"])
    assert "0, 2" in err.value.hint


def test_meta_model_and_model_without_linear_are_usage_errors():
    with torch.device("meta"):
        meta = nn.Linear(8, 8)
    with pytest.raises(UsageError, match="meta device"):
        measure_layers(meta, [((torch.randn(2, 8),), {})])
    with pytest.raises(UsageError, match="no nn.Linear") as err:
        measure_layers(nn.Sequential(nn.Conv1d(2, 2, 3)), [((torch.randn(1, 2, 8),), {})])
    assert "\n" not in err.value.one_line() and err.value.hint


def test_missing_torchao_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    with pytest.raises(UsageError) as err:
        fp8.import_torchao()
    assert "fp8" in err.value.one_line() and "\n" not in err.value.one_line()


def test_import_chatter_is_dropped_and_nothing_else(caplog):
    with caplog.at_level(logging.WARNING):
        with fp8._import_chatter_dropped():
            logging.getLogger("torchao").warning("Failed to load /x/_C_mxfp8.so: nope")
            logging.getLogger("torch.utils._pytree").warning(
                "<enum 'K'> is an Enum subclass and is now natively supported by torch.compile ...")
            logging.getLogger("torchao").warning("something else")
        logging.getLogger("torchao").warning("Failed to load after the import")
    assert [r.getMessage() for r in caplog.records] == ["something else", "Failed to load after the import"]


def test_cast_stats_counts():
    t = torch.tensor([[448.0, 1.0, 0.0, 2.0 ** -12]])
    s = fp8.cast_stats(t, dtype=torch.float8_e4m3fn, granularity="tensorwise")
    # scale 1: 2**-12 is below half e4m3's smallest subnormal (2**-9) and flushes; nothing saturates.
    assert s == {"amax": 448.0, "scale": 1.0, "flushed_share": 1 / 3, "clipped_share": 0.0,
                 "dynamic_range_bits": math.log2(448 * 2 ** 12), "subnormal_share": 0.0}
    s = fp8.cast_stats(torch.tensor([[448.0, 2.0 ** -8]]), dtype=torch.float8_e4m3fn, granularity="tensorwise")
    assert s["subnormal_share"] == 0.5 and s["flushed_share"] == 0


def test_median_row_sqnr_sees_what_energy_weighting_hides():
    from ampaudit.planning.measure import error_metrics

    ref = torch.ones(100, 8)
    ref[0] *= 1e4                                   # one massive row
    got = ref.clone()
    got[1:] += 0.1                                  # every other row 10% off: 20 dB
    m = error_metrics(ref, got)
    assert m["sqnr_db"] > 50 and abs(m["row_sqnr_db"] - 20.0) < 0.01


def test_plan_takes_train_data_items_as_they_are():
    import ampaudit

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 32))
    x, y = torch.randn(32, 64), torch.randn(32, 32)
    loss = nn.functional.mse_loss
    raw = ampaudit.plan(copy.deepcopy(model), [(x, y)], loss_fn=loss, speed_model="off")     # train_data()'s item
    explicit = ampaudit.plan(copy.deepcopy(model), [((x,), {}, y)], loss_fn=loss, speed_model="off")
    assert raw.to_dict()["layers"] == explicit.to_dict()["layers"]
