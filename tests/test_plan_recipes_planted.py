"""`ampaudit plan --recipes` on planted models (tests/planted_recipes, and tests/planted_fp8's massive activations):
each planted layer gets the recipe its data allows, per GEMM where it must, and the plan says why the others lost."""
from __future__ import annotations

import functools
from pathlib import Path

import pytest
from conftest import ROOT, load_module

import ampaudit
from ampaudit.errors import UsageError
from ampaudit.precision import fp8, recipes

try:
    fp8.import_torchao()
except UsageError:
    pytest.skip("torchao is not installed (the fp8 extra)", allow_module_level=True)

OWN = ROOT / "tests" / "planted_recipes"
FILES = sorted(OWN.glob("*.py"))
MASSIVE = ROOT / "tests" / "planted_fp8" / "massive_activations.py"


@functools.cache
def _plan(path: Path, names: str):
    m = load_module(path)
    batches = [((x,), {}, y) for x, y in list(m.train_data())[:1]]
    plan = ampaudit.plan(m.build_model(), batches, recipes=names, loss_fn=m.loss_fn, speed_model="off")
    return {layer.module: layer for layer in plan.layers}


def test_there_is_a_planted_model_for_each_recipe_kind():
    wanted = {load_module(p).EXPECT["choice"] for p in FILES}
    assert {"mxfp8", "float8_rowwise_with_gw_hp", "bfloat16"} <= wanted


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_the_planted_layer_gets_its_recipe(path):
    m = load_module(path)
    expect = m.EXPECT
    assert m.__doc__ and "arXiv" in m.__doc__                     # each cites its published mechanism
    layers = _plan(path, expect["recipes"])
    layer = layers[expect["layer"]]
    assert layer.choice == expect["choice"] and layer.gemms == expect["gemms"], layer.reasons
    assert expect["choice"] in recipes.choices()
    for lost in expect["fails"]:
        why = next(r for r in layer.reasons if r.startswith(f"{lost}:"))
        assert "dB budget" in why or "flush to 0" in why, why
    for name in expect["others"]:
        assert layers[name].choice in recipes.recipe_names(), (name, layers[name].reasons)


def test_mxfp8_keeps_forward_and_dgrad_and_runs_the_weight_gradient_in_bf16():
    path = OWN / "qk_norm_token_spread.py"
    expect = load_module(path).EXPECT_MX
    layer = _plan(path, expect["recipes"])["q_proj"]
    assert layer.choice == expect["choice"] and layer.gemms == expect["gemms"], layer.reasons
    assert "wgrad_with_hp" in layer.reasons[0]
    assert any(r.startswith("mxfp8: grad weight") for r in layer.reasons)     # why its wgrad is not mxfp8
    d = layer.to_dict()
    assert d["gemms"] == expect["gemms"] and d["choice"] == "mxfp8"


def test_massive_activation_rows_need_rowwise_scales():
    layers = _plan(MASSIVE, "tensorwise,rowwise")
    probe = layers["probe"]
    assert probe.choice == "float8_rowwise", probe.reasons
    assert any(r.startswith("float8_tensorwise:") and "dB budget" in r for r in probe.reasons)


def test_each_layer_is_checked_alone_in_its_recipe_inside_the_model():
    layers = _plan(OWN / "per_block_gamma.py", "tensorwise,rowwise,mxfp8")
    for layer in layers.values():
        grads = layer.metrics[layer.choice]["model_grads"]
        assert grads["sqnr_db"] > 15 and grads["noise"] > 0
