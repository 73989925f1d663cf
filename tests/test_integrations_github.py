"""CI integration: `check --format github` annotations and the example code-scanning workflow."""
from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

import ampaudit.cli.commands  # noqa: F401  registers the commands
from ampaudit.cli.app import app
from ampaudit.findings import Finding, Report
from ampaudit.report.github import annotation, escape_data, escape_property, to_github

ROOT = Path(__file__).resolve().parents[1]
WORKFLOW = ROOT / "examples" / "github" / "ampaudit.yml"

from _shared_models import CLEAN_SOURCE as CLEAN, MISALIGNED_SOURCE as MISALIGNED


def _finding(severity: str = "warning", location: dict | None = None, **kw) -> Finding:
    base = dict(rule="AMP101", name="linear-dims-misaligned", family="alignment", severity=severity,
                module="fc1", op="linear", message="Linear 64->50: out_features = 50", location=location,
                fix="pad out_features to 56")
    return Finding(**{**base, **kw})


def test_escaping_follows_the_actions_toolkit():
    assert escape_data("100% done\r\nnext") == "100%25 done%0D%0Anext"
    assert escape_property("a:b,c%d\n") == "a%3Ab%2Cc%25d%0A"
    assert escape_data("%0A") == "%250A"                # escapes are not themselves escaped twice


def test_annotation_has_file_line_title_and_message():
    line = annotation(_finding(location={"file": "models/net.py", "line": 41}))
    assert line == ("::warning file=models/net.py,line=41,title=AMP101 linear-dims-misaligned::"
                    "Linear 64->50: out_features = 50 [module: fc1]%0AFix: pad out_features to 56")


@pytest.mark.parametrize("severity,command", [("error", "::error "), ("warning", "::warning "), ("info", "::notice ")])
def test_severity_maps_to_command(severity, command):
    assert annotation(_finding(severity)).startswith(command)


def test_finding_without_location_and_hostile_text():
    line = annotation(_finding(location=None, module="", message="a, b: c\nd", fix=None))
    assert line == "::warning title=AMP101 linear-dims-misaligned::a, b: c%0Ad [module: <top>]"
    odd = annotation(_finding(location={"file": "dir,x/a:b.py", "line": 0}))
    assert "file=dir%2Cx/a%3Ab.py,line=1," in odd          # commas/colons escaped in properties, line >= 1
    assert odd.count("::") == 2                             # exactly the command and message separators


def test_to_github_one_line_per_finding():
    report = Report(target="t", capture="fx", policy={"device": "cuda", "dtype": "float16"},
                    findings=[_finding("error"), _finding("info")])
    assert to_github(report).splitlines()[0].startswith("::error ")
    assert len(to_github(report).splitlines()) == 2
    assert to_github(Report(target="t", capture="fx", policy={})) == ""


def test_cli_format_github(tmp_path, monkeypatch):
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "net.py").write_text(MISALIGNED)
    (tmp_path / "models" / "clean.py").write_text(CLEAN)
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    bad = runner.invoke(app, ["check", "models/net.py", "--format", "github"])
    assert bad.exit_code == 1, bad.output
    lines = bad.stdout.splitlines()
    assert lines and all(line.startswith("::warning file=models/net.py,line=") for line in lines)
    assert any("title=AMP101 linear-dims-misaligned::" in line for line in lines)
    clean = runner.invoke(app, ["check", "models/clean.py", "--format", "github"])
    assert clean.exit_code == 0 and clean.stdout == ""


def test_example_workflow_runs_check_sarif_and_uploads_it(tmp_path, monkeypatch):
    flow = yaml.safe_load(WORKFLOW.read_text())
    assert flow["permissions"]["security-events"] == "write"
    steps = [s for job in flow["jobs"].values() for s in job["steps"]]
    runs = [s["run"] for s in steps if "ampaudit check" in s.get("run", "")]
    sarif_cmd = next(r for r in runs if "--format sarif" in r)
    upload = next(s for s in steps if str(s.get("uses", "")).startswith("github/codeql-action/upload-sarif"))
    argv = shlex.split(sarif_cmd.strip())
    assert argv[:2] == ["ampaudit", "check"]
    out = argv[argv.index("--output") + 1]
    assert upload["with"]["sarif_file"] == out
    # The workflow's own command, on a model file where it expects one: it writes SARIF code scanning takes.
    target = argv[2]
    (tmp_path / target).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / target).write_text(MISALIGNED)
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, argv[1:])
    assert result.exit_code == 1, result.output
    doc = json.loads((tmp_path / out).read_text())
    assert doc["version"] == "2.1.0" and doc["runs"][0]["results"][0]["ruleId"] == "AMP101"
    assert doc["runs"][0]["results"][0]["locations"][0]["physicalLocation"]["artifactLocation"]["uri"] == target


def test_repeats_on_one_line_are_one_annotation_naming_their_modules():
    loc = {"file": "models/net.py", "line": 12}
    blocks = [_finding(location=loc, module=f"blocks.{i}.fc", message=f"Linear 64->5{i}: out_features = 5{i}")
              for i in range(4)]
    other_line = _finding(location={"file": "models/net.py", "line": 30}, module="head")
    lines = to_github(Report(target="net.py", capture="fx", policy={"device": "cuda", "dtype": "float16"},
                             findings=[*blocks, other_line])).splitlines()
    assert len(lines) == 2
    assert "line=12" in lines[0] and "[4 modules: blocks.*.fc]" in lines[0] and "Linear 64->50" in lines[0]
    assert "line=30" in lines[1] and "[module: head]" in lines[1]
