"""`ampaudit train --trace` + `ampaudit report` warn on attention-logit growth before the loss breaks, and stay quiet
on stable runs (tests/planted/attn_logit_growth.py, samples/char_transformer.py).

The loss "breaks" at the first step (after the first 10) that is not finite, spikes (the report's OLMo 2 score), or
rises above 1.5x the best loss so far: the growing run's loss doubles and never returns to its best."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

import ampaudit.cli.commands  # noqa: F401  registers the commands
from ampaudit.cli.app import app
from ampaudit.runtime.trace import read_trace
from conftest import load_module

ROOT = Path(__file__).resolve().parents[1]
PLANTED = ROOT / "tests" / "planted" / "attn_logit_growth.py"


def _train_and_report(tmp_path: Path, target: Path, *args: str) -> tuple[list[dict], dict]:
    trace = tmp_path / "run.jsonl"
    runner = CliRunner(env={"COLUMNS": "160"})
    res = runner.invoke(app, ["train", str(target), "--device", "cpu", "--dtype", "bfloat16", "--trace", str(trace),
                              "--save", str(tmp_path / "w.pt"), *args])
    assert res.exit_code == 0, res.output
    rep = runner.invoke(app, ["report", str(trace), "--json"])
    assert rep.exit_code == 0, rep.output
    return read_trace(trace)[0], json.loads(rep.output)


def _loss_breaks(events: list[dict], summary: dict) -> int | None:
    best, found = math.inf, []
    for e in events:
        if e["event"] != "step":
            continue
        loss = float(e["loss"]) if not isinstance(e["loss"], str) else math.nan
        if e["step"] > 10 and (not math.isfinite(loss) or loss > 1.5 * best):
            found.append(e["step"])
            break
        best = min(best, loss)
    if summary["precursors"]["diverged_step"] is not None:
        found.append(summary["precursors"]["diverged_step"])
    return min(found) if found else None


def _precursor_recs(summary: dict) -> list[dict]:
    return [r for r in summary["recommendations"] if r["kind"] in ("precursor", "loss_spike")]


@pytest.mark.slow
def test_growing_attention_logits_are_warned_before_the_loss_breaks(tmp_path):
    events, summary = _train_and_report(tmp_path, PLANTED, "--steps", "34")
    broke = _loss_breaks(events, summary)
    assert broke is not None, "the planted run did not break: the fault is not there"
    warned = [r for r in summary["recommendations"] if r["kind"] == "precursor" and r["signal"] == "attn_logit"]
    assert warned, summary["recommendations"]
    rec = warned[0]
    assert rec["step"] < broke, (rec["step"], broke)
    expect = load_module(PLANTED).EXPECT
    assert rec["severity"] == "warning" and set(rec["modules"]) <= set(expect["culprits"])
    assert rec["message"].startswith(f"attention logits grow in {expect['culprit']}:")   # the first to cross
    assert "qk-layernorm" in rec["message"] and f"step {rec['step']}" in rec["message"]
    # The event behind it: written through scaled_dot_product_attention, whose logits are never materialized.
    rows = [e for e in events if e["event"] == "precursor" and e["signal"] == "attn_logit"]
    assert {e["module"] for e in rows} == {"blocks.0.attn", "blocks.1.attn"}
    first = min((e for e in rows if e["crossed_step"] is not None), key=lambda e: e["crossed_step"])
    assert first["crossed_step"] == rec["step"] and first["value"] >= 100 and first["threshold"] == 100


@pytest.mark.slow     # a 60-step training run: ~2 s
def test_same_model_at_a_low_learning_rate_stays_quiet(tmp_path):
    events, summary = _train_and_report(tmp_path, PLANTED, "--steps", "34", "--lr", "0.02")
    assert _loss_breaks(events, summary) is None
    assert not _precursor_recs(summary), summary["recommendations"]
    logits = [e["value"] for e in events if e["event"] == "precursor" and e["signal"] == "attn_logit"]
    assert logits and max(logits) < 10          # the margin the threshold's comment in precursors.toml states


@pytest.mark.slow     # a 60-step training run
def test_qk_layernorm_keeps_the_logits_bounded_at_the_same_learning_rate(tmp_path):
    events, summary = _train_and_report(tmp_path, PLANTED, "--steps", "20", "--entry", "build_qknorm_model")
    logits = [e["value"] for e in events if e["event"] == "precursor" and e["signal"] == "attn_logit"]
    assert logits and max(logits) < 100
    assert not [r for r in summary["recommendations"] if r.get("signal") == "attn_logit"]


def test_sample_transformer_short_run_stays_quiet(tmp_path):
    events, summary = _train_and_report(tmp_path, ROOT / "samples" / "char_transformer.py", "--steps", "30")
    assert not _precursor_recs(summary), summary["recommendations"]
    signals = {e["signal"] for e in events if e["event"] == "precursor"}
    assert {"attn_logit", "output_logit", "output_lse"} <= signals   # materialized softmax and the LM head
    assert max(e["value"] for e in events if e["event"] == "precursor" and e["signal"] == "attn_logit") < 10
