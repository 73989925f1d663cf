"""bench/llama_meta.py builds a traceable Llama on meta and a working one on CPU; check_scale runs end to end."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.fx

BENCH = Path(__file__).resolve().parent.parent / "bench"
SMALL = dict(layers=2, hidden=64, heads=4, kv_heads=2, ffn=160, vocab=100)


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"_ampaudit_bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


llama = load("llama_meta")


def test_meta_build_has_no_storage_and_traces():
    model = llama.build_llama(**SMALL)
    assert all(p.is_meta for p in model.parameters())
    graph_module = torch.fx.symbolic_trace(model)
    targets = {str(n.target) for n in graph_module.graph.nodes}
    assert any("scaled_dot_product_attention" in t for t in targets)
    assert any("rsqrt" in t for t in targets)
    out = graph_module(llama.example_input_ids(batch=2, seq=12, vocab=SMALL["vocab"]))
    assert out.is_meta and out.shape == (2, 12, SMALL["vocab"])


def test_default_shape_is_llama3_70b_on_meta():
    model = llama.build_llama()
    assert llama.parameter_count(model) == 70_553_706_496
    assert model.layers[0].attn.k_proj.weight.shape == (1024, 8192)
    assert model.layers[0].mlp.gate_proj.weight.shape == (28672, 8192)
    assert model.layers[0].input_norm.eps == 1e-5


def test_cpu_instance_gives_finite_causal_logits():
    model = llama.build_llama(**SMALL, device="cpu")
    ids = llama.example_input_ids(batch=2, seq=16, vocab=SMALL["vocab"], device="cpu")
    logits = model(ids)
    assert logits.shape == (2, 16, SMALL["vocab"]) and torch.isfinite(logits).all()
    changed = ids.clone()
    changed[:, -1] = (changed[:, -1] + 1) % SMALL["vocab"]
    # causal: a change to the last token leaves every earlier position's logits alone
    torch.testing.assert_close(model(changed)[:, :-1], logits[:, :-1])
    assert not torch.allclose(model(changed)[:, -1], logits[:, -1])
    torch.testing.assert_close(torch.fx.symbolic_trace(model)(ids), logits)


def test_bad_head_split_is_rejected():
    with pytest.raises(ValueError, match="heads"):
        llama.build_llama(layers=1, hidden=60, heads=8, kv_heads=2, ffn=32, vocab=10)


@pytest.mark.slow
def test_check_scale_runs_tiny_config(tmp_path):
    out = tmp_path / "scale.json"
    argv = [sys.executable, str(BENCH / "check_scale.py"), "--layers", "2", "--hidden", "64", "--heads", "4",
            "--kv-heads", "2", "--ffn", "160", "--vocab", "100", "--seq", "16", "--only", "trace",
            "--only", "check", "--json", str(out)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert "bare trace" in proc.stdout and "targets:" in proc.stdout, proc.stderr
    payload = json.loads(out.read_text())
    trace = payload["rows"]["trace"]
    assert trace["wall_s"] > 0 and trace["peak_rss_mib"] > 50 and trace["nodes"] > 20
    check = payload["rows"]["check"]
    assert "error" not in check and check["wall_s"] > 0, check
    # The exit code is the verdict on the targets (a tiny config on a busy machine may miss a time target).
    failed = any(t["verdict"] == "FAIL" for t in payload["targets"])
    assert proc.returncode == (1 if failed else 0), (payload["targets"], proc.stderr)
