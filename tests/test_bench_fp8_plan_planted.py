"""bench/fp8_plan_planted.py --quick: per recipe, the plan restricted to it, every Linear in it and bf16 train the
planted models; the plan keeps the broken layer out where the recipe breaks it, and the planted weights stay fixed."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchao")

BENCH = Path(__file__).resolve().parent.parent / "bench"


def load():
    spec = importlib.util.spec_from_file_location("_ampaudit_bench_fp8_plan_planted", BENCH / "fp8_plan_planted.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_quick_run_trains_every_variant_per_recipe_and_writes_json(tmp_path, capsys):
    out = tmp_path / "planted.json"
    assert load().main(["--quick", "--models", "per_block_gamma", "--recipes", "tensorwise,mxfp8",
                        "--json", str(out)]) == 0
    assert "emulated on CPU" in capsys.readouterr().out
    model = json.loads(out.read_text())["models"]["per_block_gamma"]
    assert set(model["recipes"]) == {"float8_tensorwise", "mxfp8"} and model["linears"] == 2
    tensorwise, mx = model["recipes"]["float8_tensorwise"], model["recipes"]["mxfp8"]
    assert tensorwise["plan"]["kept"] == {"proj": "bfloat16"} and tensorwise["plan"]["in_recipe"] == 1
    assert tensorwise["all"]["in_recipe"] == 2 and mx["plan"]["in_recipe"] == 2 and mx["plan"]["kept"] == {}
    for row in (tensorwise["plan"], tensorwise["all"], mx["plan"], model["bf16"]):
        assert len(row["final"]) == 1 and row["spread"] == 0.0 and row["mean"] > 0
    assert model["bf16"]["paired"] == [0.0]
    # different variants are different runs: float8 everywhere does not train the bf16 run
    assert tensorwise["all"]["final"] != model["bf16"]["final"]


def test_seeds_change_the_init_and_fixed_entries_keep_their_planted_values():
    bench = load()
    mod = bench.load_module_file(bench.planted_files()["massive_activations"])
    a, b = bench.build(mod, 0), bench.build(mod, 1)
    assert not torch.equal(a.block.up.weight, b.block.up.weight)
    assert torch.equal(bench.build(mod, 0).block.up.weight, a.block.up.weight)
    before = a.probe.weight.detach().clone()
    bench.train(mod, a, bench.batches_of(mod, 0), 0, 2)
    cols = list(mod.MASSIVE_DIMS)
    assert torch.equal(a.probe.weight[:, cols], before[:, cols])              # fixed as planted
    assert not torch.equal(a.probe.weight, before)                             # the rest trains
    torch.manual_seed(7)
    assert torch.initial_seed() == 7                                           # the seed patch is undone


def test_an_unknown_model_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        load().main(["--quick", "--models", "nope"])
    assert exc.value.code == 2 and "unknown planted model(s) nope" in capsys.readouterr().err
