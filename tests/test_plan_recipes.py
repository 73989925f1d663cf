"""`ampaudit plan --recipes`: recipes measured with torchao's quantizers, budgets per format, the choice per layer and
per GEMM, the speed adapter, version-1 plans read as version 2, and the CLI flags."""
from __future__ import annotations

import json

import pytest
import torch
from conftest import ROOT
from torch import nn

import ampaudit
from ampaudit.errors import InputError, UsageError
from ampaudit.planning import api, emulate
from ampaudit.precision import fp8, recipes
from ampaudit.planning.choose import Budget
from ampaudit.planning.measure import LayerMeasure, _detached_linear, _run, error_metrics, measure_layers
from ampaudit.planning.pick import pick_layer

try:
    fp8.import_torchao()
except UsageError:
    pytest.skip("torchao is not installed (the fp8 extra)", allow_module_level=True)

BUDGET = Budget(20.0, 15.0)


def _lin(k=64, n=64):
    torch.manual_seed(0)
    return nn.Linear(k, n)


def test_mxfp8_numbers_are_torchaos_training_op():
    from torchao.prototype.moe_training.mxfp8_linear import _to_mxfp8_then_scaled_mm
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

    lin, x, g = _lin(), torch.randn(64, 64), torch.randn(64, 64)
    (m,) = measure_layers(lin, [((x,), {}, g)], loss_fn=lambda out, t: (out * t).sum(), dtypes=("mxfp8",))
    xr = x.clone().requires_grad_(True)
    w = lin.weight.detach().clone().requires_grad_(True)
    y = _to_mxfp8_then_scaled_mm(xr, w, KernelPreference.EMULATED, ScaleCalculationMode.RCEIL) + lin.bias
    gi, gw = torch.autograd.grad(y, (xr, w), g)
    ref = _run(_detached_linear(lin), x, g)
    assert m.metrics["mxfp8"]["output"] == error_metrics(ref["output"], y)
    assert m.metrics["mxfp8"]["grad_weight"] == error_metrics(ref["grad_weight"], gw)
    stats = m.metrics["mxfp8"]["stats"]
    assert {"input", "weight", "grad_output", "input_for_grad_weight"} <= set(stats)
    assert stats["input"]["scale_range_bits"] >= 0 and stats["input"]["flushed_share"] == 0.0


def test_nvfp4_flushes_what_e2m1_cannot_hold_inside_a_block():
    r = recipes.recipe("nvfp4")
    t = torch.ones(4, 16)
    t[:, 0] = 100.0                 # each block's amax: the ones sit at 6/100 of e2m1's max, under its 0.25 midpoint
    stats = emulate.quant_stats(r, t, torch.randn(16, 16), None)["input"]
    assert stats["flushed_share"] == pytest.approx(15 / 16)


def test_blockwise_and_misfit_blocks_are_unsupported_with_the_reason():
    assert "Triton" in emulate.unsupported(recipes.recipe("blockwise"), tokens=128, k=128, n=128)
    assert emulate.unsupported(recipes.recipe("mxfp8"), tokens=64, k=48, n=64) == \
        "in_features 48 not a multiple of 32 (mxfp8 blocks)"
    lin = nn.Linear(48, 64)
    (m,) = measure_layers(lin, [((torch.randn(64, 48),), {})], dtypes=("mxfp8", "bfloat16"))
    assert "mxfp8" not in m.metrics and "multiple of 32" in m.unsupported["mxfp8"]
    with pytest.raises(UsageError, match="Triton"):
        ampaudit.plan(lin, [((torch.randn(64, 48),), {})], recipes="blockwise", speed_model="off")


def test_budgets_are_per_format_from_recipes_toml():
    assert recipes.budget("nvfp4") == (12.0, 10.0)
    assert recipes.budget("rowwise") is None                  # settings.toml [plan] applies
    plan = ampaudit.plan(nn.Sequential(_lin()), [((torch.randn(64, 64),), {})], recipes="rowwise,nvfp4",
                         speed_model="off")
    assert plan.to_dict()["budgets"] == {"float8_rowwise": {"forward_db": 20.0, "backward_db": 15.0},
                                         "nvfp4": {"forward_db": 12.0, "backward_db": 10.0}}


def _measured(**sqnr) -> LayerMeasure:
    m = LayerMeasure("fc", 64, 64, tokens=256)
    for name, (o, gi, gw) in sqnr.items():
        m.metrics[name] = {role: {"sqnr_db": v, "rel_l2": 10 ** (-v / 20)}
                           for role, v in zip(("output", "grad_input", "grad_weight"), (o, gi, gw))}
    return m


def test_fastest_within_budget_wins_and_the_others_say_why():
    m = _measured(float8_tensorwise=(12.0, 25.0, 25.0), float8_rowwise=(28.0, 28.0, 28.0),
                  mxfp8=(29.0, 29.0, 29.0), bfloat16=(50.0, 50.0, 50.0))
    speeds = {"float8_tensorwise": {"speedup": 1.5, "bound": "compute"},
              "float8_rowwise": {"speedup": 1.3, "bound": "compute"}, "mxfp8": {"speedup": 1.2, "bound": "compute"}}
    layer = pick_layer(m, ["float8_tensorwise", "float8_rowwise", "mxfp8"], budget=BUDGET, speeds=speeds)
    assert layer.choice == "float8_rowwise" and "1.30x faster" in layer.reasons[0]
    assert any(r.startswith("float8_tensorwise: output SQNR 12.0 dB < 20 dB budget") for r in layer.reasons)
    assert any(r.startswith("mxfp8: within budget too") for r in layer.reasons)


def test_a_recipe_the_speed_model_does_not_know_goes_by_accuracy_and_says_so():
    m = _measured(float8_rowwise=(24.0, 24.0, 24.0), nvfp4=(17.0, 17.0, 17.0), bfloat16=(50.0, 50.0, 50.0))
    layer = pick_layer(m, ["float8_rowwise", "nvfp4"], budget=BUDGET,
                       speeds={"float8_rowwise": {"speedup": 1.2, "bound": "compute"}, "nvfp4": None})
    assert layer.choice == "nvfp4"            # 7 dB over its 10 dB budget against rowwise's 4 dB
    assert "accuracy alone (the speed model has no numbers for nvfp4)" in layer.reasons[0]


def test_mxfp8_wgrad_in_bf16_when_only_its_wgrad_fails():
    m = _measured(mxfp8=(29.0, 28.0, 6.0), bfloat16=(50.0, 50.0, 48.0))
    layer = pick_layer(m, ["mxfp8"], budget=BUDGET)
    assert layer.choice == "mxfp8" and layer.gemms == {"output": "mxfp8", "grad_input": "mxfp8",
                                                       "grad_weight": "bfloat16"}
    assert layer.to_dict()["gemms"]["grad_weight"] == "bfloat16"
    nv = pick_layer(_measured(nvfp4=(17.0, 17.0, 6.0), bfloat16=(50.0, 50.0, 48.0)), ["nvfp4"], budget=BUDGET)
    assert nv.choice == "bfloat16" and nv.gemms is None      # torchao's NVFP4 training has no such option


def test_speed_adapter_returns_none_for_an_unknown_recipe_and_raises_for_an_unknown_gpu():
    assert api.recipe_speed(4096, 4096, 4096, "h100", "float8_rowwise")["speedup"] > 1
    from ampaudit.planning.speed import RECIPES as KNOWN

    if "nvfp4" not in KNOWN:
        assert api.recipe_speed(4096, 4096, 4096, "b200", "nvfp4") is None
    with pytest.raises(UsageError, match="gpu"):
        api.recipe_speed(4096, 4096, 4096, "tpu", "float8_rowwise")


def test_a_recipe_the_target_gpu_cannot_run_natively_is_measured_but_never_chosen_for_it():
    why = "h100 has no native mxfp8 kernels (compute capability 9.0 < 10.0)"
    m = _measured(float8_rowwise=(24.0, 24.0, 24.0), mxfp8=(29.0, 29.0, 29.0), bfloat16=(50.0, 50.0, 50.0))
    layer = pick_layer(m, ["float8_rowwise", "mxfp8"], budget=BUDGET, not_native={"mxfp8": why},
                       speeds={"float8_rowwise": {"speedup": 1.2, "bound": "compute"}})
    assert layer.choice == "float8_rowwise" and f"mxfp8: {why}" in layer.reasons
    assert "mxfp8" in layer.metrics
    with pytest.raises(UsageError, match="no native mxfp8 kernels"):
        api.recipe_speed(4096, 4096, 4096, "h100", "mxfp8")
    assert api.not_native_recipes(("float8_rowwise", "mxfp8", "nvfp4"), "h100") == {
        "mxfp8": why, "nvfp4": "h100 has no native nvfp4 kernels (compute capability 9.0 < 10.0)"}
    assert api.not_native_recipes(("mxfp8",), "off") == {} and api.not_native_recipes(("mxfp8",), "b200") == {}
    # the whole plan: mxfp8 alone on an H100 keeps the layer bf16, and says why; off chooses by accuracy
    batches = [((torch.randn(64, 64),), {})]
    h100 = ampaudit.plan(nn.Sequential(_lin()), batches, recipes="mxfp8", speed_model="h100").to_dict()
    (got,) = h100["layers"]
    assert got["choice"] == "bfloat16" and f"mxfp8: {why}" in got["reasons"]
    assert got["metrics"]["mxfp8"]["output"]["sqnr_db"] > 20
    assert any("h100 has no native kernels for mxfp8: measured, never chosen" in n for n in h100["notes"])
    off = ampaudit.plan(nn.Sequential(_lin()), batches, recipes="mxfp8", speed_model="off").to_dict()
    assert off["layers"][0]["choice"] == "mxfp8"


def test_speed_model_help_lists_every_fp8_gpu_of_gpus_toml():
    from typer.testing import CliRunner

    import ampaudit.cli.commands  # noqa: F401  registers the commands
    from ampaudit.cli.app import app
    from ampaudit.planning.speed import float8_gpus, load_gpus

    assert "h100_meta" in float8_gpus() and "a100" in load_gpus() and "a100" not in float8_gpus()
    out = CliRunner().invoke(app, ["plan", "--help"], env={"COLUMNS": "400"}).output
    assert ", ".join(float8_gpus()) + ", or off" in " ".join(out.split())


def test_default_recipes_follow_the_speed_model_gpu():
    assert api.default_recipes("h100") == ("float8_tensorwise", "float8_rowwise", "float8_rowwise_with_gw_hp")
    assert {"mxfp8", "nvfp4"} <= set(api.default_recipes("b200")) and "blockwise" not in api.default_recipes("b200")


def test_a_version_1_plan_reads_as_version_2():
    v1 = {"version": 1, "recipe": "rowwise", "layers": [
        {"module": "a", "choice": "float8", "metrics": {"float8": {"output": {"sqnr_db": 28.0}}}},
        {"module": "b", "choice": "float32"}]}
    v2 = recipes.normalise_plan(v1)
    assert v2["version"] == 2 and v2["recipes"] == ["float8_rowwise"]
    assert [la["choice"] for la in v2["layers"]] == ["float8_rowwise", "float32"]
    assert v2["layers"][0]["metrics"] == {"float8_rowwise": {"output": {"sqnr_db": 28.0}}}
    assert v1["layers"][0]["choice"] == "float8"                          # the caller's dict is untouched
    assert recipes.normalise_plan({"version": 1, "layers": [{"choice": "float8"}]})["layers"][0]["choice"] == \
        "float8_tensorwise"
    assert recipes.normalise_plan(v2) == v2
    with pytest.raises(InputError, match="version 1 or 2"):
        recipes.normalise_plan({"version": 3, "layers": []})


def test_every_plan_reader_reads_through_the_one_normaliser(tmp_path):
    from ampaudit.planning import apply

    v1 = {"version": 1, "recipe": "rowwise", "layers": [{"module": "a", "choice": "float8"}]}
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(v1))
    # train --plan (load_plan), apply_plan and the fallback's rewrite all read a plan as the writer's version
    assert apply.load_plan(path) == recipes.normalise_plan(v1)
    assert apply.load_plan(path)["version"] == api.PLAN_VERSION == recipes.PLAN_VERSION
    assert apply.load_plan(path)["recipe"] == "float8_rowwise"
    path.write_text(json.dumps({**v1, "recipe": "rowwize"}))
    with pytest.raises(InputError, match="plan recipe 'rowwize' is unknown"):
        apply.load_plan(path)


def test_cli_recipes_flag(tmp_path):
    from typer.testing import CliRunner

    import ampaudit.cli.commands  # noqa: F401  registers the commands
    from ampaudit.cli.app import app

    runner = CliRunner()
    sample = ROOT / "samples" / "clean_mlp.py"
    r = runner.invoke(app, ["plan", str(sample), "--recipes", "rowwise,nvfp4", "--speed-model", "off", "-f", "json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["version"] == 2 and data["recipes"] == ["float8_rowwise", "nvfp4"]
    assert all(la["choice"] in recipes.choices() for la in data["layers"])
    assert all({"float8_rowwise", "nvfp4", "bfloat16", "float16"} <= set(la["metrics"]) for la in data["layers"])
    r = runner.invoke(app, ["plan", str(sample), "--recipes", "fp4"])
    assert r.exit_code == 2 and "unknown recipe 'fp4'" in r.output
    r = runner.invoke(app, ["plan", str(sample), "--recipes", "rowwise", "--recipe", "tensorwise"])
    assert r.exit_code == 2 and "--recipes and --recipe" in r.output


@pytest.mark.parametrize("width", [80, 100, 116, 140])
def test_plan_table_wraps_long_recipe_names_instead_of_cutting_them(width, monkeypatch):
    import io

    from rich.console import Console

    from ampaudit.planning.report import render_plan

    plan = ampaudit.plan(nn.Sequential(_lin()), [((torch.randn(64, 64),), {})], recipes="rowwise_with_gw_hp",
                         speed_model="off")
    monkeypatch.setenv("COLUMNS", str(width))
    buf = io.StringIO()
    render_plan(plan, Console(file=buf, color_system=None))
    text = buf.getvalue()
    assert max(len(line) for line in text.splitlines()) <= width
    assert "…" not in text and "within budget" in text
    # every character of the reason is on screen: only spaces and line breaks were added
    lines = text.splitlines()
    header = next((i for i, line in enumerate(lines) if line.rstrip().endswith(" why")), None)
    if header is None:                      # narrow: the reasons are printed under the table
        shown = text
    else:                                   # the why column alone, its lines in order
        col = lines[header].rindex(" why") + 1
        shown = "".join(line[col:] for line in lines[header + 2:] if line.strip())
    assert "".join(plan.layers[0].reasons[0].split()) in "".join(shown.split())
