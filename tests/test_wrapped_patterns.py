"""Research-code patterns around the functions torch.fx keeps opaque: a wrapped function calling a helper, one
wrapped by name, a user's tracer that autowraps a utility module or keeps a submodule a leaf, wrapped functions
that mutate their list and dict arguments or branch on data, and one wrapped function called from two modules.
Each hazard is reported on the opaque code's own line with the module that called it."""
from __future__ import annotations

import pytest
import torch

import ampaudit
from ampaudit.loading import load_target

from conftest import ASSETS

HERE = ASSETS / "wrapped"


def load(name: str):
    loaded = load_target(str(HERE / f"{name}.py"))
    return loaded.model, loaded.args


def line_of(name: str, text: str) -> int:
    lines = (HERE / f"{name}.py").read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if text in line)


def found(report, rule: str) -> set:
    return {(f.module, (f.location or {}).get("file"), (f.location or {}).get("line"))
            for f in report.findings if f.rule == rule}


def test_a_hazard_in_a_helper_the_wrapped_function_calls_is_on_the_helpers_line():
    model, args = load("nested_helper")
    report = ampaudit.check(model, *args, device="cuda")
    line = line_of("nested_helper", "torch.finfo(torch.float32).min")
    assert found(report, "AMP401") == {("block", str(HERE / "nested_helper.py"), line)}, report.to_dict()
    assert report.capture == "fx" and not report.notes


def test_a_function_wrapped_by_name_is_audited_inside():
    model, args = load("by_name")
    report = ampaudit.check(model, *args, device="cpu", dtype="float16")
    line = line_of("by_name", "F.normalize(x, dim=-1)")
    assert found(report, "AMP402") == {("head", str(HERE / "by_name.py"), line)}, report.to_dict()


def test_one_wrapped_function_called_from_two_modules_names_each():
    model, args = load("called_twice")
    report = ampaudit.check(model, *args, device="cuda")
    line = line_of("called_twice", "-1e9")
    path = str(HERE / "called_twice.py")
    assert found(report, "AMP401") == {("enc", path, line), ("dec", path, line)}


def test_wrapped_functions_mutating_their_list_and_dict_arguments_are_audited():
    model, args = load("mutating")
    report = ampaudit.check(model, *args, device="cuda")
    line = line_of("mutating", "feats[0].masked_fill")
    assert found(report, "AMP401") == {("", str(HERE / "mutating.py"), line)}
    assert not any("merge_levels" in n or "immutable" in n for n in report.notes), report.notes


@pytest.mark.parametrize("mode", ["fx", "export", "dispatch"])
def test_a_user_tracers_autowrapped_utility_module_is_audited_with_the_calling_module(mode):
    # The user's tracer flattened Scores into the GraphModule: its ops keep Scores' path from that graph.
    model, args = load("util_tracer")
    report = ampaudit.check(model, *args, device="cpu", dtype="bfloat16", capture_mode=mode)
    line = line_of("score_ops", "e = x.exp()")
    assert found(report, "AMP202") == {("scores", str(HERE / "score_ops.py"), line)}, report.to_dict()


def test_a_wrapped_function_branching_on_data_is_noted_with_the_capture_that_follows_it():
    model, args = load("mutating")
    report = ampaudit.check(model, *args, device="cuda")
    note = next(n for n in report.notes if n.startswith("gate is not audited inside"))
    assert "--capture dispatch" in note, note
    # which does follow it, on the example inputs, with gate's own line and its calling module
    traced = ampaudit.check(model, *args, device="cuda", capture_mode="dispatch")
    assert ("g", str(HERE / "mutating.py"), line_of("mutating", "x.exp() / x.exp()")) in found(traced, "AMP202")


def test_fix_says_check_audits_a_wrapped_body_only_where_check_does():
    from conftest import ASSETS as assets, load_module

    W = load_module(assets / "wrapped" / "wrapped_models.py")
    model, args = load("mutating")
    fixed = ampaudit.fix(model, *args, device="cuda").report
    data_note = next(n for n in fixed.notes if n.startswith("gate "))
    assert "ampaudit check audits it" not in data_note and "--capture dispatch" in data_note, data_note
    # The re-check cannot look inside gate either: it is clean only in what it audited.
    assert ("re-check: clean for the fixed families in what it audited (the notes say what it could not look into)"
            in fixed.verification.lines()), fixed.verification.lines()
    # A body that branches on a shape is recorded by check at the example inputs' shapes: fix says so.
    shape_notes = ampaudit.fix(W.CosineWindows(), torch.randn(2, 4, 4, 16), device="cpu").report.notes
    assert any(n.startswith("window_cosine_attention ") and "ampaudit check audits it" in n for n in shape_notes)


def test_a_user_tracers_leaf_with_data_dependent_control_flow_is_audited_inside():
    # ampaudit's own trace goes into the leaf, which branches on data: the dispatch recording follows it.
    model, args = load("leaf_tracer")
    report = ampaudit.check(model, *args, device="cpu", dtype="bfloat16")
    line = line_of("leaf_tracer", "torch.cumsum(")
    assert report.capture == "dispatch"
    assert found(report, "AMP203") == {("pos", str(HERE / "leaf_tracer.py"), line)}, report.to_dict()


def test_a_wrapped_function_handed_modules_runs_them_as_the_models_own():
    from ampaudit.analysis.amp_prop import AmpProp
    from ampaudit.capture import capture
    from ampaudit.graph_meta import module_of
    from ampaudit.policy import Policy

    model, args = load("module_argument")
    report = ampaudit.check(model, *args, device="cuda")
    # The Linear it is handed runs under autocast: its float16 output meets the mask constant.
    line = line_of("module_argument", "y.masked_fill(y < 0, -1e9)")
    assert found(report, "AMP401") == {("block", str(HERE / "module_argument.py"), line)}, report.to_dict()
    cap = capture(model)
    AmpProp(cap.gm, Policy.load("cuda", "float16"), specialize=False).propagate(*args)
    nodes = list(cap.gm.graph.nodes)
    assert [(n.target, module_of(n)) for n in nodes if n.op == "call_module"] == [("block.proj", "block.proj")]
    # The user's module is traced through, its weight read from the model, not copied in as a constant.
    assert "block.gate.scale" in [n.target for n in nodes if n.op == "get_attr"]
    assert not any("inlined_const" in str(n.target) for n in nodes)
    cap.gm.recompile()
    torch.testing.assert_close(cap.gm(*args), model(*args))


@pytest.mark.parametrize("mode", ["fx", "dispatch"])
def test_a_recorded_linear_on_a_strided_input_is_typed_as_autocast_runs_it(mode):
    # fx: the wrapped body is recorded (it branches on a shape); dispatch: the forward raises under autocast, so it
    # is recorded in fp32. Either way aten's mm + fp32 bias add must not make the linear's output float32.
    model, args = load("recorded_linear")
    report = ampaudit.check(model, *args, device="cuda", capture_mode=mode)
    line = line_of("recorded_linear", "return y.masked_fill(y < 0, -1e9)")
    assert found(report, "AMP401") == {("win", str(HERE / "recorded_linear.py"), line)}, report.to_dict()


def test_a_linear_on_a_strided_slice_recorded_in_fp32_is_typed_as_autocast_runs_it():
    from conftest import load_module

    R = load_module(HERE / "recorded_linear.py")
    report = ampaudit.check(R.Sliced(), torch.randn(2, 8, 16), device="cuda", capture_mode="dispatch")
    line = line_of("recorded_linear", "return y.masked_fill(y < 0, -1e9).softmax(-1)")
    assert ("", str(HERE / "recorded_linear.py"), line) in found(report, "AMP401"), report.to_dict()


def test_a_recorded_body_that_casts_to_fp32_is_clean():
    # The recording runs under the target's autocast: `.float()` on the linear's float16 output is a cast it sees
    # (in fp32 it would be no op at all, and the mask would still be typed float16).
    from conftest import load_module

    R = load_module(HERE / "recorded_linear.py")
    report = ampaudit.check(R.WindowFixed(), torch.randn(2, 8, 16), device="cuda")
    assert not found(report, "AMP401") and not report.notes, report.to_dict()
    cpu = ampaudit.check(R.WindowFixed(), torch.randn(2, 8, 16), device="cpu", dtype="float16")
    assert not found(cpu, "AMP401") and not cpu.notes, cpu.to_dict()
    # Its inputs have the dtype autocast gives them (float16), so a body's own fp32 island upcasts them too.
    for device in ("cuda", "cpu"):
        island = ampaudit.check(R.WindowIsland(), torch.randn(2, 8, 16), device=device, dtype="float16")
        assert not found(island, "AMP401") and not island.notes, island.to_dict()


@pytest.mark.parametrize("mode", ["fx", "export", "dispatch"])
def test_a_user_traced_graph_module_nested_in_a_model_keeps_its_module_paths(mode):
    from ampaudit.loading import load_target

    loaded = load_target(str(HERE / "util_tracer.py"), entry="WithHead")
    report = ampaudit.check(loaded.model, *loaded.args, device="cpu", dtype="bfloat16", capture_mode=mode)
    line = line_of("score_ops", "e = x.exp()")
    assert found(report, "AMP202") == {("backbone.scores", str(HERE / "score_ops.py"), line)}, report.to_dict()


def test_a_finding_in_a_recorded_body_recommends_the_source_edit_that_fixes_it():
    # fix -o leaves a body recorded at the example shapes as written: the report names fix --diff, which runs.
    from typer.testing import CliRunner

    import ampaudit.cli.commands  # noqa: F401  registers the commands
    from ampaudit.cli.app import app
    from conftest import load_module

    R = load_module(HERE / "recorded_linear.py")
    report = ampaudit.check(R.WindowExp(), torch.randn(2, 8, 16), device="cpu", dtype="float16")
    exp = [f for f in report.findings if f.rule == "AMP202"]
    assert exp and all("fix --diff" in f.fix and "fix -o" not in f.fix for f in exp), [f.fix for f in exp]
    res = CliRunner().invoke(app, ["fix", str(HERE / "recorded_linear.py"), "--entry", "WindowExp", "--input",
                                   "2x8x16", "--device", "cpu", "--diff"])
    assert res.exit_code in (0, 1) and "re-check: clean for AMP202" in res.output, res.output


def test_fix_o_counts_what_remains_in_a_wrapped_body_it_leaves_as_written(tmp_path):
    # The rewrite cannot reach inside a body recorded at the example shapes: the fixed model still raises under
    # autocast there, so the re-check names the finding and its line, fix exits 1, and fixed/model.py (which wraps
    # the function at its top level, as torch.fx requires) checks to the same finding.
    import json

    from typer.testing import CliRunner

    import ampaudit.cli.commands  # noqa: F401  registers the commands
    from ampaudit.cli.app import app

    out = tmp_path / "fixed"
    res = CliRunner().invoke(app, ["fix", str(HERE / "recorded_linear.py"), "-o", str(out)])
    line = line_of("recorded_linear", "return y.masked_fill(y < 0, -1e9)")
    assert res.exit_code == 1, res.output
    assert "re-check: clean" not in res.output and "after raises" in res.output, res.output
    assert (f"re-check: 1 finding(s) remain inside wrapped functions the rewrite leaves as written: AMP401 "
            f"<top module> (recorded_linear.py:{line}); fix --diff edits their source") in res.output, res.output
    verification = json.loads((out / "fix.json").read_text())["report"]["verification"]
    assert not verification["ok"] and verification["remaining"] == []
    assert [(f["rule"], f["location"]["line"]) for f in verification["unrewritten"]] == [("AMP401", line)]
    fixed = load_target(str(out / "model.py"))
    again = ampaudit.check(fixed.model, *fixed.args, device="cuda")
    assert {(f.rule, f.location["line"]) for f in again.findings if f.severity != "info"} == {("AMP401", line)}
    # A wrapped function fx follows is rewritten inside: there the re-check is clean and fix exits 0.
    res = CliRunner().invoke(app, ["fix", str(HERE / "nested_helper.py"), "-o", str(tmp_path / "inlined")])
    assert res.exit_code == 0 and "re-check: clean for the fixed families" in res.output, res.output


def test_fixed_model_py_wraps_an_opaque_function_at_its_top_level(tmp_path):
    # torch.fx.wrap refuses to run anywhere but a module's top level: inside the class body, importing the written
    # model.py raised.
    from typer.testing import CliRunner

    import ampaudit.cli.commands  # noqa: F401  registers the commands
    from ampaudit.cli.app import app

    out = tmp_path / "fixed"
    res = CliRunner().invoke(app, ["fix", str(HERE / "recorded_linear.py"), "-o", str(out), "--no-verify"])
    assert res.exit_code == 0, res.output
    text = (out / "model.py").read_text()
    assert any(ln.startswith("torch.fx._symbolic_trace.wrap(") for ln in text.splitlines()), text
    fixed, (model, _) = load_target(str(out / "model.py")), load("recorded_linear")
    model.load_state_dict(fixed.model.state_dict())
    with torch.no_grad():
        assert torch.equal(fixed.model(*fixed.args), model(*fixed.args))


def test_check_does_not_call_a_model_clean_when_part_of_it_was_not_audited():
    # gate branches on data: fx keeps it opaque and check cannot look inside it; no finding there is not "clean".
    from typer.testing import CliRunner

    import ampaudit.cli.commands  # noqa: F401  registers the commands
    from ampaudit.cli.app import app

    runner = CliRunner(env={"COLUMNS": "200"})
    res = runner.invoke(app, ["check", str(HERE / "mutating.py"), "--entry", "Gate", "--input", "2x16"])
    assert res.exit_code == 0, res.output
    assert "the model is clean" not in res.output and "not called clean" in res.output, res.output
    assert "gate is not audited inside" in res.output
    # Followed by the dispatch recording, the same model is audited whole and clean.
    res = runner.invoke(app, ["check", str(HERE / "mutating.py"), "--entry", "Gate", "--input", "2x16",
                              "--capture", "dispatch"])
    assert res.exit_code == 0 and "No findings: the model is clean for this target." in res.output, res.output


@pytest.mark.parametrize("fmt", ["json", "sarif", "github"])
def test_every_output_format_says_what_was_not_audited(fmt):
    import json

    from typer.testing import CliRunner

    import ampaudit.cli.commands  # noqa: F401  registers the commands
    from ampaudit.cli.app import app

    res = CliRunner().invoke(app, ["check", str(HERE / "mutating.py"), "--entry", "Gate", "--input", "2x16",
                                   "-f", fmt])
    assert res.exit_code == 0, res.output
    if fmt == "json":
        said = json.loads(res.output)["unaudited"]
    elif fmt == "sarif":
        notes = json.loads(res.output)["runs"][0]["invocations"][0]["toolExecutionNotifications"]
        assert {n["level"] for n in notes} == {"warning"}
        said = [n["message"]["text"] for n in notes]
    else:
        said = [ln for ln in res.output.splitlines() if ln.startswith("::warning title=ampaudit%3A not audited::")]
    assert len(said) == 2 and "gate is not audited inside" in said[0] and "without a fake kernel" in said[1], res.output


def test_assert_amp_safe_passes_a_model_with_unaudited_parts_with_a_warning():
    from ampaudit.testing import UnauditedWarning, assert_amp_safe

    gate = load_target(str(HERE / "mutating.py"), entry="Gate").model
    with pytest.warns(UnauditedWarning, match="Gate: part of the model was not audited: gate is not audited inside .* \(and 1 more\)"):
        report = assert_amp_safe(gate, torch.randn(2, 16))
    assert report.unaudited


def test_fix_diffs_re_check_is_clean_only_in_what_it_audited():
    # The edit fixes merge_levels' mask; gate stays opaque to the re-check, which says so instead of "clean".
    from ampaudit.sourcefix.api import fix_source

    v = fix_source(str(HERE / "mutating.py")).verification
    assert v.ok and "re-check: clean for AMP401 in what it audited" in v.lines(), v.lines()
    assert any(ln.startswith("re-check could not look into: gate is not audited inside") for ln in v.lines())
    assert v.as_dict()["unaudited"] == v.unaudited and v.unaudited
