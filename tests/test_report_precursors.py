"""ampaudit/report/trace_precursors.py and html_precursors.py: precursor rows judged against
rules/policy/precursors.toml, OLMo 2's loss-spike score, the recommendations, the HTML panel, and traces of
version 2 (no precursor events) read as before."""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from ampaudit.report.trace_precursors import loss_spikes
from ampaudit.report.trace_summary import StepRow, summarize
from ampaudit.runtime.trace import read_trace
from trace_events import ev, steps

ASSETS = Path(__file__).parent / "assets"


def _steps(losses):
    return steps(losses)


def _prec(step, signal, module, value, **extra):
    return ev("precursor", step, signal=signal, module=module, value=value, **extra)


def _trace(*events, dtype="bfloat16"):
    return [ev("meta", version=3, dtype=dtype, source="train"), *events]


def test_attention_warning_names_module_step_value_and_fix():
    events = _trace(*_steps([2.0] * 40),
                    _prec(10, "attn_logit", "blocks.0.attn", 12.0, max_step=9, crossed_step=None),
                    _prec(20, "attn_logit", "blocks.0.attn", 450.0, max_step=17, crossed_step=13),
                    _prec(30, "attn_logit", "blocks.0.attn", 2.1e4, max_step=25, crossed_step=17),
                    _prec(20, "attn_logit", "blocks.1.attn", 150.0, max_step=19, crossed_step=19),
                    _prec(20, "attn_logit", "blocks.2.attn", 30.0, max_step=19, crossed_step=None))
    s = summarize(events)
    rows = {r["module"]: r for r in s["precursors"]["signals"]}
    assert rows["blocks.0.attn"]["crossed_step"] == 13 and rows["blocks.0.attn"]["max"] == 2.1e4
    assert rows["blocks.0.attn"]["max_step"] == 25 and rows["blocks.0.attn"]["level"] == "divergence"
    assert rows["blocks.2.attn"]["crossed_step"] is None
    recs = [r for r in s["recommendations"] if r["kind"] == "precursor"]
    assert len(recs) == 1 and recs[0]["signal"] == "attn_logit" and recs[0]["step"] == 13
    assert recs[0]["modules"] == ["blocks.0.attn", "blocks.1.attn"]
    msg = recs[0]["message"]
    assert "blocks.0.attn" in msg and "step 13" in msg and "2.1e+04" in msg and "Also: blocks.1.attn" in msg
    assert "qk-layernorm" in msg and "QK-clip" in msg and "soft-capping" in msg and "lower learning rate" in msg


def test_a_version_2_event_without_crossed_step_uses_its_own_step():
    s = summarize(_trace(*_steps([2.0] * 5), _prec(4, "attn_logit", "attn", 300.0)))
    assert s["precursors"]["signals"][0]["crossed_step"] == 4


def test_output_logits_are_judged_against_the_runs_dtype():
    events = [*_steps([2.0] * 5), _prec(5, "output_logit", "", 100.0), _prec(5, "output_lse", "", 9.0)]
    bf16 = summarize(_trace(*events, dtype="bfloat16"))
    fp16 = summarize(_trace(*events, dtype="float16"))
    rec = [r for r in bf16["recommendations"] if r["kind"] == "precursor"]
    assert rec and rec[0]["signal"] == "output_logit" and "z-loss" in rec[0]["message"]
    assert not [r for r in fp16["recommendations"] if r["kind"] == "precursor"]   # 100 < 512 in fp16


@pytest.mark.parametrize("producer", [None, "lm_head"])
def test_output_logits_name_the_module_that_made_them_where_the_trace_does(producer):
    # Version 6 events carry the module that made the output; older ones (and a tied head's) only "the model's output".
    from io import StringIO

    from rich.console import Console

    from ampaudit.report.trace_console import render_summary

    made = {"producer": producer} if producer else {}
    s = summarize(_trace(*_steps([2.0] * 5), _prec(5, "output_logit", "", 100.0, **made)))
    rec = next(r for r in s["recommendations"] if r["kind"] == "precursor")
    out = StringIO()
    render_summary(s, Console(file=out, width=160))
    if producer:
        assert rec["modules"] == ["lm_head"] and "of lm_head's output (the model's output) crossed" in rec["message"]
        assert "ampaudit.keep_fp32(model, ['lm_head'])" in rec["message"] and "z-loss on lm_head's" in rec["message"]
        assert "lm_head (the output)" in out.getvalue()
    else:
        assert rec["modules"] == [""] and "of the model's output crossed" in rec["message"]
        assert "z-loss: add" in rec["message"] and "keep_fp32" not in rec["message"]
        assert "<output>" in out.getvalue()


def test_massive_activations_need_both_the_size_and_the_ratio():
    events = _trace(*_steps([2.0] * 5),
                    _prec(5, "massive_activation", "blocks.3", 2500.0, absmax=800.0, median=0.32),
                    _prec(5, "massive_activation", "act", 5000.0, absmax=50.0, median=0.01),    # < 100
                    _prec(5, "massive_activation", "mlp", 300.0, absmax=900.0, median=3.0),     # < 1000x
                    _prec(5, "massive_activation", "relu", None, absmax=900.0, median=0.0))     # no ratio
    recs = [r for r in summarize(events)["recommendations"] if r["kind"] == "precursor"]
    assert len(recs) == 1 and recs[0]["modules"] == ["blocks.3"] and "fp8" in recs[0]["message"]


def _massive_recs(*extra, dtype="bfloat16"):
    events = _trace(*_steps([2.0] * 5), *extra,
                    _prec(5, "massive_activation", "blocks.3", 2500.0, absmax=800.0, median=0.32), dtype=dtype)
    return [r for r in summarize(events)["recommendations"] if r["kind"] == "precursor"]


def test_massive_activations_are_an_info_without_fp8_and_a_warning_with_fp8_layers():
    # Massive activations break per-tensor fp8 scaling (Sun et al. 2024): in an fp16/bf16 run they are a note.
    plain = _massive_recs()
    assert [r["severity"] for r in plain] == ["info"]
    assert "matters only for fp8 scaling" in plain[0]["message"] and "no fp8 layers" in plain[0]["message"]
    # A run with torchao Float8Linear layers (fp8 events), an fp8 recipe's statistics, or a float8 header warns.
    for fp8 in (ev("fp8", 5, module="fc1", input={"amax": 2.0, "scale": 224.0, "flushed_share": 0.0}),
                ev("recipe_stats", 5, module="fc1", recipe="mxfp8", sqnr_db=30.0)):
        recs = _massive_recs(fp8)
        assert [r["severity"] for r in recs] == ["warning"], fp8["event"]
        assert "no fp8 layers" not in recs[0]["message"]
    assert [r["severity"] for r in _massive_recs(dtype="float8")] == ["warning"]
    # the other signals warn whatever the run's dtype
    attn = _trace(*_steps([2.0] * 5), _prec(5, "attn_logit", "attn", 300.0))
    assert [r["severity"] for r in summarize(attn)["recommendations"] if r["kind"] == "precursor"] == ["warning"]


def test_loss_spike_score_is_seven_sigma_above_the_rolling_mean():
    rng = random.Random(0)
    losses = [2.0 + rng.gauss(0, 0.01) for _ in range(60)]
    losses[45] = 2.5                                    # ~50 sigma
    rows = [StepRow(i, x, None, False, None, False, None, None) for i, x in enumerate(losses)]
    spikes = loss_spikes(rows)
    assert [s["step"] for s in spikes] == [45] and spikes[0]["sigmas"] > 7
    assert not loss_spikes(rows[:15] + [StepRow(15, 9.0, None, False, None, False, None, None)])   # < min_history
    rows[46] = StepRow(46, 2.05, None, False, None, False, None, None)   # high, but within 7 sigma of the window
    assert [s["step"] for s in loss_spikes(rows)] == [45]
    s = summarize(_trace(*_steps(losses)))
    assert s["precursors"]["diverged_step"] == 46          # step events are numbered from 1 here
    rec = [r for r in s["recommendations"] if r["kind"] == "loss_spike"]
    assert rec and rec[0]["step"] == 46 and "OLMo 2 counts 7" in rec[0]["message"]


def test_a_nonfinite_loss_is_where_the_run_diverged():
    s = summarize(_trace(*_steps([2.0, 1.9, "nan", 1.8])))
    assert s["precursors"]["diverged_step"] == 3


def test_version_2_trace_reads_as_before():
    events, problems = read_trace(ASSETS / "report_run.jsonl")
    s = summarize(events, problems)
    assert s["precursors"]["signals"] == [] and not s["problems"]
    assert not [r for r in s["recommendations"] if r["kind"] in ("precursor", "loss_spike")]
    assert "precursor" not in s["unknown_events"]


def test_html_plots_the_signals_and_says_when_there_are_none():
    pytest.importorskip("plotly")
    from ampaudit.report.html import build_html

    events = _trace(*_steps([2.0] * 30), _prec(10, "attn_logit", "blocks.0.attn", 40.0, max_step=9),
                    _prec(20, "attn_logit", "blocks.0.attn", 400.0, max_step=17, crossed_step=17),
                    _prec(20, "output_logit", "", 9.0, max_step=17), _prec(20, "output_lse", "", 5.0, max_step=17))
    page = build_html(events, [])
    assert 'id="plot-precursors"' in page and "max attention logit" in page and "warning (Kimi K2 cap)" in page
    old, problems = read_trace(ASSETS / "report_run.jsonl")
    assert "id='plot-precursors-empty'" in build_html(old, problems)


def test_figure_has_a_panel_per_signal_family_on_log_axes():
    pytest.importorskip("plotly")
    from ampaudit.report.html_precursors import precursor_figure
    from ampaudit.report.trace_summary import collect

    rng = random.Random(1)
    losses = [2.0 + rng.gauss(0, 0.01) for _ in range(30)] + [9.0]
    events = _trace(*_steps(losses), _prec(10, "attn_logit", "blocks.0.attn", 40.0, max_step=9),
                    _prec(20, "attn_logit", "blocks.0.attn", 400.0, max_step=17, crossed_step=17),
                    _prec(20, "attn_logit", "blocks.1.attn", 20.0, max_step=17),
                    _prec(20, "output_logit", "", 9.0, max_step=17), _prec(20, "output_lse", "", -5.0, max_step=17),
                    _prec(20, "massive_activation", "blocks.0", 2000.0, absmax=300.0, median=0.15, max_step=1))
    fig = precursor_figure(collect(events))
    names = [t.name for t in fig.data]
    assert names == ["max attention logit: blocks.0.attn", "max attention logit: blocks.1.attn",
                     "output logits: top |logit|", "output logits: |log Z|", "|x| max / median: blocks.0"]
    assert list(fig.data[0].x) == [9, 17] and list(fig.data[0].y) == [40.0, 400.0]
    assert list(fig.data[3].y) == [5.0]                       # |log Z| on a log axis
    assert {fig.layout[f"yaxis{i}"].type for i in ("", 2, 3)} == {"log"}
    assert any(shape.x0 == 31 for shape in fig.layout.shapes)  # the loss spike at step 31


def test_the_output_logits_panel_names_the_module_that_made_them():
    pytest.importorskip("plotly")
    from ampaudit.report.html_precursors import precursor_figure
    from ampaudit.report.trace_summary import collect

    events = _trace(*_steps([2.0] * 30), _prec(20, "output_logit", "", 9.0, max_step=17, producer="lm_head"),
                    _prec(20, "output_lse", "", 5.0, max_step=17, producer="lm_head"))
    names = [t.name for t in precursor_figure(collect(events)).data]
    assert names == ["output logits: top |logit| of lm_head", "output logits: |log Z| of lm_head"]
