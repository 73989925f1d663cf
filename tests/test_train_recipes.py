"""``train --plan`` applies every recipe of rules/policy/recipes.toml through torchao (ampaudit/precision/convert.py):
float8 recipes with per-GEMM cast configs, MXFP8 equal to torchao's MX training config, NVFP4 emulated through
NVFP4Tensor and blockwise through torchao.float8's cast per tile (and said so); version-1 plans read as version 2;
bad shapes refused in one line; recipe statistics in the trace."""
from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn as nn
from typer.testing import CliRunner

pytest.importorskip("torchao")

import ampaudit.cli.commands  # noqa: E402,F401  registers the commands
from ampaudit.cli.app import app  # noqa: E402
from ampaudit.errors import InputError, TrainError, UsageError  # noqa: E402
from ampaudit.planning.apply import apply_plan, normalise_plan  # noqa: E402
from ampaudit.precision.convert import emulation_notes, recipe_of, recipes_of, set_recipe  # noqa: E402
from ampaudit.precision.nvfp4_emulated import nvfp4_qdq  # noqa: E402
from ampaudit.precision.recipes import format_budget  # noqa: E402
from ampaudit.runtime.recipe_stats import sqnr_db  # noqa: E402
from ampaudit.runtime.trace import read_trace  # noqa: E402

RECIPES = ("float8_tensorwise", "float8_rowwise", "float8_rowwise_with_gw_hp", "mxfp8", "nvfp4")


def _net(bias: bool = True) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128, bias=bias), nn.ReLU(), nn.Linear(128, 32, bias=bias))


def _run(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Output, d loss / d input and the first layer's weight gradient under bf16 autocast."""
    model.zero_grad()
    x = x.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = model(x)
    y.float().pow(2).sum().backward()
    return y.detach().float(), x.grad.detach(), model[0].weight.grad.detach().clone()


X = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("name", RECIPES)
def test_every_recipe_trains_within_its_budget_and_keeps_the_parameters(name):
    ref = _run(_net(), X)
    model = _net()
    weight = model[0].weight
    for layer in (model[0], model[2]):
        set_recipe(layer, name)
    assert model[0].weight is weight and list(model.state_dict()) == list(_net().state_dict())
    got = _run(model, X)
    out_db = sqnr_db(ref[0], got[0])
    # two layers compound: still within the one-layer budget of the recipe (its forward budget, recipes.toml)
    assert format_budget(name)[0] < out_db < 40, out_db
    assert all(sqnr_db(a, b) > format_budget(name)[0] / 2 for a, b in zip(ref[1:], got[1:]))
    assert recipe_of(model[0]) == {"choice": name, "gemms": {}}
    set_recipe(model[0], "bfloat16")
    assert type(model[0]) is nn.Linear and model[0].weight is weight


@pytest.mark.parametrize("wgrad_hp", [False, True])
def test_mxfp8_is_torchaos_mx_training_config(wgrad_hp):
    from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig
    from torchao.quantization import quantize_
    from torchao.quantization.quantize_.common import KernelPreference

    ours, theirs = _net(bias=False), _net(bias=False)
    for layer in (ours[0], ours[2]):
        set_recipe(layer, "mxfp8", {"grad_weight": "bfloat16"} if wgrad_hp else None)
    config = MXFP8TrainingOpConfig(kernel_preference=KernelPreference.EMULATED, wgrad_with_hp=wgrad_hp)
    quantize_(theirs, config, filter_fn=lambda mod, fqn: isinstance(mod, nn.Linear))
    for a, b in zip(_run(ours, X), _run(theirs, X)):
        assert torch.equal(a, b)


def test_mxfp8_keeps_the_bias_torchaos_weight_wrapper_drops():
    ours = _net()
    set_recipe(ours[0], "mxfp8")
    bare = copy.deepcopy(ours)
    with torch.no_grad():
        bare[0].bias.zero_()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        diff = (ours[0](X) - bare[0](X)).float()
    assert torch.allclose(diff, ours[0].bias.detach().bfloat16().float().expand_as(diff), atol=1e-2)


def test_a_gemm_kept_in_bf16_is_exact_in_that_gemm_alone():
    fp8, hp = _net(), _net()
    set_recipe(fp8[0], "float8_rowwise")
    set_recipe(hp[0], "float8_rowwise", {"grad_weight": "bfloat16"})
    assert hp[0].config.cast_config_input_for_grad_weight.scaling_type.value == "disabled"
    assert hp[0].config.cast_config_input.scaling_type.value == "dynamic"
    seen = {}

    def keep(mod, args, out):
        seen.update(x=args[0], out=out)
        out.retain_grad()
    hp[0].register_forward_hook(keep)
    low, high = _run(fp8, X), _run(hp, X)
    assert torch.equal(low[0], high[0])                                  # the same forward
    go, x = seen["out"].grad.reshape(-1, 128), seen["x"].reshape(-1, 64).bfloat16()
    assert torch.equal(high[2], (go.t() @ x).to(high[2].dtype))          # wgrad from the bf16 operands
    assert not torch.equal(low[2], high[2])
    assert recipe_of(hp[0]) == {"choice": "float8_rowwise", "gemms": {"grad_weight": "bfloat16"}}
    with pytest.raises(UsageError, match="mix recipes"):
        set_recipe(hp[0], "float8_tensorwise", {"grad_weight": "mxfp8"})
    with pytest.raises(UsageError, match="in float32 alone"):
        set_recipe(hp[0], "float8_tensorwise", {"grad_weight": "float32"})
    with pytest.raises(UsageError, match="mxfp8 keeps only grad_weight in high precision.*not grad_input"):
        set_recipe(hp[0], "mxfp8", {"grad_input": "bfloat16"})
    set_recipe(hp[0], "mxfp8", {"grad_weight": "bfloat16"})       # torchao's wgrad_with_hp
    assert recipe_of(hp[0]) == {"choice": "mxfp8", "gemms": {"grad_weight": "bfloat16"}}


def test_nvfp4_is_emulated_on_its_grid_and_says_so():
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(2)) * 3
    q = nvfp4_qdq(x)
    # per 16-block, every value is a signed e2m1 value (0, .5, 1, 1.5, 2, 3, 4, 6) times one block scale
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    for block in q.reshape(-1, 16):
        scale = block.abs().max() / 6
        ratio = (block.abs() / scale)
        assert torch.allclose(ratio, grid[(ratio[:, None] - grid).abs().argmin(1)], atol=1e-4)
    model = _net()
    assert apply_plan(model, _plan({"0": "nvfp4", "2": "mxfp8"})) == {"float8": [], "float32": []}
    assert {n: r["choice"] for n, r in recipes_of(model).items()} == {"0": "nvfp4", "2": "mxfp8"}
    notes = emulation_notes(model)
    assert len(notes) == 1 and "emulated here through torchao's NVFP4Tensor" in notes[0]


def _plan(choices: dict, version: int = 2, **extra) -> dict:
    shapes = {"0": (64, 128), "2": (128, 32)}
    return {"version": version, **extra, "layers": [
        {"module": m, "choice": c, "shape": {"in_features": shapes[m][0], "out_features": shapes[m][1]}}
        for m, c in choices.items()]}


def test_a_version_1_plan_reads_as_version_2():
    v1 = _plan({"0": "float8", "2": "bfloat16"}, version=1, recipe="rowwise")
    v2 = normalise_plan(v1)
    assert v2["version"] == 2 and [layer["choice"] for layer in v2["layers"]] == ["float8_rowwise", "bfloat16"]
    assert v1["layers"][0]["choice"] == "float8"          # a copy
    a, b = _net(), _net()
    apply_plan(a, v1)
    apply_plan(b, _plan({"0": "float8_rowwise", "2": "bfloat16"}))
    assert recipes_of(a) == recipes_of(b) and torch.equal(_run(a, X)[0], _run(b, X)[0])
    with pytest.raises(InputError, match="version 1 or 2"):
        normalise_plan({"version": 3, "layers": []})


def _e4m3_tiles(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """An independent reference: one scale (448 / amax) per rows x cols tile, torch's own e4m3 cast."""
    out = torch.empty_like(t)
    for i in range(0, t.shape[0], rows):
        for j in range(0, t.shape[1], cols):
            tile = t[i:i + rows, j:j + cols]
            scale = 448.0 / tile.abs().amax()
            out[i:i + rows, j:j + cols] = (tile * scale).to(torch.float8_e4m3fn).float() / scale
    return out


def test_blockwise_is_deepseeks_tiles_through_torchaos_float8_cast():
    from ampaudit.precision.blockwise_emulated import act_qdq, weight_qdq

    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 256, generator=g)
    x[0, 5] = 1e4                      # an outlier sets its own 1x128 tile's scale alone
    assert torch.allclose(act_qdq(x), _e4m3_tiles(x, 1, 128), rtol=1e-6, atol=0)
    w = torch.randn(256, 128, generator=g)
    w[3, 3] = 50.0
    assert torch.allclose(weight_qdq(w), _e4m3_tiles(w, 128, 128), rtol=1e-6, atol=0)
    torch.manual_seed(0)
    layer, ref = nn.Linear(128, 256), None
    xs = torch.randn(2, 64, 128, generator=g)
    ref = nn.functional.linear(xs, layer.weight, layer.bias).detach()
    model = nn.Sequential(layer)
    apply_plan(model, {"version": 2, "layers": [{"module": "0", "choice": "blockwise",
                                                 "shape": {"in_features": 128, "out_features": 256}}]})
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(xs)
    out.float().sum().backward()
    assert sqnr_db(ref, out) > format_budget("blockwise")[0] and layer.weight.grad is not None
    assert any(n.startswith("blockwise: ") and "emulated" in n for n in emulation_notes(model))
    with pytest.raises(TrainError, match="64 tokens per micro-batch"):
        layer(torch.randn(64, 128))


def test_bad_shapes_are_refused_in_one_line():
    with pytest.raises(UsageError, match="multiples of its 128-element blocks"):
        apply_plan(_net(), _plan({"0": "blockwise"}))
    with pytest.raises(UsageError, match="multiples of its 32-element blocks"):
        set_recipe(nn.Linear(40, 64), "mxfp8")
    layer = nn.Linear(64, 64)
    set_recipe(layer, "mxfp8")
    with pytest.raises(TrainError, match="20 tokens per micro-batch"):
        layer(torch.randn(20, 64))
    with pytest.raises(InputError, match="choice 'float4'"):
        apply_plan(_net(), _plan({"0": "float4"}))


def test_cli_trains_mx_recipes_and_records_their_statistics(tmp_path):
    from conftest import ASSETS

    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"version": 2, "layers": [
        {"module": "fc2", "choice": "nvfp4", "shape": {"in_features": 64, "out_features": 64}},
        {"module": "fc1", "choice": "float8_rowwise", "gemms": {"grad_weight": "bfloat16"},
         "shape": {"in_features": 16, "out_features": 64}}]}))
    trace = tmp_path / "run.jsonl"
    r = CliRunner().invoke(app, ["train", str(ASSETS / "train_mlp.py"), "--steps", "2", "--plan", str(plan),
                                 "--trace", str(trace), "--trace-every", "2"])
    assert r.exit_code == 0, r.output
    assert "plan: 1 float8 layer(s), 1 nvfp4, 0 float32, the rest bf16" in r.output
    assert "nvfp4: torchao's NVFP4TrainingConfig runs only on its Triton kernels" in r.output
    stats = [e for e in read_trace(trace)[0] if e["event"] == "recipe_stats"]
    assert [(e["step"], e["module"], e["recipe"]) for e in stats] == [
        (1, "fc1", "float8_rowwise"), (1, "fc2", "nvfp4"), (2, "fc1", "float8_rowwise"), (2, "fc2", "nvfp4")]
    assert stats[0]["gemms"] == {"grad_weight": "bfloat16"}
    for e in stats:
        assert e["sqnr_db"] > format_budget(e["recipe"])[0]
        assert set(e["input"]) == set(e["grad_output"]) == {"amax", "flushed_share", "amax_growth"}
    assert stats[0]["input"]["amax_growth"] == 1.0


class _Scaled(nn.Linear):
    """A user's Linear subclass with its own forward."""

    def forward(self, x):
        return super().forward(x) * 2


def test_a_bf16_layer_keeps_its_own_class_and_a_refused_one_is_untouched():
    layer = _Scaled(64, 64)
    set_recipe(layer, "bfloat16")
    assert type(layer) is _Scaled
    set_recipe(layer, "float8_rowwise")
    assert type(layer).__name__ == "Float8Linear"          # torchao's forward, as convert_to_float8_training does
    set_recipe(layer, "bfloat16")                          # a fallback's end: the user's class again
    assert type(layer) is _Scaled
    with pytest.raises(UsageError, match="multiples of its 128-element blocks"):
        set_recipe(layer, "blockwise")
    assert type(layer) is _Scaled and recipe_of(layer) == {"choice": "bfloat16", "gemms": {}}
