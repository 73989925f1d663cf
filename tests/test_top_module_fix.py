"""A finding on the top module's own ops (module ""): its fix names those ops, never "keep  in fp32" or
``keep_fp32(model, [''])`` (the whole model in fp32); rules/policy/settings.toml [recommend.top]."""
from __future__ import annotations

from pathlib import Path

import ampaudit
from ampaudit.rules.engine import untraceable
from conftest import load_module

PLANTED = Path(__file__).parent / "planted" / "norm_around_linear.py"


def test_an_own_error_of_the_top_modules_code_names_its_ops_not_the_whole_model():
    m = load_module(PLANTED)
    model = m.NormedProjection()          # the composite as the model: its one-pass variance is the top's own code
    (x,) = m.example_inputs()
    report = ampaudit.check(model, x.repeat(1, 4), device="cpu", dtype="bfloat16", calibrate=True)
    top = [f for f in report.findings if f.rule == "AMP701" and f.module == ""]
    assert top, [(f.rule, f.module) for f in report.findings]
    fix = top[0].fix
    assert "keep  in" not in fix and "keep_fp32" not in fix
    assert "compute the top module's own ops at this line in fp32" in fix and "ampaudit fix --calibrate -o DIR" in fix


def test_on_a_model_fx_cannot_trace_the_top_modules_fix_is_the_source_edit():
    fix = ("compute the top module's own ops at this line in fp32 (ampaudit fix --calibrate -o DIR puts them in an "
           "fp32 island), or find the op with ampaudit check --calibrate --select nonfinite")
    routed = untraceable(fix, "")
    assert "keep_fp32" not in routed and "ampaudit fix --diff makes that edit in your source" in routed


def test_a_library_lines_fix_names_the_users_edit_not_fix_diff():
    # fix never edits an installed library's file: "fix --diff makes that edit" would run and change nothing.
    from ampaudit.findings import Finding
    from ampaudit.rules.engine import route_library

    text = ("compute the top module's own ops at this line in fp32 (ampaudit fix --diff makes that edit in your "
            "source), or find the op with ampaudit check --calibrate --select nonfinite")
    lib = Finding(rule="AMP701", name="n", family="divergence", severity="warning", module="", op="", message="m",
                  fix=text, location={"file": "torchvision/models/detection/transform.py", "line": 308, "library": True})
    own = Finding(rule="AMP701", name="n", family="divergence", severity="warning", module="", op="", message="m",
                  fix=text, location={"file": "model.py", "line": 3})
    route_library([lib, own])
    assert "fix --diff" not in lib.fix and "a subclass of the module or a copy of its forward" in lib.fix
    assert own.fix == text
