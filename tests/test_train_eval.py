"""Evaluation under autocast and in FP32 (train --eval-every): the eval event, its gap on a planted model, training
left unchanged by it, O2's FP32 pass on the masters, and what ampaudit report makes of it."""
import importlib.util
import json

import pytest
import torch
from conftest import ASSETS, load_module
from rich.console import Console
from typer.testing import CliRunner

import ampaudit.cli.commands  # noqa: F401  registers the commands
from ampaudit.cli.app import app
from ampaudit.errors import TrainError, UsageError
from ampaudit.report.trace_console import render_summary
from ampaudit.report.trace_summary import summarize, summarize_trace
from ampaudit.runtime.trace import TRACE_VERSION, read_trace
from ampaudit.train import Trainer
from ampaudit.train.evaluate import topk_metrics

FOLDED = ASSETS / "train_eval_folded.py"
MLP = ASSETS / "train_mlp.py"


@pytest.fixture(scope="module")
def folded():
    return load_module(FOLDED)


@pytest.fixture(scope="module")
def mlp():
    return load_module(MLP)


def _mlp_eval_data():
    # Draws from the global generator on purpose: evaluation must leave training's random stream alone.
    w = torch.linspace(-1, 1, 16)[:, None]
    for _ in range(4):
        x = torch.randn(16, 16)
        yield x, torch.sin(x @ w)


def _evals(trace):
    events, problems = read_trace(trace)
    assert not problems
    return events, [e for e in events if e["event"] == "eval"]


def test_topk_metrics():
    out = torch.tensor([[0.1, 0.9, 0.0, 0.0, 0.0, 0.0], [0.8, 0.1, 0.05, 0.03, 0.01, 0.01]])
    assert topk_metrics(out, torch.tensor([1, 5])) == {"top1": 0.5, "top5": 0.5}
    assert topk_metrics(out[:, :3], torch.tensor([1, 2])) == {"top1": 0.5}     # 3 classes: no top-5
    seg = torch.zeros(2, 7, 4, 4)
    seg[:, 3] = 1.0
    assert topk_metrics(seg, torch.full((2, 4, 4), 3))["top1"] == 1.0           # per-pixel classes
    assert topk_metrics(torch.randn(4, 1), torch.randn(4, 1)) is None           # a regression
    assert topk_metrics({"logits": out}, torch.tensor([1, 5])) is None


def test_planted_fp16_eval_gap_shows_in_the_event_and_the_report(folded, tmp_path):
    trace = tmp_path / "run.jsonl"
    trainer = Trainer(folded.build_model(), folded.loss_fn, folded.train_data, optimizer=folded.make_optimizer,
                      dtype="float16", eval_data=folded.eval_data, eval_every=2, trace=trace, handle_signals=False)
    trainer.fit(steps=4)
    events, evals = _evals(trace)
    assert events[0]["version"] == TRACE_VERSION >= 2   # eval came with version 2
    assert [e["step"] for e in evals] == [2, 4]
    ev = evals[-1]
    assert (ev["dtype"], ev["batches"], ev["samples"]) == ("float16", 8, 512)
    loss, top1 = ev["loss"], ev["metrics"]["top1"]
    for q in (loss, top1, ev["metrics"]["top5"]):
        assert q["gap"] == pytest.approx(q["autocast"] - q["fp32"])
    # FP32 is right on every sample; fp16 rounds the features' informative part away.
    assert top1["fp32"] == 1.0 and top1["autocast"] < 0.8
    assert loss["fp32"] < 0.01 < 1.0 < loss["autocast"] and loss["noise"] > 0
    assert trainer.evaluator.results[-1]["loss"] == loss

    summary = summarize_trace(trace)
    assert summary["eval"]["count"] == 2 and summary["eval"]["dtype"] == "float16"
    assert {(b["step"], b["name"]) for b in summary["eval"]["beyond_noise"]} >= {(4, "loss"), (4, "top1")}
    advice = [r for r in summary["recommendations"] if r["kind"] == "eval_gap"]
    assert len(advice) == 1 and advice[0]["severity"] == "warning" and advice[0]["steps"] == [2, 4]
    assert "float16 autocast differs from FP32 beyond noise on 2 of 2 evals" in advice[0]["message"]
    console = Console(record=True, width=160)
    render_summary(summary, console)
    text = console.export_text()
    assert "Evaluation (2 evals, float16 autocast | FP32; last at step 4, 512 samples)" in text
    assert "top1: 0.58" in text and "| 1  gap -0.42" in text


def test_a_healthy_model_gets_no_eval_advice(mlp, tmp_path):
    trace = tmp_path / "run.jsonl"
    Trainer(mlp.build_model(), mlp.loss_fn, mlp.train_data, optimizer=mlp.make_optimizer, dtype="float16",
            eval_data=_mlp_eval_data, eval_every=3, trace=trace, handle_signals=False).fit(steps=6)
    _, evals = _evals(trace)
    assert len(evals) == 2 and evals[0]["metrics"] == {}          # a regression: no top-k
    loss = evals[-1]["loss"]
    assert loss["gap"] != 0 and abs(loss["gap"]) < 2 * loss["noise"]   # fp16 rounding, well inside noise
    summary = summarize_trace(trace)
    assert summary["eval"]["beyond_noise"] == []
    assert not [r for r in summary["recommendations"] if r["kind"] == "eval_gap"]


def test_evaluation_leaves_training_and_the_watch_unchanged(mlp, tmp_path):
    # Dropout and BatchNorm in train_mlp; the eval data draws from the global RNG.
    runs = {}
    for name, every in (("with", 2), ("without", None)):
        trace = tmp_path / f"{name}.jsonl"
        t = Trainer(mlp.build_model(), mlp.loss_fn, mlp.train_data, optimizer=mlp.make_optimizer, dtype="float16",
                    accum=2, eval_data=_mlp_eval_data, eval_every=every, trace=trace, trace_every=1,
                    handle_signals=False)
        torch.manual_seed(5)
        t.fit(steps=6)
        assert t.model.training and all(m.training for m in t.model.modules())
        runs[name] = (t.model.state_dict(), read_trace(trace)[0])
    (with_state, with_events), (without_state, without_events) = runs["with"], runs["without"]
    for key in without_state:
        assert torch.equal(with_state[key], without_state[key]), key
    keep = ("stats", "nonfinite", "divergence")      # what the watch records: the eval passes are not in it
    assert [e for e in with_events if e["event"] in keep] == [e for e in without_events if e["event"] in keep]
    assert [e["step"] for e in with_events if e["event"] == "eval"] == [2, 4, 6]


def test_o2_fp32_pass_runs_on_the_masters(mlp):
    t = Trainer(mlp.build_model(dropout=0.0), mlp.loss_fn, mlp.train_data, optimizer=mlp.make_optimizer,
                dtype="float16", opt_level="O2", handle_signals=False)
    t.fit(steps=3)
    # The reference: an FP32 model holding the masters (not their fp16 rounding), in eval mode.
    ref = mlp.build_model(dropout=0.0)
    state = {k: v.float() for k, v in t.model.state_dict().items()}
    state.update({n: m.detach() for n, m in t.masters.named_parameters()})
    ref.load_state_dict(state)
    ref.eval()
    g = torch.Generator().manual_seed(9)
    batches = [(torch.randn(16, 16, generator=g), torch.randn(16, 1, generator=g)) for _ in range(3)]
    from ampaudit.train.evaluate import Evaluator
    evaluator = Evaluator(batches, mlp.loss_fn, every=1, dtype=torch.float16, device=t.device)
    result = evaluator.run(t.model, 3, masters=t.masters)
    with torch.no_grad():
        expected = sum(float(mlp.loss_fn(ref(x), y)) for x, y in batches) / 3
        rounded = sum(float(mlp.loss_fn(ref.half().float()(x), y)) for x, y in batches) / 3
    assert result["loss"]["fp32"] == pytest.approx(expected, rel=1e-6)
    assert rounded != pytest.approx(expected, rel=1e-6)            # the masters matter: their rounding differs
    assert result["loss"]["autocast"] != pytest.approx(expected, rel=1e-6)
    assert t.model.fc1.weight.dtype == torch.float16 and t.model.training      # the model is left as it was


def test_metric_fn_and_its_errors(mlp):
    def metric_fn(output, target):
        return {"mae": (output.float() - target).abs().mean(), "count": 1}

    t = Trainer(mlp.build_model(), mlp.loss_fn, mlp.train_data, dtype="bfloat16", eval_data=_mlp_eval_data,
                eval_every=1, metric_fn=metric_fn, handle_signals=False)
    t.fit(steps=1)
    metrics = t.evaluator.results[-1]["metrics"]
    assert set(metrics) == {"mae", "count"} and metrics["count"]["gap"] == 0 and metrics["mae"]["fp32"] > 0
    bad = Trainer(mlp.build_model(), mlp.loss_fn, mlp.train_data, dtype="bfloat16", eval_data=_mlp_eval_data,
                  eval_every=1, metric_fn=lambda o, t: [1.0], handle_signals=False)
    with pytest.raises(TrainError, match="metric_fn must return a dict"):
        bad.fit(steps=1)
    with pytest.raises(UsageError, match="needs eval_data"):
        Trainer(mlp.build_model(), mlp.loss_fn, mlp.train_data, eval_every=1, handle_signals=False)
    with pytest.raises(UsageError, match="trains in float32"):
        Trainer(mlp.build_model(), mlp.loss_fn, mlp.train_data, dtype="float32", eval_data=_mlp_eval_data,
                eval_every=1, handle_signals=False)


def test_cli_eval_every_and_report(tmp_path):
    trace, page = tmp_path / "run.jsonl", tmp_path / "run.html"
    runner = CliRunner(env={"COLUMNS": "200"})
    r = runner.invoke(app, ["train", str(FOLDED), "--steps", "2", "--eval-every", "1", "--trace", str(trace)])
    assert r.exit_code == 0, r.output
    assert "eval at step 2 (float16 | fp32): loss " in r.stdout and "top1 0.5801 | 1 (gap -0.42)" in r.stdout
    r = runner.invoke(app, ["report", str(trace), "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["eval"]["count"] == 2
    if importlib.util.find_spec("tensorboard") is not None:
        from ampaudit.integrations.tensorboard import write_tensorboard
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        write_tensorboard(read_trace(trace)[0], tmp_path / "tb")
        acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0})
        acc.Reload()
        assert [s.step for s in acc.Scalars("eval/top1/fp32")] == [1, 2]
        assert acc.Scalars("eval/top1/gap")[-1].value == pytest.approx(-0.42, abs=0.01)
    pytest.importorskip("plotly")
    r = runner.invoke(app, ["report", str(trace), "--html", str(page)])
    assert r.exit_code == 0, r.output
    html = page.read_text()
    assert "id=\"plot-eval\"" in html or "id='plot-eval'" in html
    r = runner.invoke(app, ["train", str(MLP), "--steps", "1", "--eval-every", "1"])
    assert r.exit_code == 2 and "eval_data" in r.output and "Traceback" not in r.output


def test_version_1_traces_still_read_and_newer_ones_are_flagged():
    events, _ = read_trace(ASSETS / "report_run.jsonl")
    assert events[0].get("version", 1) == 1
    summary = summarize(events)
    assert summary["eval"] == {"count": 0, "dtype": None, "last": None, "beyond_noise": []}
    newer = summarize([{**events[0], "version": TRACE_VERSION + 1}, *events[1:]])
    assert any("newer than this ampaudit reads" in p for p in newer["problems"])
