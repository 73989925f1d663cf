"""Both paths name the same culprit: `check --calibrate` and `train --trace` + `report` rank the planted composite
culprits (a fault in a composite module's own forward, between or around its children) and the relative outlier
first, and find nothing in clean models. Own errors at every depth (ampaudit.runtime.divergence), one verdict
(ampaudit.runtime.attribution)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

import ampaudit
import ampaudit.cli.commands  # noqa: F401  registers the commands
from ampaudit.cli.app import app

from conftest import load_module

HERE = Path(__file__).resolve().parent
PLANTED = {"attention_logit_offset": "absolute", "norm_around_linear": "absolute", "siamese_difference": "absolute",
           "gated_recurrence_bf16": "absolute",
           "silu_one_minus_sigmoid": "relative"}
CLEAN = sorted((HERE / "assets" / "clean").glob("*.py"))
TARGET = ["--device", "cpu", "--dtype", "bfloat16"]


def _calibrated_divergence(path: Path) -> list:
    m = load_module(path)
    report = ampaudit.check(m.build_model(), *m.example_inputs(), device="cpu", dtype="bfloat16", calibrate=True)
    return [f for f in report.findings if f.family == "divergence"]


def _report(path: Path, tmp_path: Path) -> dict:
    trace = tmp_path / "run.jsonl"
    cli = CliRunner(env={"COLUMNS": "160"})
    r = cli.invoke(app, ["train", str(path), "--steps", "2", *TARGET, "--trace", str(trace), "--divergence-every", "1"])
    assert r.exit_code == 0, r.output
    r = cli.invoke(app, ["report", str(trace), "--json"])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


@pytest.mark.parametrize("name", sorted(PLANTED))
def test_calibrate_ranks_the_culprit_first(name):
    path = HERE / "planted" / f"{name}.py"
    culprit = load_module(path).EXPECT["culprit"]
    div = _calibrated_divergence(path)
    assert [f.module for f in div] == [culprit], [(f.module, f.message) for f in div]
    # A relative-only outlier is a warning with its ratio in the message; the absolute ones keep the line's.
    assert div[0].severity == "warning" if PLANTED[name] == "relative" else div[0].severity in ("warning", "error")
    assert ("median own error" in div[0].message) == (PLANTED[name] == "relative")


@pytest.mark.parametrize("name", sorted(PLANTED))
def test_train_trace_report_ranks_the_same_culprit_first(name, tmp_path):
    path = HERE / "planted" / f"{name}.py"
    culprit = load_module(path).EXPECT["culprit"]
    summary = _report(path, tmp_path)
    div = summary["divergence"]
    assert div["scope"] == "local"
    assert [c["module"] for c in div["culprits"]] == [culprit] and div["culprits"][0]["rule"] == PLANTED[name]
    assert div["top"][0]["module"] == culprit and div["top"][0]["verdict"]["rank"] == 1
    assert div["first_jump"]["module"] == culprit
    keep = [r for r in summary["recommendations"] if r["kind"] == "keep_fp32"]
    assert [r["modules"] for r in keep] == [[culprit]]
    assert ("median own error" in keep[0]["message"]) == (PLANTED[name] == "relative")


@pytest.mark.parametrize("path", CLEAN, ids=lambda p: p.stem)
def test_clean_models_have_no_culprit_in_either_path(path, tmp_path):
    assert _calibrated_divergence(path) == []
    summary = _report(path, tmp_path)
    assert summary["divergence"]["culprits"] == [] and summary["divergence"]["first_jump"] is None
    assert not [r for r in summary["recommendations"] if r["kind"] == "keep_fp32"]


def test_neither_path_judges_a_module_whose_fp32_output_is_rounding_noise(tmp_path):
    """An untrained decoder's GroupNorms on a constant signal (tests/assets/noise_floor/zero_codebook.py): both
    paths measure how far FP32's own rounding moves them (the trace's fp32_moved) and judge neither."""
    path = HERE / "assets" / "noise_floor" / "zero_codebook.py"
    assert _calibrated_divergence(path) == []
    summary = _report(path, tmp_path)
    assert summary["divergence"]["culprits"] == [], summary["divergence"]
    moved = [json.loads(ln).get("fp32_moved") for ln in (tmp_path / "run.jsonl").read_text().splitlines()
             if '"divergence"' in ln and '"local"' in ln]
    assert any(m is not None and m > 0.5 for m in moved), moved
    assert {r["module"] for r in summary["divergence"]["not_judged"]} >= {"norm"}, summary["divergence"]
    text = CliRunner(env={"COLUMNS": "200"}).invoke(app, ["report", str(tmp_path / "run.jsonl")]).output
    assert "not judged: norm" in text and "FP32 does not determine it either" in text, text
    assert "not judged (FP32 floor)" in text, text
