"""A file that is missing, empty, binary or of the wrong kind is one ``error:`` line and exit 2, before any work,
for report, rules and the config files every command reads."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

import ampaudit.cli.commands  # noqa: F401  registers the commands
from ampaudit.cli.app import app

RUN = str(Path(__file__).parent / "assets" / "report_run.jsonl")
BINARY = bytes(range(128, 256)) * 4         # not UTF-8 from its first byte


def invoke(*args: str):
    return CliRunner(env={"COLUMNS": "160"}).invoke(app, list(args))


def one_line(r, *pieces: str) -> None:
    assert r.exit_code == 2, r.output
    assert r.stderr.startswith("error: ") and r.stderr.count("\n") == 1, r.stderr
    assert all(p in r.stderr for p in pieces), r.stderr
    assert "Traceback" not in r.output and "unexpected" not in r.stderr


def test_report_of_a_folder_says_folder(tmp_path):
    one_line(invoke("report", str(tmp_path)), "is a folder, not a trace")


def test_report_of_one_json_line_that_is_no_event_is_refused(tmp_path):
    # a whole JSON line is not what a killed run leaves (that is cut off): exit 2, not an empty report
    (tmp_path / "one.jsonl").write_text('{"a": 1}\n')
    one_line(invoke("report", str(tmp_path / "one.jsonl")), "its line is JSON but not an event")


def test_report_of_check_findings_points_to_check(tmp_path):
    path = tmp_path / "findings.json"
    path.write_text(json.dumps({"findings": [], "target": "model.py"}, indent=2))
    one_line(invoke("report", str(path)), "holds findings from ampaudit check", f"--check {path}")


def test_a_run_killed_at_its_first_line_still_reports(tmp_path):
    (tmp_path / "killed.jsonl").write_text('{"event": "step", "step": 1, "lo')
    r = invoke("report", str(tmp_path / "killed.jsonl"))
    assert r.exit_code == 0 and "truncated" in r.output


@pytest.mark.parametrize("flag,kind", [("--html", "folder"), ("--tensorboard", "file")])
def test_report_refuses_a_wrong_kind_of_output_before_the_work(tmp_path, flag, kind):
    out = tmp_path / "out"
    out.mkdir() if kind == "folder" else out.write_text("x")
    if flag == "--html":
        pytest.importorskip("plotly")
    else:
        pytest.importorskip("tensorboard")
    r = invoke("report", RUN, flag, str(out))
    one_line(r, f"{flag} {out} is a {kind}")
    assert r.stdout == ""       # refused before the summary, not after it


def test_train_refuses_a_tensorboard_file_before_training(tmp_path):
    pytest.importorskip("tensorboard")
    (tmp_path / "tb").write_text("x")
    r = invoke("train", "no_model_needed.py", "--steps", "1", "--trace", str(tmp_path / "t.jsonl"),
               "--tensorboard", str(tmp_path / "tb"))
    one_line(r, "--tensorboard", "is a file, not a folder")


def test_a_binary_rule_file_is_one_line(tmp_path):
    (tmp_path / "blob.toml").write_bytes(BINARY)
    one_line(invoke("rules", "--rules", str(tmp_path)), "blob.toml: not UTF-8 text")


def test_a_folder_named_like_a_rule_file_is_one_line(tmp_path):
    (tmp_path / "x.toml").mkdir()
    one_line(invoke("rules", "list", "--rules", str(tmp_path)), "x.toml is a folder")


def test_a_binary_train_config_is_one_line(tmp_path):
    (tmp_path / "run.toml").write_bytes(BINARY)
    one_line(invoke("train", "model.py", "--config", str(tmp_path / "run.toml"), "--steps", "1"),
             "cannot read it as TOML")


def test_a_binary_pyproject_is_one_line(tmp_path):
    (tmp_path / "pyproject.toml").write_bytes(BINARY)
    (tmp_path / "model.py").write_text("import torch\nmodel = torch.nn.Linear(8, 8)\n")
    one_line(invoke("check", str(tmp_path / "model.py")), "pyproject.toml: invalid TOML")
