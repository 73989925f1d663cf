"""Every command a report recommends runs on that model: for a model torch.fx cannot trace (nanoGPT, audited
through torch.export), the graph rewrite's commands (fix -o, fix --pad) are replaced by ones that work on it."""
from __future__ import annotations

import json
import re

import pytest
import torch
from conftest import ASSETS
from typer.testing import CliRunner

import ampaudit
import ampaudit.cli.commands  # noqa: F401  registers the commands
from ampaudit.cli.app import app
from ampaudit.rules.engine import untraceable
from ampaudit.rules.loader import load_rules

NANOGPT = str(ASSETS / "nanogpt" / "model.py")
COMMAND = re.compile(r"ampaudit (fix|check|train|plan|report)((?: --?[a-z][\w-]*(?: [A-Z0-9]+)?)*)")
CALL = re.compile(r"ampaudit\.keep_fp32\(model, \[[^\]]*\]\)")
runner = CliRunner()


def recommendations(texts):
    cmds = {(m.group(1), m.group(2).strip()) for t in texts for m in COMMAND.finditer(t or "")}
    return cmds, {m.group(0) for t in texts for m in CALL.finditer(t or "")}


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_every_command_the_nanogpt_report_recommends_runs(device, tmp_path):
    res = runner.invoke(app, ["check", NANOGPT, "--device", device, "-f", "json"])
    report = json.loads(res.stdout)
    assert report["capture"] == "export"
    texts = [f["fix"] for f in report["findings"]] + report["notes"]
    assert any(f["rule"] == "AMP101" and f["module"] == "lm_head" for f in report["findings"])
    cmds, calls = recommendations(texts)
    assert cmds == {("fix", "--diff")}, cmds      # where fix --pad was recommended, and refused
    for sub, opts in cmds:
        run = runner.invoke(app, [sub, NANOGPT, *opts.split(), "--device", device])
        assert run.exit_code == 0, run.output
        assert "fix --pad" not in run.output and "-o DIR" not in run.output
        # On a CPU target alignment is an info (no Tensor Cores), which the source fix leaves without a word.
        assert ("not fixed: AMP101" in run.output) == (device == "cuda"), run.output
    # The graph rewrite itself still refuses the model, and says what runs instead.
    refused = runner.invoke(app, ["fix", NANOGPT, "--pad", "-o", str(tmp_path / "out"), "--device", device])
    assert refused.exit_code == 2 and "ampaudit fix --diff" in refused.output


def test_no_rule_recommends_the_graph_rewrite_for_an_untraceable_model():
    model = torch.nn.Linear(4, 4)
    for rule in load_rules([]):
        texts = [rule.fix] + [v.get("fix") for v in rule.params.get("variants", {}).values()]
        for text in filter(None, texts):
            routed = untraceable(text.replace("{module}", "blocks.0.attn"), "blocks.0.attn")
            cmds, calls = recommendations([routed])
            # fix runs on it only as the source fix; check, train and the rest take any model.
            assert all(opts in ("--diff", "--write") for sub, opts in cmds if sub == "fix"), (rule.id, routed)
            for call in calls:           # the eager call each names runs on any model
                eval(call.replace("'blocks.0.attn'", "''"), {"ampaudit": ampaudit, "model": model})


def test_a_traceable_model_keeps_the_graph_rewrite_recommendation():
    class Head(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lm_head = torch.nn.Linear(32, 65)

        def forward(self, x):
            return self.lm_head(x)

    report = ampaudit.check(Head(), torch.randn(2, 32), device="cuda")
    assert report.capture == "fx"
    assert any("ampaudit fix --pad does this" in (f.fix or "") for f in report.findings)
