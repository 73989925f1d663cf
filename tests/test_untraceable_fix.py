"""Every command a report recommends runs on that model: ``check`` is run on an fx-traceable model, on models
torch.fx cannot trace (nanoGPT-style, audited through torch.export), and on a misaligned one, and each ampaudit
command and ampaudit.keep_fp32 call its fix texts and notes name is run on the same model (in-process), exit 0,
with its result written. fix -o / fix --pad on an export-captured model work on its module tree."""
from __future__ import annotations

import json
import re

import pytest
import torch
from conftest import ASSETS, SAMPLES
from typer.testing import CliRunner

import ampaudit
import ampaudit.cli.commands  # noqa: F401  registers the commands
from ampaudit.cli.app import app
from ampaudit.loading import load_target
from ampaudit.rules.engine import module_fixable, untraceable
from ampaudit.rules.loader import load_rules

NANOGPT = str(ASSETS / "nanogpt" / "model.py")
GATE = str(ASSETS / "nanogpt_gate" / "model.py")
# An option's value: DIR-style placeholders, and the rule names --select/--ignore take ("--select nonfinite").
COMMAND = re.compile(r"ampaudit (fix|check|train|plan|report)"
                     r"((?: --?[a-z][\w-]*(?: [A-Z0-9]+|(?<=--select) [\w,-]+|(?<=--ignore) [\w,-]+)?)*)")
CALL = re.compile(r"ampaudit\.keep_fp32\(model, \[[^\]]*\]\)")
runner = CliRunner()


def recommendations(texts):
    cmds = {(m.group(1), m.group(2).strip()) for t in texts for m in COMMAND.finditer(t or "")}
    return cmds, {m.group(0) for t in texts for m in CALL.finditer(t or "")}


def _run_fix(target, opts, target_opts, out):
    """A recommended ``ampaudit fix ...``, run as printed: the graph rewrite writes to ``-o DIR``, which the
    text names (fix refuses to run without it)."""
    args = [a if a != "DIR" else str(out) for a in opts.split()]
    source = "--diff" in args or "--write" in args
    assert source or str(out) in args, opts
    res = runner.invoke(app, ["fix", target, *args, *target_opts])
    assert res.exit_code in ((0, 1) if "--diff" in args else (0,)), res.output   # --diff: 1 means "a diff"
    if not source:
        assert json.loads((out / "fix.json").read_text())["complete"]
        fixed = load_target(str(out / "model.py"))
        assert torch.isfinite(fixed.model(*fixed.args)).all()
        if "--pad" in args:
            assert "padded" in res.output, res.output
    return res


CASES = [  # target, target options, the command the report must recommend, capture
    pytest.param(str(ASSETS / "fix" / "two_exp.py"), ["--device", "cpu", "--dtype", "float16"], ("fix", "-o DIR"),
                 "fx", id="fx-islands"),
    pytest.param(str(SAMPLES / "misaligned_mlp.py"), ["--device", "cpu", "--dtype", "bfloat16"],
                 ("fix", "--pad -o DIR"), "fx", id="fx-misaligned"),
    pytest.param(NANOGPT, ["--device", "cpu", "--dtype", "bfloat16"], ("fix", "--pad -o DIR"), "export",
                 id="nanogpt"),
    pytest.param(GATE, ["--device", "cuda", "--calibrate"], ("fix", "--calibrate -o DIR"), "export",
                 id="nanogpt-gate", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("target, target_opts, expected, capture", CASES)
def test_every_command_a_report_recommends_runs(target, target_opts, expected, capture, tmp_path):
    assert expected in run_recommendations(target, target_opts, capture, tmp_path)


TOP_EXP = """import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.register_buffer("tri", torch.tril(torch.ones(8, 8)))

    def forward(self, x):
        t = x.size(1)                      # a slice by it: torch.fx cannot trace this
        return torch.exp(self.fc(x)[:, :t] * self.tri[:t, :t].sum())


def build_model():
    torch.manual_seed(0)
    return Net()


def example_inputs():
    return (torch.randn(2, 8, 16),)
"""


def test_a_hazard_in_the_top_forward_of_an_export_captured_model_recommends_the_source_fix(tmp_path):
    # Kept in fp32 at module granularity it would be the whole model: the source fix edits the line instead.
    target = tmp_path / "top.py"
    target.write_text(TOP_EXP)
    cmds = run_recommendations(str(target), ["--device", "cpu", "--dtype", "float16"], "export", tmp_path)
    assert cmds == {("fix", "--diff")}, cmds


def run_recommendations(target, target_opts, capture, tmp_path):
    """check ``target``, then run every command and keep_fp32 call its report recommends; the commands."""
    res = runner.invoke(app, ["check", target, *target_opts, "-f", "json"])
    report = json.loads(res.stdout)
    assert report["capture"] == capture
    cmds, calls = recommendations([f["fix"] for f in report["findings"]] + report["notes"])
    fix_opts = [o for o in target_opts if o != "--calibrate"]
    for i, (sub, opts) in enumerate(sorted(cmds)):
        if sub == "fix":
            _run_fix(target, opts, fix_opts, tmp_path / f"out{i}")
        else:
            run = runner.invoke(app, [sub, target, *opts.split(), *fix_opts])
            assert run.exit_code in (0, 1), run.output      # check exits 1 on findings
    for call in calls:                    # each eager call named runs on the model the file builds
        model = load_target(target).model
        assert eval(call, {"ampaudit": ampaudit, "model": model}) is model
    return cmds


def test_fix_on_an_export_captured_model_pads_on_its_module_tree(tmp_path):
    out = tmp_path / "out"
    res = runner.invoke(app, ["fix", NANOGPT, "--pad", "-o", str(out), "--device", "cpu", "--dtype", "bfloat16"])
    assert res.exit_code == 0, res.output
    assert "form: fixed on the module tree" in res.output and "captured by export" in res.output
    assert "lm_head Linear: out_features 65->72" in res.output and "tied wte" in res.output
    assert "FP32 outputs: bitwise equal" in res.output and "re-check: clean" in res.output
    fixed, original = load_target(str(out / "model.py")), load_target(NANOGPT)
    assert fixed.model.lm_head.weight is fixed.model.wte.weight            # still tied, both padded to 72 rows
    assert tuple(fixed.model.lm_head.weight.shape) == (72, 32)
    # weights.pt holds the user's shapes: it loads into the original class, and the outputs are the original's.
    original.model.load_state_dict(torch.load(out / "weights.pt", weights_only=True))
    assert torch.equal(fixed.model(*fixed.args), original.model(*fixed.args))


class _ExportOnly(torch.nn.Module):
    """A -1e9 mask (AMP401 under float16) in a submodule of a model torch.fx cannot trace (a slice by x.size())."""

    class Attn(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("tri", torch.tril(torch.ones(8, 8)))

        def forward(self, x):
            t = x.size(1)
            return torch.softmax(x.masked_fill(self.tri[:t, :t] == 0, -1e9), -1)

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.attn = self.Attn()

    def forward(self, x):
        return self.attn(self.proj(x))


class _DispatchOnly(_ExportOnly):
    def forward(self, x):
        if x.sum() > -1e6:               # data-dependent: neither fx nor export capture it
            return self.attn(self.proj(x))
        return x


@pytest.mark.parametrize("cls, capture", [(_ExportOnly, "export"), (_DispatchOnly, "dispatch")])
def test_fix_islands_on_an_untraceable_model_are_modules_kept_in_fp32(cls, capture):
    torch.manual_seed(0)
    model, x = cls(), torch.randn(2, 8, 8)
    result = ampaudit.fix(model, x, device="cpu", dtype="float16")
    assert result.form == "modules" and result.plan.keep == ["attn"]
    assert result.report.before.capture == capture
    v = result.report.verification
    assert v.before.error and v.after.error is None and v.fp32_bitwise and not v.remaining
    assert getattr(result.module.attn, "_ampaudit_keep_fp32", False) and not hasattr(model.attn, "_ampaudit_keep_fp32")
    assert "1 module(s) kept in fp32" in result.report.to_text()


def test_no_rule_recommends_what_does_not_run_on_an_untraceable_model():
    model = torch.nn.Linear(4, 4)
    for rule in load_rules([]):
        texts = [rule.fix] + [v.get("fix") for v in rule.params.get("variants", {}).values()]
        for text in filter(None, texts):
            for module in ("blocks.0.attn", ""):          # a submodule, the top module's own forward
                routed = untraceable(text.replace("{module}", module), module)
                cmds, calls = recommendations([routed])
                # Where the module-level fix does not cover a finding, fix runs on it only as the source fix.
                assert all(opts in ("--diff", "--write") for sub, opts in cmds if sub == "fix"), (rule.id, routed)
                for call in calls:           # the eager call each names runs on any model
                    eval(call.replace("'blocks.0.attn'", "''"), {"ampaudit": ampaudit, "model": model})


def test_which_findings_keep_the_graph_rewrite_commands():
    from ampaudit.findings import Finding

    def finding(kind, module, op):
        return Finding(rule="AMP000", name="x", family="x", severity="warning", module=module, op=op, message="",
                       autofix={"kind": kind})
    assert module_fixable(finding("island", "h.0.attn", "masked_fill"))
    assert not module_fixable(finding("island", "", "exp"))               # the whole model would be the island
    assert module_fixable(finding("pad", "lm_head", "linear")) and module_fixable(finding("pad", "wte", "embedding"))
    assert module_fixable(finding("pad", "conv", "conv2d"))
    assert not module_fixable(finding("pad", "up", "conv_transpose2d"))


NORMALIZE = """import torch
import torch.nn.functional as F
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.register_buffer("tri", torch.tril(torch.ones(8, 8)))

    def forward(self, x):
        t = x.size(1)                      # a slice by it: torch.fx cannot trace this
        return F.normalize(self.fc(x) * self.tri[:t, :t].sum(), dim=-1)


def build_model():
    torch.manual_seed(0)
    return Net()


def example_inputs():
    return (torch.randn(2, 8, 16),)
"""


def test_the_source_fix_maps_an_export_captured_default_eps_to_its_call(tmp_path):
    # torch.export decomposes F.normalize: its 1e-12 meets an aten clamp_min the line does not call.
    target = tmp_path / "normalize.py"
    target.write_text(NORMALIZE)
    res = runner.invoke(app, ["fix", str(target), "--diff", "--device", "cpu", "--dtype", "float16"])
    assert res.exit_code == 1, res.output                     # 1: there is a diff
    assert "+        return F.normalize((self.fc(x) * self.tri[:t, :t].sum()).float(), dim=-1)" in res.output
    assert "AMP402" in res.output and "not fixed" not in res.output


class _ConvExportOnly(torch.nn.Module):
    """36-channel convs (AMP102) behind a slice by x.size(): torch.fx cannot trace it."""

    def __init__(self):
        super().__init__()
        self.stem = torch.nn.Conv2d(3, 36, 3, padding=1)
        self.body = torch.nn.Conv2d(36, 36, 3, padding=1)
        self.register_buffer("scale", torch.ones(64))

    def forward(self, x):
        return self.body(torch.relu(self.stem(x))) * self.scale[: x.size(-1)]


def test_fix_pads_convs_of_an_export_captured_model_by_hooks():
    torch.manual_seed(0)
    model, x = _ConvExportOnly(), torch.randn(2, 3, 8, 8)
    result = ampaudit.fix(model, x, device="cpu", dtype="bfloat16", pad=True)
    assert result.form == "modules" and result.report.before.capture == "export"
    assert result.plan.pad["body"] == {"in_channels": 40, "out_channels": 40}
    assert tuple(result.module.body.weight.shape) == (40, 40, 3, 3)
    assert result.report.verification.fp32_ok and not result.report.verification.remaining
    # The user's shapes in state_dict: it loads into the original class, and the outputs are the original's.
    fresh = _ConvExportOnly()
    fresh.load_state_dict(result.module.state_dict())
    assert torch.allclose(fresh(x), result.module(x), rtol=1e-6, atol=1e-6)
