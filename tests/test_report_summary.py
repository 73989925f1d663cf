"""The trace summary dict and its recommendations (ampaudit/report/trace_summary.py, trace_advice.py)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from rich.console import Console

from ampaudit.errors import InputError, TraceError
from ampaudit.report.trace_advice import load_findings
from ampaudit.report.trace_console import render_summary
from ampaudit.report.trace_summary import collect, num, summarize, summarize_trace
from ampaudit.runtime.trace import TraceWriter
from trace_events import ev

ASSETS = Path(__file__).parent / "assets"


@pytest.fixture(scope="module")
def run_summary() -> dict:
    return summarize_trace(ASSETS / "report_run.jsonl", top=3)


def kinds(summary: dict) -> list[str]:
    return [r["kind"] for r in summary["recommendations"]]


def test_steps_skips_and_scale(run_summary):
    st, scale = run_summary["steps"], run_summary["scale"]
    assert (st["count"], st["first"], st["last"]) == (300, 1, 300)
    assert st["skipped_steps"] == [1, 2, 3, 54, 105, 156, 180, 282]
    assert st["clipped"] == 25
    assert (scale["initial_log2"], scale["min_log2"], scale["max_log2"], scale["final_log2"]) == (16, 12, 16, 13)
    assert scale["min_step"] == 181  # the backoff after the forward overflow at step 180
    assert scale["backoffs"] == 8 and scale["growths"] == 5
    assert run_summary["loss"]["nonfinite"] == 1 and run_summary["loss"]["last"] < run_summary["loss"]["first"]
    assert run_summary["problems"] == []


def test_first_nonfinite_names_module_and_source(run_summary):
    first = run_summary["first_nonfinite"]
    assert first == {"step": 180, "phase": "forward", "module": "blocks.1.attn", "op": "aten.exp.default",
                     "source": "model.py:42", "kind": "inf"}


def test_divergence_ranks_the_drifting_module_first(run_summary):
    div = run_summary["divergence"]
    assert div["scope"] == "local" and div["modules"] == 6 and len(div["top"]) == 3
    worst = div["top"][0]
    assert worst["module"] == "blocks.1.attn"
    # An fp16 run: own error is judged against 32 unit roundoffs (1.6%), which the module passes from step 150.
    assert div["threshold"] == pytest.approx(32 * 2 ** -11)
    assert worst["max_rel_l2"] > 0.05 and worst["max_step"] == 300 and worst["drift_step"] == 150
    assert [r["max_rel_l2"] for r in div["top"]] == sorted((r["max_rel_l2"] for r in div["top"]), reverse=True)
    assert div["grad_top"][0]["param"] == "blocks.1.attn.weight"
    # Where the error first shows is the culprit's own error passing its line (step 150), not the accumulated
    # error of the module downstream of it (blocks.1.mlp's global error passes 1.6% at step 50).
    assert div["first_jump"] == {"module": "blocks.1.attn", "step": 150, "rel_l2": pytest.approx(0.017489),
                                 "rule": "absolute"}
    assert [c["module"] for c in div["culprits"]] == ["blocks.1.attn"] and worst["verdict"]["rank"] == 1


def test_headroom_least_first(run_summary):
    hr = run_summary["headroom"]
    assert hr["modules"] == 6 and len(hr["top"]) == 3
    assert hr["top"][0]["module"] == "blocks.1.attn" and hr["top"][0]["forward_bits"] < 1.0
    assert hr["top"][0]["forward_step"] == 300
    assert all(r["forward_bits"] > 7 for r in hr["top"][1:])


def test_recommendations_for_the_run(run_summary):
    assert kinds(run_summary) == ["keep_fp32", "init_scale", "bf16"]
    keep = run_summary["recommendations"][0]
    assert keep["modules"] == ["blocks.1.attn"]
    assert keep["code"] == 'ampaudit.keep_fp32(model, ["blocks.1.attn"])'
    init = run_summary["recommendations"][1]
    assert init["init_scale"] == 8192.0 and "2**13" in init["message"]
    assert init["code"] == "ampaudit train ... --init-scale 8192"  # the fixture was written by `ampaudit train`


def test_init_scale_for_a_watched_loop_names_torchs_scaler(tmp_path):
    steps = [{"loss": 1.0, "scale": 2.0 ** (16 - min(i, 5)), "skipped": i < 5, "grad_norm": 1.0}
             for i in range(40)]
    s = summarize_trace(_write(tmp_path / "w.jsonl", steps))
    init = next(r for r in s["recommendations"] if r["kind"] == "init_scale")
    assert init["init_scale"] == 2048.0
    assert init["code"] == "torch.amp.GradScaler('cuda', init_scale=2048.0)"


def test_summary_is_strict_json(run_summary):
    text = json.dumps(run_summary, allow_nan=False)
    assert json.loads(text)["steps"]["count"] == 300


def test_truncated_trace_summarises_what_was_written():
    s = summarize_trace(ASSETS / "report_truncated.jsonl")
    assert len(s["problems"]) == 1 and "truncated" in s["problems"][0]
    assert s["steps"]["count"] == 120 and s["first_nonfinite"] is None


def test_corrupt_and_malformed_events_are_tolerated():
    s = summarize_trace(ASSETS / "report_corrupt.jsonl")
    assert any("corrupt line" in p for p in s["problems"])
    assert s["unknown_events"] == {"gpu_memory": 1}
    assert s["scale"] == {"used": False} and s["meta"]["dtype"] == "bfloat16"
    assert s["steps"]["count"] == 41  # the step without a number still counts
    assert s["headroom"]["top"][0]["forward_bits"] == pytest.approx(126.4)
    assert s["first_nonfinite"]["module"] is None and s["first_nonfinite"]["kind"] == "nan"
    assert kinds(s) == ["nonfinite_unlocated"] and "step 20" in s["recommendations"][0]["message"]
    json.dumps(s, allow_nan=False)


def test_garbage_fields_never_raise():
    events = [5, "x", {"event": "step"}, {"event": "step", "step": "seven", "loss": [1], "scale": -3},
              {"event": "stats"}, {"event": "stats", "absmax": "inf", "headroom_bits": "-inf", "numel": 0},
              {"event": "divergence", "rel_l2": "nan"}, {"event": "divergence", "scope": "grad"},
              {"event": "nonfinite"}, {"event": "skip", "modules": "all", "params": None},
              {"event": "halt", "diagnosis": "x"}, {"event": "checkpoint"}, {"event": None}, {"event": "meta"}]
    s = summarize(events, ["x:1: corrupt line, skipped"])
    assert s["steps"]["count"] == 2 and s["steps"]["last"] == 2
    assert s["headroom"]["top"][0]["forward_bits"] == "-inf"
    assert s["divergence"]["top"][0]["max_rel_l2"] == "nan"
    assert s["halt"]["reason"] is None
    assert "broken" in kinds(s)  # the halt event
    json.dumps(s, allow_nan=False)


def test_num_reads_the_writers_nonfinite_strings():
    assert num("inf") == math.inf and num("-inf") == -math.inf and math.isnan(num("nan"))
    assert num(True) is None and num("3") is None and num(2) == 2.0


def _write(path: Path, steps: list[dict], extra: list[tuple] = ()) -> Path:
    with TraceWriter(path) as tw:
        tw.write_record(ev("meta", None, version=1, source="watch", dtype="float16", device="cuda"))
        for i, row in enumerate(steps, 1):
            tw.write_record(ev("step", i, **row))
        for event, step, fields in extra:
            tw.write_record(ev(event, step, **fields))
    return path


def test_collapsing_scale_says_the_run_is_broken(tmp_path):
    # Every step overflows: the scale halves from 2^16 to 2^-13 and nothing trains.
    steps = [{"loss": float("nan"), "scale": 2.0 ** (16 - i), "skipped": True, "grad_norm": None}
             for i in range(30)]
    s = summarize_trace(_write(tmp_path / "broken.jsonl", steps))
    assert s["recommendations"][0]["kind"] == "broken" and s["recommendations"][0]["severity"] == "error"
    msg = s["recommendations"][0]["message"]
    assert "2^-13" in msg and "100% of the last 20 steps" in msg and "last loss is not finite" in msg
    assert "init_scale" not in kinds(s)  # no step ever succeeded: there is no scale to recommend


def test_healthy_run_has_no_recommendations(tmp_path):
    steps = [{"loss": 1.0 / i, "scale": 1024.0, "skipped": False, "grad_norm": 0.5, "clipped": False}
             for i in range(1, 60)]
    extra = [("stats", 10, {"module": "fc", "phase": "forward", "absmax": 4.0, "headroom_bits": 14.0}),
             ("divergence", 10, {"module": "fc", "scope": "local", "rel_l2": 0.001})]
    s = summarize_trace(_write(tmp_path / "ok.jsonl", steps, extra))
    assert s["recommendations"] == []


def test_frequent_clipping_is_mentioned(tmp_path):
    steps = [{"loss": 1.0, "scale": 1024.0, "skipped": False, "grad_norm": 9.0, "clipped": True}] * 10
    assert "clipping" in kinds(summarize_trace(_write(tmp_path / "clip.jsonl", steps)))


def test_check_findings_confirmed_by_the_run(tmp_path):
    findings = {"version": 1, "findings": [
        {"rule": "AMP101", "family": "sensitive-op", "module": "blocks.1.attn", "message": "exp in fp16"},
        {"rule": "AMP201", "family": "alignment", "module": "blocks.1.attn", "message": "dim 30 not /8"},
        {"rule": "AMP102", "family": "range", "module": "head", "message": "large constant"},
        {"rule": "AMP103", "family": "range", "module": "blocks.1", "message": "parent's own code"}]}
    path = tmp_path / "findings.json"
    path.write_text(json.dumps(findings))
    s = summarize_trace(ASSETS / "report_run.jsonl", findings=load_findings(path))
    rec = next(r for r in s["recommendations"] if r["kind"] == "confirmed_findings")
    # Only the numeric finding on the module that overflowed: speed findings and other modules are not confirmed.
    assert [f["rule"] for f in rec["findings"]] == ["AMP101"]
    assert "step 180" in rec["findings"][0]["evidence"]
    assert "1 of 4" in rec["message"]


def test_load_findings_errors_are_one_line(tmp_path):
    with pytest.raises(InputError, match="not found"):
        load_findings(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{oops")
    with pytest.raises(InputError, match="not JSON"):
        load_findings(tmp_path / "bad.json")
    (tmp_path / "nolist.json").write_text('{"findings": 3}')
    with pytest.raises(InputError, match="no \"findings\" list"):
        load_findings(tmp_path / "nolist.json")
    (tmp_path / "list.json").write_text('[{"rule": "X", "module": "a"}]')
    assert load_findings(tmp_path / "list.json") == [{"rule": "X", "module": "a"}]
    (tmp_path / "clean.json").write_text('{"version": 1, "findings": []}')      # check's output of a clean model
    assert load_findings(tmp_path / "clean.json") == []
    for name, text, match in [("empty", "[]", "is an empty list, not the output of ampaudit check"),
                              ("number", '[{"rule": "X", "module": "a"}, 7]', "entry 1 is not a finding"),
                              ("norule", '{"findings": [{"module": "a"}]}', "entry 0 is not a finding")]:
        (tmp_path / f"{name}.json").write_text(text)
        with pytest.raises(InputError, match=match):
            load_findings(tmp_path / f"{name}.json")


def test_missing_trace_raises_trace_error(tmp_path):
    with pytest.raises(TraceError, match="not found"):
        summarize_trace(tmp_path / "nope.jsonl")


def test_collect_groups_by_kind():
    data = collect([ev("meta", dtype="float16"), ev("step", 3, skipped=True), ev("skip", 5, modules=["a"]),
                    ev("meta", dtype="other")])
    assert data.meta["dtype"] == "float16"  # the first meta wins
    assert data.skipped_steps == [3, 5]


def test_stats_counts_become_evidence(tmp_path):
    # Fields as ampaudit.runtime.stats writes them: counts may be null on passes without full counts.
    extra = [("stats", 5, {"module": "pool", "phase": "forward", "absmax": 9e4, "headroom_bits": -0.46,
                           "numel": 100, "inf": None, "nan": None, "overflow": 3, "nonfinite_passes": 0}),
             ("stats", 5, {"module": "bn", "phase": "forward", "absmax": "inf", "headroom_bits": "-inf",
                           "numel": 0, "inf": None, "nan": None, "nonfinite_passes": 2, "passes": 4})]
    steps = [{"loss": 1.0, "scale": 1024.0, "skipped": False}] * 10
    s = summarize_trace(_write(tmp_path / "st.jsonl", steps, extra))
    rows = {r["module"]: r for r in s["headroom"]["top"]}
    assert rows["pool"]["overflow"] == 3 and rows["bn"]["nonfinite_passes"] == 2
    assert s["headroom"]["top"][0]["module"] == "bn"  # overflowed: least headroom of all
    keep = s["recommendations"][0]
    assert keep["kind"] == "keep_fp32" and keep["modules"] == ["bn", "pool"]
    assert "bn (non-finite output in 2 passes), pool (3 values above the dtype's max)" in keep["message"]


def test_a_module_fed_an_upstream_inf_is_not_a_culprit_of_the_run(tmp_path):
    # ampaudit report gives check --calibrate's verdict: "after" reads NaN only at the step its inputs were inf
    # in fp16 (an overflow in "over", named); "late" had its own inf at another step and stays named.
    steps = [{"loss": 1.0, "scale": 1024.0, "skipped": False} for _ in range(3)]
    local = [("divergence", 1, {"module": "over", "scope": "local", "rel_l2": "inf", "input_rel_l2": 2e-4}),
             ("divergence", 1, {"module": "after", "scope": "local", "rel_l2": "nan", "input_rel_l2": "inf"}),
             ("divergence", 2, {"module": "after", "scope": "local", "rel_l2": 3e-4, "input_rel_l2": 2e-4}),
             ("divergence", 1, {"module": "late", "scope": "local", "rel_l2": "nan", "input_rel_l2": "inf"}),
             ("divergence", 2, {"module": "late", "scope": "local", "rel_l2": "inf", "input_rel_l2": 2e-4})]
    local += [("divergence", 1, {"module": f"fc{i}", "scope": "local", "rel_l2": 3e-4}) for i in range(6)]
    s = summarize_trace(_write(tmp_path / "fed.jsonl", steps, local))
    assert sorted(c["module"] for c in s["divergence"]["culprits"]) == ["late", "over"]


def test_an_fp32_module_that_would_not_fit_fp16_is_not_told_to_keep_fp32(tmp_path):
    # T5's `wo` kept in FP32 (the published fix): its output is above fp16's max, true and said so, but FP32 is
    # where it already computes. The same stats without `dtype` (a version-5 trace) stay keep_fp32's evidence.
    row = {"module": "ff.wo", "phase": "forward", "absmax": 8.4e4, "headroom_bits": -0.36, "numel": 3072,
           "inf": 0, "nan": 0, "overflow": 61, "nonfinite_passes": 0}
    steps = [{"loss": 1.0, "scale": 1024.0, "skipped": False}] * 4
    s = summarize_trace(_write(tmp_path / "fp32.jsonl", steps, [("stats", 2, {**row, "dtype": "float32"})]))
    assert "keep_fp32" not in kinds(s)
    info = next(r for r in s["recommendations"] if r["kind"] == "fp32_range")
    assert info["severity"] == "info" and "modules" not in info
    assert "already in float32" in info["message"] and "ff.wo (up to 8.4e+04, 61 values above" in info["message"]
    old = summarize_trace(_write(tmp_path / "v5.jsonl", steps, [("stats", 2, row)]))
    assert kinds(old)[0] == "keep_fp32" and old["recommendations"][0]["modules"] == ["ff.wo"]
    half = summarize_trace(_write(tmp_path / "half.jsonl", steps, [("stats", 2, {**row, "dtype": "float16"})]))
    assert kinds(half)[0] == "keep_fp32" and "fp32_range" not in kinds(half)


def test_an_overflow_only_the_loss_scale_makes_is_a_skipped_step_not_a_culprit(tmp_path):
    # The scaler started too high: head's weight gradient overflowed scaled, not unscaled (scaled_only). The
    # skip is still listed; neither keep_fp32 nor the first non-finite names head. Without the field: a fault.
    probe = {"phase": "backward", "module": "head", "op": "aten.mm", "source": "m.py:47", "kind": "inf",
             "cause": "op", "dtype": "torch.float16", "low_precision": True, "fp32_too": False}
    skip = ("skip", 1, {"scale": 65536.0, "params": ["head.weight"], "modules": ["head"]})
    steps = [{"loss": 1.1, "scale": 65536.0, "skipped": True}] + [{"loss": 1.0, "scale": 32768.0,
                                                                   "skipped": False}] * 3
    s = summarize_trace(_write(tmp_path / "probe.jsonl", steps,
                               [("nonfinite", 1, {**probe, "scaled_only": True}), skip]))
    assert s["first_nonfinite"] is None and "keep_fp32" not in kinds(s)
    assert s["nonfinite"]["scaled_only"] == 1 and s["nonfinite"]["skip_modules"] == {"head": 1}
    fault = summarize_trace(_write(tmp_path / "fault.jsonl", steps, [("nonfinite", 1, probe), skip]))
    assert fault["first_nonfinite"]["module"] == "head" and "scaled_only" not in fault["first_nonfinite"]
    assert kinds(fault)[0] == "keep_fp32" and fault["recommendations"][0]["modules"] == ["head"]
    # The console says why nothing is named first, rather than a bare "none recorded" beside a skipped step.
    assert "none recorded (1 overflow was the loss scaler's own probing: a skipped step, as designed)" in _console(s)
    two = summarize_trace(_write(tmp_path / "probe2.jsonl", steps, [("nonfinite", 1, {**probe, "scaled_only": True}),
                                                                     ("nonfinite", 1, {**probe, "scaled_only": True})]))
    assert "(2 overflows were the loss scaler's own probing: skipped steps, as designed)" in _console(two)
    clean = summarize_trace(_write(tmp_path / "clean.jsonl", steps[1:]))
    assert "  none recorded\n" in _console(clean)


def _console(summary: dict) -> str:
    console = Console(record=True, width=200)
    render_summary(summary, console)
    return console.export_text()
