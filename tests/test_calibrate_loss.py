"""Calibration's backward differentiates what training does: the model file's loss_fn on the first train_data()
batch by default, else a mean of the outputs (a mean loss's gradient size), and the report says which ran. A sum
of a 50257-wide head's logits would overflow fp16 gradients that training never sees (false AMP601); check
--calibrate and fix --calibrate pick their batches and loss in one place, so they agree."""
from __future__ import annotations

import json
import textwrap

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

import ampaudit
from ampaudit.analysis.calibrate import batch_loss, calibration_data
import ampaudit.cli.commands  # noqa: F401  registers the commands
from ampaudit.cli.app import app
from ampaudit.loading import load_target
from ampaudit.policy import Policy

from conftest import ASSETS, load_module

GPT = ASSETS / "calibration" / "tiny_gpt.py"
runner = CliRunner()


def _check_json(path, *extra):
    result = runner.invoke(app, ["check", str(path), "--calibrate", "-f", "json", "--fail-on", "never", *extra])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_default_calibrate_runs_the_file_loss_and_says_so():
    doc = _check_json(GPT)                          # default target: cuda float16, simulated
    assert not [f for f in doc["findings"] if f["rule"] in ("AMP601", "AMP602")], doc["findings"]
    label = "loss_fn(output, target) on train_data() batch 1"
    assert f"backward: {label}" in doc["notes"]
    assert doc["calibration"] == {"batches": 1, "origin": "train_data()", "backward": label}


def test_table_footer_names_the_loss():
    result = runner.invoke(app, ["check", str(GPT), "--calibrate", "--fail-on", "never"])
    assert result.exit_code == 0, result.output
    assert "backward: loss_fn(output, target) on train_data() batch 1" in " ".join(result.stdout.split())


def test_calibrate_batches_names_the_batches():
    doc = _check_json(GPT, "--calibrate-batches", "2")
    assert doc["calibration"]["backward"] == "loss_fn(output, target) on train_data() batches 1-2"


def test_without_loss_fn_the_backward_is_the_mean_of_the_outputs(tmp_path):
    path = tmp_path / "mlp.py"
    path.write_text(textwrap.dedent("""
        import torch, torch.nn as nn
        def build_model():
            torch.manual_seed(0); return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
        def example_inputs():
            return (torch.randn(4, 16),)
        def train_data():                       # batches, but no loss to take them through
            while True:
                yield torch.randn(4, 16), torch.randn(4, 8)
    """))
    doc = _check_json(path, "--device", "cpu", "--dtype", "bfloat16")
    assert doc["calibration"] == {"batches": 1, "origin": "the example inputs",
                                  "backward": "mean of the outputs (no loss_fn)"}
    assert "backward: mean of the outputs (no loss_fn)" in doc["notes"]


def test_the_mean_proxy_has_a_mean_loss_gradient():
    out = torch.randn(2, 8, 50, requires_grad=True)
    extra = torch.randn(3, requires_grad=True)
    (g_out, g_extra) = torch.autograd.grad(batch_loss(None, None)((out, extra)), [out, extra])
    assert torch.allclose(g_out, torch.full_like(out, 1 / out.numel()))
    assert torch.allclose(g_extra, torch.full_like(extra, 1 / 3))
    (g_sum,) = torch.autograd.grad(batch_loss(None, None, proxy="sum")(out), [out])
    assert torch.equal(g_sum, torch.ones_like(out))
    assert batch_loss(None, None)(out[:0]) is None                  # nothing to differentiate: no NaN mean


def test_library_check_names_the_loss():
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    x, y = torch.randn(4, 8), torch.randn(4, 2)
    mse = lambda out, target: ((out.float() - target) ** 2).mean()   # noqa: E731
    report = ampaudit.check(model, x, device="cpu", dtype="bfloat16", calibrate=True, loss_fn=mse)
    assert report.calibration["backward"] == "mean of the outputs (the example inputs gave no target for loss_fn)"
    report = ampaudit.check(model, x, device="cpu", dtype="bfloat16", calibrate=True, loss_fn=mse,
                            batches=[((x,), {}, y)])
    assert report.calibration["backward"] == "loss_fn(output, target) on batch 1 of the given batches"


def test_explicit_input_shapes_keep_the_example_inputs():
    loaded = load_target(str(GPT), inputs=["2x8:int64"])
    data = calibration_data(loaded, explicit_inputs=True)
    assert data.origin == "the example inputs" and len(data.batches[0]) == 2


def test_a_failing_train_data_falls_back_and_says_why(tmp_path):
    path = tmp_path / "broken_data.py"
    path.write_text(textwrap.dedent("""
        import torch, torch.nn as nn
        def build_model():
            return nn.Linear(8, 8)
        def example_inputs():
            return (torch.randn(4, 8),)
        def train_data():
            raise FileNotFoundError("data/train.bin")
            yield
        def loss_fn(out, target):
            return out.float().mean()
    """))
    doc = _check_json(path, "--device", "cpu", "--dtype", "bfloat16")
    assert doc["calibration"]["origin"] == "the example inputs"
    assert any(n.startswith("train_data() raised FileNotFoundError: data/train.bin") for n in doc["notes"])


def _batches_seen(*runs):
    """What calibration_data gave each of ``runs`` (callables): origin, input shapes, whether a loss_fn."""
    from ampaudit.analysis import calibrate as cal_mod

    seen = []
    original = cal_mod.calibration_data

    def spy(loaded, count=0, **kw):
        data = original(loaded, count, **kw)
        seen.append((data.origin, [tuple(t.shape) for t in data.batches[0][0]], data.loss_fn is not None))
        return data

    mp = pytest.MonkeyPatch()
    mp.setattr(cal_mod, "calibration_data", spy)
    try:
        for run in runs:
            run()
    finally:
        mp.undo()
    return seen


def _check():
    result = runner.invoke(app, ["check", str(GPT), "--calibrate", "-f", "json", "--fail-on", "never",
                                 "--select", "AMP6"])
    assert result.exit_code == 0, result.output


def test_a_train_data_that_does_not_fit_forward_is_an_input_error(tmp_path):
    """Its FP32 forward raises too: no AMP602 (an autocast fault), but one line naming the batch."""
    path = tmp_path / "bad_shape.py"
    path.write_text(textwrap.dedent("""
        import torch, torch.nn as nn
        def build_model():
            return nn.Linear(8, 8)
        def example_inputs():
            return (torch.randn(4, 8),)
        def train_data():
            while True:
                yield torch.randn(4, 5), torch.randn(4, 8)
        def loss_fn(out, target):
            return ((out.float() - target) ** 2).mean()
    """))
    result = runner.invoke(app, ["check", str(path), "--calibrate", "--device", "cpu", "--dtype", "bfloat16"])
    assert result.exit_code == 2, result.output
    assert "the FP32 forward of Linear raises on train_data() batch 1: RuntimeError: mat1 and mat2" in result.output
    assert "make train_data() yield what forward() takes" in result.output and "AMP602" not in result.output


def test_fix_diff_calibrate_and_check_calibrate_pick_the_same_batches():
    """fix --diff/--write --calibrate and check --calibrate call calibration_data: the same inputs and the same
    loss, so a file fix calls clean is one check calls clean."""
    import ampaudit.sourcefix.api as sourcefix_api

    seen = _batches_seen(_check, lambda: sourcefix_api.fix_source(str(GPT), calibrate=True, select=["AMP6"],
                                                                   verify=False))
    assert seen == [("train_data()", [(2, 8)], True)] * 2


@pytest.mark.slow
def test_graph_fix_calibrate_picks_the_same_batches(tmp_path):
    def graph_fix():
        result = runner.invoke(app, ["fix", str(GPT), "-o", str(tmp_path / "out"), "--calibrate", "--select", "AMP6"])
        assert result.exit_code == 0, result.output

    assert _batches_seen(_check, graph_fix) == [("train_data()", [(2, 8)], True)] * 2


@pytest.mark.slow
def test_the_sum_of_a_wide_head_is_what_overflowed():
    """The trap is real: on 1024 tokens the sum of the logits overflows fp16 bias gradients (AMP601's inf where
    FP32 is finite); the file's loss and the mean proxy do not."""
    from ampaudit.runtime.locate import judge_against_fp32, locate_nonfinite
    from ampaudit.simulate import simulation

    m = load_module(GPT)
    model = m.build_model().eval()
    inputs, target = next(m.train_data(batch=8, seq=128))

    def backward_faults(loss):
        with simulation(Policy.load("cuda", "float16")):
            events = locate_nonfinite(model, (inputs,), loss=loss)
        events = judge_against_fp32(model, events, (inputs,), {}, loss=loss)
        return [e["module"] for e in events if e.get("phase") == "backward" and not e.get("fp32_too")]

    assert backward_faults(batch_loss(None, None, proxy="sum"))        # what calibration used to differentiate
    assert not backward_faults(batch_loss(m.loss_fn, target))
    assert not backward_faults(batch_loss(None, None))
