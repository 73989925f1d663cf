"""Decisions flipped by precision, end to end: `check --calibrate` (AMP702) and `train --trace` + `report` name the
planted culprits (tests/planted, EXPECT["decisions"]) with the op, source line and share; a model whose decisions
precision does not flip (fp32 router, integer causal mask, a returned argmax: tests/assets/decisions_healthy.py)
gets neither."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import ampaudit
import ampaudit.cli.commands  # noqa: F401  registers the commands
from ampaudit.cli.app import app
from ampaudit.report.trace_summary import summarize
from ampaudit.runtime.trace import read_trace

from conftest import ASSETS, load_module

PLANTED = Path(__file__).resolve().parent / "planted"
DECISION_MODELS = sorted(p for p in PLANTED.glob("*.py") if "decisions" in load_module(p).EXPECT)
HEALTHY = ASSETS / "decisions_healthy.py"


def _cli(*args: str):
    return CliRunner(env={"COLUMNS": "200"}).invoke(app, list(args))


def test_there_is_a_planted_model_per_decision_kind():
    assert {load_module(p).EXPECT["decisions"]["op"] for p in DECISION_MODELS} >= {"topk", "round", "gt", "argmin"}


@pytest.mark.parametrize("path", DECISION_MODELS, ids=lambda p: p.stem)
def test_calibrate_names_the_culprit_with_its_share(path):
    m = load_module(path)
    want = m.EXPECT["decisions"]
    report = ampaudit.check(m.build_model(), *m.example_inputs(), **m.EXPECT["target"], calibrate=True)
    hits = [f for f in report.findings if f.rule == "AMP702"]
    assert hits and hits[0].module == m.EXPECT["culprit"] and hits[0].severity == "warning"
    assert hits[0].family in m.EXPECT["families"]
    share = float(hits[0].message.split("%", 1)[0]) / 100
    assert share >= want["min_share"] and f"decisions of {want['op']} at " in hits[0].message
    assert hits[0].location["line"] and path.name in hits[0].location["file"]


def test_calibrate_is_quiet_on_decisions_precision_does_not_flip():
    m = load_module(HEALTHY)
    report = ampaudit.check(m.build_model(), *m.example_inputs(), device="cpu", dtype="bfloat16", calibrate=True)
    assert not [f for f in report.findings if f.family == "divergence"], report.to_dict()["findings"]


def test_cli_check_calibrate_prints_the_finding():
    path = PLANTED / "moe_router_bf16.py"
    r = _cli("check", str(path), "--calibrate", "--device", "cpu", "--dtype", "bfloat16", "--format", "json")
    found = [f for f in json.loads(r.stdout)["findings"] if f["rule"] == "AMP702"]
    assert found and found[0]["module"] == "moe.router" and "rows pick another top-k set" in found[0]["message"]


def _train(path: Path, trace: Path) -> list[dict]:
    r = _cli("train", str(path), "--steps", "2", "--device", "cpu", "--dtype", "bfloat16", "--trace", str(trace),
             "--divergence-every", "2")
    assert r.exit_code == 0, r.output
    events, problems = read_trace(trace)
    assert not problems and events[0]["version"] >= 3     # decision came with version 3
    return events


@pytest.mark.parametrize("path", DECISION_MODELS, ids=lambda p: p.stem)
def test_train_trace_and_report_name_the_culprit(path, tmp_path):
    m = load_module(path)
    events = _train(path, tmp_path / "run.jsonl")
    dec = [e for e in events if e["event"] == "decision" and e["module"] == m.EXPECT["culprit"]]
    assert dec and dec[0]["op"] == m.EXPECT["decisions"]["op"] and dec[0]["used"] and dec[0]["step"] == 2
    assert dec[0]["share_flipped"] >= m.EXPECT["decisions"]["min_share"] / 2     # another batch, trained weights
    recs = [r for r in summarize(events)["recommendations"] if r["kind"] == "decisions"]
    assert recs and recs[0]["modules"][0] == m.EXPECT["culprit"] and path.name in recs[0]["message"]
    out = _cli("report", str(tmp_path / "run.jsonl")).output
    assert "Decisions vs FP32" in out and m.EXPECT["culprit"] in out and "keep_fp32" in out


@pytest.mark.slow     # a calibrated check, a traced run and a report
def test_report_confirms_the_check_finding(tmp_path):
    path = PLANTED / "moe_router_bf16.py"
    events = _train(path, tmp_path / "run.jsonl")
    checked = _cli("check", str(path), "--calibrate", "--device", "cpu", "--dtype", "bfloat16", "--format", "json")
    findings = json.loads(checked.stdout)["findings"]
    (rec,) = [r for r in summarize(events, findings=findings)["recommendations"] if r["kind"] == "confirmed_findings"]
    assert [(f["rule"], f["module"]) for f in rec["findings"]] == [("AMP702", "moe.router")]
    assert "topk decisions differ from FP32 at step 2" in rec["findings"][0]["evidence"]


def test_train_and_report_are_quiet_on_the_healthy_model(tmp_path):
    events = _train(HEALTHY, tmp_path / "run.jsonl")
    dec = [e for e in events if e["event"] == "decision"]
    assert {e["op"] for e in dec} == {"topk", "gt", "argmax"}           # measured: the integer mask is not
    summary = summarize(events)
    assert not summary["decisions"]["flagged"] and not [r for r in summary["recommendations"]
                                                        if r["kind"] == "decisions"]


def test_watch_skips_later_checks_of_a_model_without_decisions():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    w = ampaudit.watch(model, dtype=torch.bfloat16, divergence_every=1)
    for step in range(3):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(torch.randn(4, 8)).float().sum().backward()
    w.close()
    assert w._decisions.checks == 1 and w._decisions.idle
    assert not [e for e in w.events if e["event"] == "decision"]


def test_html_page_lists_the_flipped_site(tmp_path):
    pytest.importorskip("plotly")
    from ampaudit.report.html import build_html

    events = _train(PLANTED / "fake_quant_round_bf16.py", tmp_path / "run.jsonl")
    page = build_html(events, trace="run.jsonl")
    assert "<td>decisions</td>" in page and "<b>quant</b> round_" not in page and "<b>quant</b> round" in page


def test_a_decision_check_that_raises_warns_and_training_goes_on(monkeypatch):
    from ampaudit.runtime import decision_record

    def broken(*a, **k):
        raise RuntimeError("no kernel for this")

    monkeypatch.setattr(decision_record, "measure_decisions", broken)
    model = torch.nn.Linear(8, 2)
    w = ampaudit.watch(model, dtype=torch.bfloat16, divergence_every=1)
    with pytest.warns(decision_record.DecisionCheckWarning, match="decision check at step 0 failed"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(torch.randn(4, 8)).float().sum().backward()
    w.close()
    assert [e for e in w.events if e["event"] == "divergence"] and not [e for e in w.events if e["event"] == "decision"]


@pytest.mark.parametrize("dtype, measured", [(torch.float32, 1), (torch.bfloat16, 0)])
def test_a_half_model_gets_no_decision_check(dtype, measured, monkeypatch):
    from ampaudit.runtime import decision_record

    calls = []
    monkeypatch.setattr(decision_record, "measure_decisions", lambda *a, **k: calls.append(1) or [])
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)).to(dtype)
    w = ampaudit.watch(model, dtype=torch.bfloat16, divergence_every=1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.randn(4, 8, dtype=dtype))
    w.close()
    assert len(calls) == measured
