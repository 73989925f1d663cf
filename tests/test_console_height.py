"""The terminal table stays short without losing a fix: a fix clause that rows share is one footnote, infos are
one line each (``--verbose``: in full), "(library)" is said once when every line is a library's; JSON keeps all."""
from __future__ import annotations

import io
import re

from rich.console import Console
from typer.testing import CliRunner

from ampaudit.findings import Finding, Report
from ampaudit.report.console import render_report
from ampaudit.report.fix_notes import FixNotes, clauses

KEEP = "(ampaudit.keep_fp32 or ampaudit fix --calibrate -o DIR)"
FIND = ", or find the op with ampaudit check --calibrate --select nonfinite"


def _finding(rule, severity, module, message, fix, line, library=False):
    return Finding(rule=rule, name="n", family="divergence", severity=severity, module=module, op="op",
                   message=message, fix=fix, location={"file": "net.py", "line": line,
                                                       **({"library": True} if library else {})})


def _report(findings) -> Report:
    return Report(target="net.py", capture="fx", policy={"device": "cuda", "dtype": "float16"}, findings=findings)


def _render(report, **kw) -> str:
    console = Console(width=120, file=io.StringIO(), color_system=None)
    render_report(report, console, **kw)
    return console.file.getvalue()


def _errors(library=False):
    return [_finding("AMP701", "error", m, f"own error against FP32 of {m}", f"keep {m} in fp32 {KEEP}{FIND}", i,
                     library) for i, m in enumerate(("rpn", "roi_heads", "backbone"), 1)]


def _infos(n=6):
    return [_finding("AMP301", "info", f"blocks.{i}.bn", "batch_norm takes float16 input; the kernel computes its "
                     "statistics in fp32 " + "and says so at length " * 6, "keep it", 20 + i) for i in range(n)]


def test_clauses_are_the_long_parenthesised_ones_and_the_trailing_alternative():
    assert clauses(f"keep rpn in fp32 {KEEP}{FIND}") == [KEEP, FIND]
    assert clauses("pad to 8 (short), or not") == []                   # too short to be worth a reference
    nested = "compute it in fp32 (a subclass makes that edit (the line is the library's, never edited))"
    assert clauses(nested) == [nested[nested.index("("):]]
    assert clauses("unbalanced (parenthesis, or a typo") == []


def test_a_clause_two_rows_share_becomes_one_footnote_and_expands_back():
    fixes = [f"keep rpn in fp32 {KEEP}{FIND}", f"keep roi_heads in fp32 {KEEP}", "keep x in fp32 (said only once here)"]
    notes = FixNotes.of(fixes)
    assert notes.footnotes == [KEEP[1:-1]]                             # FIND is in one row only
    assert notes.shorten(fixes[0]) == f"keep rpn in fp32 [1]{FIND}"
    assert notes.shorten(fixes[2]) == fixes[2]
    assert FixNotes.of(fixes[:1]).footnotes == []


def test_every_error_keeps_its_whole_fix_through_the_footnotes():
    report = _report(_errors())
    text = _render(report)
    foot = dict(re.findall(r"^\[(\d+)\] (.+)$", text, re.M))
    assert foot == {"1": KEEP[1:-1], "2": FIND[len(", or "):]}
    assert text.count("--select nonfinite") == 1 and text.count("keep_fp32") == 1
    for f in report.findings:
        row = f"keep {f.module} in fp32 [1], or [2]"
        assert row in text
        expanded = row.replace("[1]", f"({foot['1']})").replace("[2]", foot["2"])
        assert expanded == f.fix
    assert report.to_dict()["findings"][0]["fix"] == report.findings[0].fix    # JSON: the whole fix


def test_infos_are_one_line_each_and_verbose_shows_them_in_full():
    report = _report(_errors() + _infos())
    short, full = _render(report), _render(report, verbose=True)
    (row,) = [ln for ln in short.splitlines() if "AMP301" in ln]
    assert "6x batch_norm takes float16 input" in row and row.rstrip().endswith("…")
    assert "says so at length" not in short.split("AMP301", 1)[1].split("\n", 1)[1]   # no continuation line
    assert "--verbose shows them in full" in short and "--verbose" not in full
    assert "6x in blocks.*.bn (6 modules)" in full and "fix: keep it" in full
    assert len(short.splitlines()) < len(full.splitlines())


def test_library_is_said_once_in_the_header_when_every_line_is_one():
    text = _render(_report(_errors(library=True)))
    assert "where (library)" in text and "(library)" not in text.replace("where (library)", "")
    mixed = _render(_report(_errors(library=True) + [_finding("AMP701", "warning", "head", "m", "f", 9)]))
    assert "where (library)" not in mixed and "net.py:1 (library)" in mixed


def test_check_verbose_on_the_command_line(tmp_path):
    import ampaudit.cli.commands  # noqa: F401  registers the commands
    from ampaudit.cli.app import app

    model = tmp_path / "bn.py"
    model.write_text("import torch\nfrom torch import nn\n\n"
                     "def build_model():\n    return nn.Sequential(*[nn.Sequential(nn.Conv2d(8, 8, 3), nn.BatchNorm2d(8)) "
                     "for _ in range(3)])\n\n"
                     "def example_inputs():\n    return (torch.randn(2, 8, 16, 16),)\n")
    runner = CliRunner()
    short = runner.invoke(app, ["check", str(model), "--device", "cuda"])
    full = runner.invoke(app, ["check", str(model), "--device", "cuda", "--verbose"])
    assert short.exit_code == 0 and full.exit_code == 0, short.output + full.output
    assert "--verbose shows them in full" in short.output and "3x in *.1 (3 modules)" in full.output
