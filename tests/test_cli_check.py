"""`ampaudit check` and `ampaudit rules` through typer's CliRunner: formats, exit codes, options, bad input."""
from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

import ampaudit.cli.commands  # noqa: F401  registers the commands
from ampaudit.cli.app import app

from conftest import ASSETS, PLANTED, ROOT

runner = CliRunner()
SCHEMA = ROOT.parent / "shared" / "reference" / "sarif-schema-2.1.0.json"
if not SCHEMA.is_file():  # the official schema, copied for a bare clone
    SCHEMA = ASSETS / "sarif-schema-2.1.0.json"

CLEAN = """import torch
from torch import nn
def build_model():
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64))
def example_inputs():
    return (torch.randn(8, 64),)
"""

MISALIGNED = """import torch
from torch import nn
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(64, 100)
        self.out = nn.Linear(100, 64)
    def forward(self, x):
        h = self.fc(x)  # ampaudit: ignore[AMP101]
        return torch.softmax(self.out(h), -1)
def build_model():
    return Net()
def example_inputs():
    return (torch.randn(8, 64),)
"""


def run(*args: str):
    return runner.invoke(app, list(args))


@pytest.fixture
def clean(tmp_path):
    p = tmp_path / "clean.py"
    p.write_text(CLEAN)
    return p


@pytest.fixture
def misaligned(tmp_path):
    p = tmp_path / "mis.py"
    p.write_text(MISALIGNED)
    return p


def test_clean_model_exits_0(clean):
    r = run("check", str(clean))
    assert r.exit_code == 0, r.output
    assert "No findings" in r.output


def test_findings_exit_1_and_fail_on(misaligned):
    assert run("check", str(misaligned)).exit_code == 1
    assert run("check", str(misaligned), "--fail-on", "error").exit_code == 0
    assert run("check", str(misaligned), "--fail-on", "never").exit_code == 0


def test_json_contract(misaligned):
    r = run("check", str(misaligned), "--format", "json", "--device", "cpu")
    doc = json.loads(r.output)
    assert {"version", "target", "capture", "policy", "findings", "summary"} <= doc.keys()
    assert doc["capture"] == "fx" and doc["policy"] == {"device": "cpu", "dtype": "float16"}
    for f in doc["findings"]:
        assert {"rule", "family", "severity", "module", "op", "message", "location", "fix"} <= f.keys()
        assert f["family"] in ("alignment", "sensitive-op", "normalization", "constant", "range", "nonfinite", "divergence")
    softmax = [f for f in doc["findings"] if f["op"] == "softmax"]
    assert softmax and softmax[0]["location"]["line"] == 10 and softmax[0]["module"] == ""


def test_ignore_comment_suppresses_only_that_line(misaligned):
    doc = json.loads(run("check", str(misaligned), "-f", "json").output)
    modules = {(f["rule"], f["module"]) for f in doc["findings"]}
    assert ("AMP101", "fc") not in modules and ("AMP101", "out") in modules
    assert doc["summary"]["suppressed"] == 1


def test_select_and_ignore(misaligned):
    doc = json.loads(run("check", str(misaligned), "-f", "json", "--select", "sensitive-op", "--device", "cpu").output)
    assert doc["findings"] and all(f["family"] == "sensitive-op" for f in doc["findings"])
    doc = json.loads(run("check", str(misaligned), "-f", "json", "--ignore", "AMP1,AMP2").output)
    assert doc["findings"] == []
    r = run("check", str(misaligned), "--select", "AMP999")
    assert r.exit_code == 2 and "matches no rule" in r.output


def test_sarif_validates_against_official_schema(misaligned, tmp_path):
    jsonschema = pytest.importorskip("jsonschema")
    if not SCHEMA.is_file():
        pytest.skip("SARIF schema not found")
    out = tmp_path / "out.sarif"
    r = run("check", str(misaligned), "--format", "sarif", "-o", str(out))
    assert r.exit_code == 1
    doc = json.loads(out.read_text())
    jsonschema.validate(doc, json.loads(SCHEMA.read_text()))
    results = doc["runs"][0]["results"]
    assert results and all("partialFingerprints" in x for x in results)
    rule_ids = [d["id"] for d in doc["runs"][0]["tool"]["driver"]["rules"]]
    assert all(rule_ids[x["ruleIndex"]] == x["ruleId"] for x in results)


def test_output_file_is_written(misaligned, tmp_path):
    out = tmp_path / "report.txt"
    run("check", str(misaligned), "-o", str(out))
    assert "AMP101" in out.read_text()


def test_output_makes_missing_folders_and_refuses_a_folder_or_a_path_under_a_file(clean, tmp_path):
    # As report --html and plan -o: folders above the file are created; a folder, or a path under a file, is one
    # error line before the audit runs.
    out = tmp_path / "new" / "deeper" / "report.json"
    r = run("check", str(clean), "-f", "json", "-o", str(out))
    assert r.exit_code == 0 and json.loads(out.read_text())["findings"] == []
    for bad, words in [(tmp_path, "is a folder, not a file"), (clean / "report.json", "is a file, not a folder")]:
        r = run("check", str(clean), "-o", str(bad))
        assert r.exit_code == 2 and words in r.output and r.output.count("\n") == 1, r.output


def test_pyproject_config(tmp_path, misaligned):
    (tmp_path / "pyproject.toml").write_text('[tool.ampaudit]\ndevice = "cpu"\nignore = ["AMP101"]\nfail-on = "error"\n')
    r = run("check", str(misaligned), "-f", "json")
    doc = json.loads(r.output)
    assert r.exit_code == 0 and doc["policy"]["device"] == "cpu"
    assert all(f["rule"] != "AMP101" for f in doc["findings"])
    (tmp_path / "pyproject.toml").write_text('[tool.ampaudit]\ncolour = "red"\n')
    r = run("check", str(misaligned))
    assert r.exit_code == 2 and "unknown key 'colour'" in r.output


def test_user_rules_dir(tmp_path, misaligned):
    rules = tmp_path / "myrules"
    rules.mkdir()
    (rules / "tanh.toml").write_text(
        '[[rule]]\nid = "X100"\nname = "my-softmax"\nfamily = "sensitive-op"\nseverity = "error"\n'
        'matcher = "reduced_precision_op"\nops = ["softmax"]\nmessage = "{op} in {compute_dtype}"\nwhy = "mine"\n')
    doc = json.loads(run("check", str(misaligned), "-f", "json", "--rules", str(rules), "--device", "cpu",
                         "--select", "X100").output)
    assert [f["rule"] for f in doc["findings"]] == ["X100"]


@pytest.mark.parametrize("body, words", [
    ('[[rule]]\nid = "X1"\n', ["missing key 'name'"]),
    ('[[rule]]\nid = "X1"\nname = "a"\nfamily = "bogus"\nseverity = "info"\nmatcher = "constants"\nmessage = "m"\nwhy = "w"\n',
     ["key 'family'"]),
    ('[[rule]]\nid = "X1"\nname = "a"\nfamily = "constant"\nseverity = "info"\nmatcher = "constants"\nmessage = "{nope}"\nwhy = "w"\n',
     ["unknown field", "nope"]),
    ("[[rule]\n", ["invalid TOML"]),
])
def test_malformed_rule_file_names_file_and_key(tmp_path, misaligned, body, words):
    rules = tmp_path / "bad_rules"
    rules.mkdir()
    (rules / "broken.toml").write_text(body)
    r = run("check", str(misaligned), "--rules", str(rules))
    assert r.exit_code == 2
    assert "broken.toml" in r.output and all(w in r.output for w in words), r.output
    assert "Traceback" not in r.output


@pytest.mark.parametrize("name, words", [
    ("missing.py", "not found"),
    ("syntax_error.py", "syntax error"),
    ("no_model.py", "--entry"),
    ("factory_raises.py", "raised ValueError"),
    ("inputs_mismatch.py", "do not fit"),
])
def test_bad_inputs_one_line_exit_2(name, words):
    r = run("check", str(ASSETS / "bad" / name))
    assert r.exit_code == 2, r.output
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], r.output


@pytest.mark.parametrize("args, words", [
    (["--device", "tpu"], "unknown device"),
    (["--dtype", "int4"], "unknown dtype"),
    (["--format", "xml"], "unknown --format"),
    (["--fail-on", "bad"], "unknown --fail-on"),
    (["--input", "8xx"], "cannot read --input"),
    (["--input", "8xabc"], "cannot read --input '8xabc'"),
    (["--input", "8x3:float99"], "unknown dtype 'float99'"),
])
def test_bad_options(clean, args, words):
    r = run("check", str(clean), *args)
    assert r.exit_code == 2 and words in r.output


def test_example_inputs_of_the_wrong_kind_exit_2(tmp_path):
    p = tmp_path / "net.py"
    p.write_text(CLEAN.replace("return (torch.randn(8, 64),)", 'return "hello"'))
    r = run("check", str(p))
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert r.exit_code == 2 and len(lines) == 1, r.output
    assert "example_inputs() in net.py returned str; expected a tuple of tensors" in lines[0]


def test_rules_list_and_explain():
    r = run("rules")
    assert r.exit_code == 0 and "AMP101" in r.output and "AMP401" in r.output
    r = run("rules", "explain", "AMP401")
    assert r.exit_code == 0 and "Why:" in r.output and "Fix:" in r.output
    r = run("rules", "explain", "AMP999")
    assert r.exit_code == 2 and "unknown rule" in r.output


@pytest.mark.slow
@pytest.mark.skipif(not PLANTED.is_dir(), reason="planted models absent")
def test_python_dash_m(tmp_path):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "ampaudit", "check", str(PLANTED / "misaligned_mlp.py"), "-f", "json"],
                       capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 1 and json.loads(r.stdout)["findings"]


def test_untraceable_model_falls_back_and_fx_only_names_the_line():
    path = str(ASSETS / "bad" / "untraceable.py")
    r = run("check", path, "-f", "json", "--fail-on", "never")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert doc["capture"] == "dispatch" and any("fx" in n for n in doc["notes"])
    r = run("check", path, "--capture", "fx")
    assert r.exit_code == 2 and "untraceable.py:11" in r.output
    r = run("check", path, "--capture", "bogus")
    assert r.exit_code == 2 and "unknown capture mode" in r.output


def test_numpy_is_declared():
    # torch's CPU wheel does not need numpy, yet warns "Failed to initialize NumPy" at import without it: a fresh
    # `pip install ampaudit` must bring numpy along, or every command starts with that warning.
    import re
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(re.match(r"numpy\b", d) for d in deps), deps


@pytest.mark.slow
def test_cli_prints_no_warning(clean, tmp_path):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-W", "default", "-m", "ampaudit", "check", str(clean)],
                       capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "Warning" not in r.stderr and not r.stderr.strip(), r.stderr


def test_inputs_that_do_not_fit_the_forward_exit_2(tmp_path):
    p = tmp_path / "net.py"
    p.write_text("import torch\nfrom torch import nn\ndef build_model():\n    return nn.Linear(4, 4)\n"
                 "def example_inputs():\n    return (torch.randn(2, 7),)\n")
    r = run("check", str(p))
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert r.exit_code == 2 and len(lines) == 1, r.output
    assert lines[0].startswith("error: example inputs do not fit the forward: linear")
    assert "mat1 and mat2 shapes cannot be multiplied (2x7 and 4x4)" in lines[0] and "--input" in lines[0]


@pytest.mark.parametrize("capture", ["fx", "export", "dispatch"])
def test_bare_torch_module_findings_point_at_no_caller_frame(tmp_path, capture):
    # nn.Linear runs no user code: its findings must not be located in whatever called the audit (typer, pytest).
    p = tmp_path / "net.py"
    p.write_text("import torch\nfrom torch import nn\ndef build_model():\n    return nn.Linear(30, 64)\n"
                 "def example_inputs():\n    return (torch.randn(8, 30),)\n")
    r = run("check", str(p), "-f", "json", "--capture", capture)
    findings = json.loads(r.output)["findings"]
    assert findings and all(f["location"] is None for f in findings), findings
