"""`ampaudit report TRACE` on the command line (ampaudit/cli/report.py)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

import ampaudit.cli.commands  # noqa: F401  registers the commands
from ampaudit.cli.app import app

ASSETS = Path(__file__).parent / "assets"
RUN = str(ASSETS / "report_run.jsonl")


def invoke(*args: str):
    # typer runs a lone command without its name; with more commands registered, `report` must be named.
    single = len(app.registered_commands) == 1 and app.registered_callback is None and not app.registered_groups
    argv = list(args) if single else ["report", *args]
    return CliRunner(env={"COLUMNS": "160"}).invoke(app, argv)


def test_terminal_summary():
    r = invoke(RUN)
    assert r.exit_code == 0, r.output
    out = r.stdout
    for text in ("300 (1..300), 8 skipped", "1, 2, 3, 54, 105, 156, 180, 282", "2^12 .. 2^16",
                 "step 180: inf in forward of blocks.1.attn (aten.exp.default) at model.py:42",
                 "Divergence vs FP32", "Headroom", 'ampaudit.keep_fp32(model, ["blocks.1.attn"])',
                 "init_scale=2**13"):
        assert text in out, text
    assert r.stderr == ""


def test_top_limits_tables():
    out = invoke(RUN, "--top", "2").stdout
    assert "worst 2 of 6" in out and "2 of 6)" in out
    assert "blocks.0.attn" not in out.split("Divergence vs FP32")[1].split("Headroom")[0]


def test_json_output_is_the_summary():
    r = invoke(RUN, "--json", "--top", "4")
    assert r.exit_code == 0
    s = json.loads(r.stdout)
    assert s["steps"]["skipped"] == 8 and len(s["divergence"]["top"]) == 4
    assert s["recommendations"][0]["kind"] == "keep_fp32"


def test_check_option_lists_confirmed_findings(tmp_path):
    f = tmp_path / "findings.json"
    f.write_text(json.dumps({"findings": [{"rule": "AMP101", "family": "nonfinite", "module": "blocks.1.attn",
                                           "message": "exp overflows fp16"}]}))
    out = invoke(RUN, "--check", str(f)).stdout
    assert "the run confirmed 1 of 1 check findings" in out and "AMP101 blocks.1.attn" in out


def test_check_says_so_when_the_run_confirms_nothing(tmp_path):
    f = tmp_path / "findings.json"
    f.write_text(json.dumps({"findings": [{"rule": "AMP201", "family": "sensitive-op", "module": "nowhere.near"}]}))
    out = invoke(RUN, "--check", str(f)).stdout
    assert f"--check: the run confirmed none of the 1 finding(s) in {f}" in out


def test_a_one_line_text_file_is_not_a_trace(tmp_path):
    (tmp_path / "notes.txt").write_text("this is not a trace\n")
    r = invoke(str(tmp_path / "notes.txt"))
    assert r.exit_code == 2 and "is not an ampaudit trace" in r.stderr and r.stderr.count("\n") == 1


def test_missing_trace_is_one_line_exit_2(tmp_path):
    r = invoke(str(tmp_path / "nope.jsonl"))
    assert r.exit_code == 2
    assert r.stderr.startswith("error: trace file not found") and r.stderr.count("\n") == 1


def test_only_a_truncated_line_still_reports():
    r = invoke(str(ASSETS / "report_only_truncated.jsonl"))
    assert r.exit_code == 0
    assert "last line truncated" in r.stdout and "no step events" in r.stdout


def test_corrupt_line_is_reported_not_fatal():
    r = invoke(str(ASSETS / "report_corrupt.jsonl"))
    assert r.exit_code == 0
    assert "report_corrupt.jsonl:12: corrupt line, skipped" in r.stdout
    assert "none (no scaler in this run)" in r.stdout


def test_empty_and_binary_files_are_errors(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    r = invoke(str(tmp_path / "empty.jsonl"))
    assert r.exit_code == 2 and "holds no events" in r.stderr
    (tmp_path / "blob.bin").write_bytes(bytes(range(256)) * 40)
    r = invoke(str(tmp_path / "blob.bin"))
    assert r.exit_code == 2 and "is not an ampaudit trace" in r.stderr and r.stderr.count("\n") == 1


def test_bad_findings_file_is_one_line(tmp_path):
    (tmp_path / "f.json").write_text("not json")
    r = invoke(RUN, "--check", str(tmp_path / "f.json"))
    assert r.exit_code == 2 and "is not JSON" in r.stderr and r.stdout == ""


def test_html_is_written(tmp_path):
    pytest.importorskip("plotly")
    out = tmp_path / "sub" / "run.html"
    r = invoke(RUN, "--html", str(out), "--json")
    assert r.exit_code == 0, r.output
    json.loads(r.stdout)  # the "wrote" line goes to stderr so --json stays parseable
    assert f"wrote {out}" in r.stderr
    page = out.read_text()
    assert page.count("Plotly.newPlot") == 5 and "<script src=" not in page
    assert [p.name for p in out.parent.iterdir()] == ["run.html"]  # no temporary file left behind


def test_html_under_a_file_is_one_line_before_the_work(tmp_path):
    pytest.importorskip("plotly")
    r = invoke(RUN, "--html", str(Path(RUN) / "run.html"))
    assert r.exit_code == 2 and "report_run.jsonl is a file, not a folder" in r.stderr and r.stdout == ""
    assert r.stderr.count("\n") == 1


def test_empty_or_non_finding_check_files_are_one_line(tmp_path):
    for text, words in [("[]", "is an empty list, not the output of ampaudit check"),
                        ('[{"module": "a"}]', "entry 0 is not a finding")]:
        (tmp_path / "f.json").write_text(text)
        r = invoke(RUN, "--check", str(tmp_path / "f.json"))
        assert r.exit_code == 2 and words in r.stderr and r.stdout == "" and r.stderr.count("\n") == 1


def test_html_without_plotly_names_the_extra(monkeypatch, tmp_path):
    for name in [m for m in sys.modules if m == "plotly" or m.startswith("plotly.")
                 or m == "ampaudit.report.html_plots"]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "plotly", None)  # makes `import plotly` raise ImportError
    r = invoke(RUN, "--html", str(tmp_path / "x.html"))
    assert r.exit_code == 2
    assert r.stderr.strip() == "error: --html needs plotly, which is not installed; pip install 'ampaudit[report]'"
    assert r.stdout == "" and not (tmp_path / "x.html").exists()


@pytest.mark.parametrize("width", [80, 100, 120])
def test_report_tables_split_no_number_at_any_width(width):
    r = CliRunner(env={"COLUMNS": str(width)}).invoke(app, ["report", RUN])
    assert r.exit_code == 0, r.output
    for number in ("4.191e+04", "0.00451", "0.00213", "10.42", "0.00%"):    # headroom and divergence cells
        assert number in r.stdout.split(), (width, number)
    assert max(map(len, r.stdout.splitlines())) <= width
