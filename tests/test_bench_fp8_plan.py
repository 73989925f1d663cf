"""bench/fp8_plan.py --quick: the three variants train side by side on the three models and the table prints."""
from __future__ import annotations

import pytest
import importlib.util
import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench"


def load():
    spec = importlib.util.spec_from_file_location("_ampaudit_bench_fp8_plan", BENCH / "fp8_plan.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow     # trains the bench models: ~5 s
def test_quick_run_prints_the_table_and_writes_json(tmp_path, capsys):
    out = tmp_path / "fp8.json"
    assert load().main(["--quick", "--steps", "6", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "emulated on CPU" in text
    assert "including head 64->58" in text          # fp8-all takes the misaligned head too
    data = json.loads(out.read_text())
    assert set(data["models"]) == {"sample transformer", "Llama-style", "massive-activation GPT"}
    for model in data["models"].values():
        assert set(model["rows"]) == {"bf16", "fp8-all", "plan"}
        assert model["rows"]["bf16"]["ratio"] == 1.0
        assert all(len(r["losses"]) == 6 for runs in model["runs"].values() for r in runs)
    char = data["models"]["sample transformer"]
    assert {layer["module"] for layer in char["plan"]["layers"] if layer["choice"] in ("bfloat16", "float32")} == {"head"}
    outlier = data["models"]["massive-activation GPT"]
    kept_out = {layer["module"] for layer in outlier["plan"]["layers"] if layer["choice"] in ("bfloat16", "float32")}
    assert kept_out == {"blocks.0.mlp.proj", "blocks.1.mlp.proj"}      # the two Linears that read the outlier
