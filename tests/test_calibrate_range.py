"""check --calibrate judges a module's range against the dtype its output really has under the target's autocast:
an fp32 island's large (or tiny) FP32 output is no range finding; the same module under autocast still is one."""
from __future__ import annotations

import json
import math

import pytest
import torch
from typer.testing import CliRunner

import ampaudit
import ampaudit.cli.commands  # noqa: F401
from ampaudit.analysis.calibrate import calibrate, judge_range, output_dtypes
from ampaudit.cli.app import app
from ampaudit.policy import Policy

from conftest import ASSETS, load_module

RANGE = ASSETS / "range"
MEASURED = ("range", "nonfinite", "divergence")
runner = CliRunner()


def _measured(path, device):
    r = runner.invoke(app, ["check", str(path), "--calibrate", "--device", device, "-f", "json",
                            "--fail-on", "never"])
    assert r.exit_code == 0, r.output
    return [(f["rule"], f["module"]) for f in json.loads(r.output)["findings"] if f["family"] in MEASURED]


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_fp32_island_with_large_outputs_is_no_overflow(device):
    assert ("AMP501", "head") in _measured(RANGE / "offset_head.py", device)
    assert _measured(RANGE / "offset_head_fp32.py", device) == []


@pytest.mark.parametrize("rule, offset, scale", [("AMP502", 5e4, 1.0), ("AMP503", 0.0, 1e-9)])
def test_fp32_island_has_no_headroom_or_underflow_finding(rule, offset, scale):
    for name, fires in (("offset_head", True), ("offset_head_fp32", False)):
        m = load_module(RANGE / f"{name}.py")
        torch.manual_seed(0)
        model = m.Net(m.OffsetHead(offset, scale))
        report = ampaudit.check(model, *m.example_inputs(), device="cuda", dtype="float16", calibrate=True,
                                select=["range"])
        assert [(f.rule, f.module) for f in report.findings] == ([(rule, "head")] if fires else []), name


def test_calibration_records_the_dtype_each_output_is_stored_in():
    for name, head in (("offset_head", torch.float16), ("offset_head_fp32", torch.float32)):
        m = load_module(RANGE / f"{name}.py")
        cal = calibrate(m.build_model(), [(m.example_inputs(), {})], Policy.load("cuda", "float16"))
        assert cal.out_dtypes["head"] == head and cal.out_dtypes["inp"] == torch.float16
        assert cal.out_dtypes["head.fc"] == head and cal.out_dtypes[""] == torch.float32   # .float().mean()
        assert cal.modules["head"]["range_dtype"] == str(head).replace("torch.", "")


def test_output_dtypes_keeps_the_narrowest_of_several_calls():
    class Twice(torch.nn.Module):
        def __init__(self):
            super().__init__(); self.fc = torch.nn.Linear(4, 4)
        def forward(self, x):
            a = self.fc(x)                          # float16 under autocast
            with torch.autocast("cpu", enabled=False):
                return a.float() + self.fc(x)       # float32
    model, seen = Twice(), {}
    with torch.autocast("cpu", dtype=torch.bfloat16), output_dtypes(model, into=seen):
        model(torch.randn(2, 4))
    assert seen == {"fc": torch.bfloat16, "": torch.float32}
    with torch.autocast("cpu", dtype=torch.float16):
        model(torch.randn(2, 4))                    # the hook is gone once the block ends: fc stays bfloat16
    assert seen == {"fc": torch.bfloat16, "": torch.float32}


def test_judge_range_clears_only_what_an_fp32_output_holds():
    measured = {"absmax": 1e5, "overflow": 3, "headroom_bits": -0.6, "underflow_share": 0.5, "flush_share": 0.1}
    kept = judge_range(dict(measured), torch.float16, torch.float16)
    assert kept == {**measured, "range_dtype": "float16"}
    assert judge_range(dict(measured), None, torch.float16)["overflow"] == 3        # not seen under autocast
    fp32 = judge_range(dict(measured), torch.float32, torch.float16)
    assert fp32["overflow"] == 0 and fp32["underflow_share"] == 0 == fp32["flush_share"]
    assert fp32["headroom_bits"] == pytest.approx(128 - math.log2(1e5), abs=1e-6)
    assert fp32["range_dtype"] == "float32"
