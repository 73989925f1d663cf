"""ampaudit plan end to end: the JSON contract, the table, a plan applied to training, and bad input."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("torchao")

import ampaudit  # noqa: E402
from ampaudit.errors import InputError, UsageError  # noqa: E402
from ampaudit.planning.apply import apply_plan, load_plan  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "samples" / "char_transformer.py"


def _cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "ampaudit", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, timeout=300)


class MLP(nn.Module):
    def __init__(self, width=64):
        super().__init__()
        self.up, self.down, self.head = nn.Linear(32, width), nn.Linear(width, 32), nn.Linear(32, 10)

    def forward(self, x):
        return self.head(torch.relu(self.down(torch.relu(self.up(x)))))


def _batches(n=2):
    g = torch.Generator().manual_seed(0)
    return [((torch.randn(64, 32, generator=g),), {}, torch.randint(0, 10, (64,), generator=g)) for _ in range(n)]


def test_plan_api_follows_the_contract():
    plan = ampaudit.plan(MLP(), _batches(), loss_fn=nn.functional.cross_entropy, speed_model="off",
                         recipes="tensorwise")
    d = plan.to_dict()
    assert d["version"] == 2 and d["recipes"] == ["float8_tensorwise"]
    assert [layer["module"] for layer in d["layers"]] == ["up", "down", "head"]
    assert d["summary"]["layers"] == 3
    assert d["summary"]["low_precision"] + d["summary"]["bfloat16"] + d["summary"]["float32"] == 3
    head = d["layers"][2]
    assert head["choice"] == "bfloat16" and "out_features 10 not a multiple of 16" in head["reasons"][0]
    assert {"float8_tensorwise", "bfloat16", "float16"} <= set(head["metrics"])
    json.dumps(d, allow_nan=False)              # strict JSON: inf/nan written as strings


def test_speed_model_keeps_tiny_layers_in_bf16_and_says_so():
    plan = ampaudit.plan(MLP(), _batches(1), speed_model="h100")
    up = plan.layers[0]
    assert up.choice == "bfloat16" and up.speedup is None
    assert plan.recipes == ("float8_tensorwise", "float8_rowwise", "float8_rowwise_with_gw_hp")   # H100's own
    assert all("slower than bf16" in r for r in up.reasons) and len(up.reasons) == 3


def test_recipe_auto_names_what_it_compared():
    plan = ampaudit.plan(MLP(), _batches(1), recipe="auto", speed_model="off")
    assert plan.recipes == ("float8_tensorwise", "float8_rowwise")      # version 1's auto: both, per layer
    assert all({"float8_tensorwise", "float8_rowwise"} <= set(layer.metrics) for layer in plan.layers)


def test_plan_applied_changes_only_the_chosen_layers():
    from torchao.float8.float8_linear import Float8Linear

    model = MLP()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    plan = {"version": 1, "recipe": "tensorwise", "layers": [
        {"module": "up", "choice": "float8", "shape": {"in_features": 32, "out_features": 64}},
        {"module": "down", "choice": "bfloat16", "shape": {"in_features": 64, "out_features": 32}},
        {"module": "head", "choice": "float32", "shape": {"in_features": 32, "out_features": 10}}]}
    chosen = apply_plan(model, plan)
    assert chosen == {"float8": ["up"], "float32": ["head"]}
    assert isinstance(model.up, Float8Linear)
    assert type(model.down) is nn.Linear
    assert not isinstance(model.head, Float8Linear) and type(model.head) is not nn.Linear   # keep_fp32's subclass
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())           # same weights, keys
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(torch.randn(8, 32))
    assert out.dtype == torch.float32                   # the fp32 head's output
    out.sum().backward()
    assert model.up.weight.grad is not None


def test_a_plan_for_another_model_is_refused():
    plan = {"version": 1, "layers": [{"module": "up", "choice": "float8",
                                      "shape": {"in_features": 32, "out_features": 128}}]}
    with pytest.raises(InputError, match="the model's is 32->64"):
        apply_plan(MLP(), plan)
    with pytest.raises(InputError, match="no Linear"):
        apply_plan(MLP(), {"version": 1, "layers": [{"module": "mlp.fc", "choice": "float8", "shape": {}}]})


def test_load_plan_names_the_problem(tmp_path):
    with pytest.raises(InputError, match="plan file not found"):
        load_plan(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"version": 7}')
    with pytest.raises(InputError, match="not an ampaudit plan"):
        load_plan(bad)


def test_bad_arguments_are_usage_errors():
    with pytest.raises(UsageError, match="unknown recipe"):
        ampaudit.plan(MLP(), _batches(1), recipe="blockwise")
    with pytest.raises(UsageError, match="no float8 Tensor Cores"):
        ampaudit.plan(MLP(), _batches(1), speed_model="a100")
    with pytest.raises(UsageError, match="needs an nn.Module"):
        ampaudit.plan("model.py", _batches(1))


def test_without_torchao_the_error_names_the_extra(monkeypatch):
    from ampaudit.precision import fp8

    monkeypatch.setitem(sys.modules, "torchao", None)
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    with pytest.raises(UsageError) as info:
        fp8.import_torchao()
    assert "torchao" in info.value.one_line() and "ampaudit[fp8]" in info.value.one_line()


@pytest.mark.slow
def test_cli_plan_json_then_train_with_it(tmp_path):
    out = tmp_path / "plan.json"
    r = _cli("plan", SAMPLE, "--speed-model", "off", "--recipes", "tensorwise,mxfp8", "--format", "json", "-o", out,
             cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stderr.strip() == f"wrote {out}"            # nothing else: torchao's import is quiet
    plan = json.loads(out.read_text())
    assert plan["version"] == 2 and plan["summary"]["low_precision"] >= 1


@pytest.mark.slow
def test_cli_train_with_a_version_2_plan(tmp_path):
    out = tmp_path / "plan.json"
    r = _cli("plan", SAMPLE, "--speed-model", "off", "--recipes", "tensorwise", "-o", out, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    plan = json.loads(out.read_text())
    r = _cli("train", SAMPLE, "--steps", "2", "--plan", out, "--device", "cpu", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert f"plan: {plan['summary']['low_precision']} float8 layer(s)" in r.stderr
    assert "trained 2 steps" in r.stdout


@pytest.mark.slow
def test_cli_plan_table_and_errors(tmp_path):
    r = _cli("plan", SAMPLE, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "Linear layer(s):" in r.stdout and "torchao" in r.stdout
    r = _cli("plan", SAMPLE, "--dtype", "float16", cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.startswith("error: ampaudit plan plans float8 layers")
    r = _cli("train", SAMPLE, "--steps", "1", "--plan", tmp_path / "none.json", cwd=tmp_path)
    assert r.returncode == 2 and "plan file not found" in r.stderr


def test_a_gpu_without_fp8_tensor_cores_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    plan = {"version": 1, "layers": [{"module": "up", "choice": "float8",
                                      "shape": {"in_features": 32, "out_features": 64}}]}
    with pytest.raises(UsageError, match=r"A100-SXM4-80GB \(compute capability 8.0\) has no FP8 Tensor Cores"):
        apply_plan(MLP(), plan, device="cuda")


def test_a_layer_planned_as_padded_is_refused_on_cuda_until_padded(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    plan = {"version": 1, "layers": [{"module": "head", "choice": "float8", "padded": {"out_features": 16},
                                      "shape": {"in_features": 32, "out_features": 10}}]}
    with pytest.raises(UsageError, match="float8 only once padded"):
        apply_plan(MLP(), plan, device="cuda")
    assert apply_plan(MLP(), plan, device="cpu") == {"float8": ["head"], "float32": []}   # the emulation runs it


def test_planning_runs_on_one_thread_and_restores_the_callers_setting():
    before = torch.get_num_threads()
    seen = []

    def loss(out, target):
        seen.append(torch.get_num_threads())
        return nn.functional.cross_entropy(out, target)

    torch.set_num_threads(2)
    try:
        ampaudit.plan(MLP(), _batches(1), loss_fn=loss, speed_model="off")
        assert set(seen) == {1} and torch.get_num_threads() == 2
        seen.clear()
        ampaudit.plan(MLP(), _batches(1), loss_fn=loss, speed_model="off", threads=None)
        assert set(seen) == {2}

        def broken(out, target):
            raise RuntimeError("loss failed")

        with pytest.raises(RuntimeError, match="loss failed"):
            ampaudit.plan(MLP(), _batches(1), loss_fn=broken, speed_model="off")
        assert torch.get_num_threads() == 2                        # restored on error too
    finally:
        torch.set_num_threads(before)
