"""Code inside functions torch.fx keeps opaque (torch.fx.wrap) is audited with its own lines, by every capture,
and never run on fx's immutable argument lists."""
from __future__ import annotations

import pytest
import torch

import ampaudit
from ampaudit.capture import capture

from conftest import ASSETS, load_module

W = load_module(ASSETS / "wrapped" / "wrapped_models.py")
SRC = str(ASSETS / "wrapped" / "wrapped_models.py")


def line_of(text: str) -> int:
    return next(i for i, line in enumerate(open(SRC).read().splitlines(), 1) if text in line)


def found(report):
    return sorted({(f.rule, f.module, (f.location or {}).get("file"), (f.location or {}).get("line"))
                   for f in report.findings})


def test_a_wrapped_function_that_mutates_its_list_arguments_is_audited():
    # swin3d's _get_window_and_shift_size does `shift_size[i] = 0` on what fx hands it as an immutable_list.
    report = ampaudit.check(W.Swin3dWindows(), torch.randn(1, 4, 4, 16), device="cuda")
    assert report.capture == "fx"
    assert not any("opaque" in n for n in report.notes), report.notes


@pytest.mark.parametrize("mode", ["fx", "export", "dispatch"])
def test_mask_constant_inside_a_wrapped_helper_found_on_its_own_line(mode):
    x = torch.randn(2, 8, 16)
    wrapped = ampaudit.check(W.MaskedAttention(), x, device="cuda", capture_mode=mode)
    assert ("AMP401", "", SRC, line_of("scores = scores.masked_fill(mask, -1e9)")) in found(wrapped)
    plain = ampaudit.check(W.MaskedAttentionPlain(), x, device="cuda", capture_mode=mode)
    # The unwrapped twin (same body, a few lines further down) gives the same findings.
    assert [f[:2] for f in found(wrapped)] == [f[:2] for f in found(plain)]


def test_normalize_eps_inside_swin_v2_style_attention_is_flagged():
    # Control flow on the input's shape: fx cannot trace the body symbolically, so it is recorded at these shapes.
    x = torch.randn(2, 4, 4, 16)
    report = ampaudit.check(W.CosineWindows(), x, device="cpu", capture_mode="fx")
    line = line_of("attn = F.normalize(q, dim=-1)")
    assert ("AMP402", "", SRC, line) in found(report), report.to_dict()["findings"]
    for mode in ("export", "dispatch"):         # which see through the wrap: the same findings
        assert found(ampaudit.check(W.CosineWindows(), x, device="cpu", capture_mode=mode)) == found(report)


def test_the_capture_graph_is_spliced_only_where_it_holds_for_every_input():
    # fix rewrites the captured graph: a body traced at the example shapes stays one opaque call there.
    from ampaudit.analysis.amp_prop import AmpProp
    from ampaudit.policy import Policy

    cap = capture(W.CosineWindows())
    prop = AmpProp(cap.gm, Policy.load("cpu", "float16"), specialize=False)
    prop.propagate(torch.randn(2, 4, 4, 16))
    targets = [n.target for n in cap.gm.graph.nodes if n.op == "call_function"]
    assert W.window_cosine_attention in targets
    assert any("window_cosine_attention is not audited inside" in n for n in prop.notes)
    # Traced symbolically (no shape decides anything), the body replaces the call for good.
    model = W.MaskedAttention()
    cap = capture(model)
    AmpProp(cap.gm, Policy.load("cuda", "float16"), specialize=False).propagate(torch.randn(2, 8, 16))
    assert W.masked_attention not in [n.target for n in cap.gm.graph.nodes]
    cap.gm.recompile()
    x = torch.randn(2, 8, 16)
    torch.testing.assert_close(cap.gm(x), model(x))


def test_check_cli_succeeds_on_a_wrapped_function_that_mutates_its_arguments():
    from typer.testing import CliRunner

    import ampaudit.cli.commands  # noqa: F401  registers the commands
    from ampaudit.cli.app import app

    res = CliRunner().invoke(app, ["check", SRC, "--entry", "build_swin3d", "--input", "1x4x4x16"])
    assert res.exit_code in (0, 1), res.output
    assert "immutable_list" not in res.output and "do not fit" not in res.output


@pytest.mark.parametrize("mode", ["fx", "export", "dispatch"])
def test_a_graph_module_from_a_custom_tracer_is_audited_inside_its_opaque_parts(mode):
    # The user's tracer kept clamp_scores (autowrap_functions) and LeafAttention (a leaf) opaque.
    report = ampaudit.check(W.custom_traced(), torch.randn(2, 16), device="cuda", capture_mode=mode)
    lines = {(f.module, f.location["line"]) for f in report.findings if f.rule == "AMP401"}
    assert lines == {("", _line_in("def clamp_scores")), ("attn", _line_in("class LeafAttention"))}, \
        report.to_dict()["findings"]


def _line_in(after: str) -> int:
    """The -1e9 line that follows ``after`` in the models file."""
    lines = open(SRC).read().splitlines()
    start = next(i for i, line in enumerate(lines) if after in line)
    return next(i for i in range(start, len(lines)) if "-1e9" in lines[i]) + 1


def test_a_constant_the_wrapped_body_builds_stays_a_real_tensor_in_the_spliced_graph():
    from ampaudit.analysis.amp_prop import AmpProp
    from ampaudit.policy import Policy

    model = W.Floor()
    cap = capture(model)
    AmpProp(cap.gm, Policy.load("cuda", "float16"), specialize=False).propagate(torch.randn(2, 16))
    consts = [getattr(cap.gm, n.target) for n in cap.gm.graph.nodes if n.op == "get_attr" and "inlined" in n.target]
    assert consts and all(type(c) is torch.Tensor for c in consts)
    cap.gm.recompile()
    x = torch.randn(2, 16)
    torch.testing.assert_close(cap.gm(x), model(x))


def test_a_wrapped_function_no_probe_can_run_is_noted_and_skipped():
    report = ampaudit.check(W.DataScaled(), torch.randn(2, 8), device="cuda", capture_mode="fx")
    assert any(n.startswith("scale_from_data is not audited inside") for n in report.notes), report.notes
    assert any("shapes unknown after 1 node(s)" in n for n in report.notes), report.notes
