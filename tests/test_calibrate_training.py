"""check --calibrate names the faults only training shows: state updated in place that rounds away in the storage
of the run's opt level (AMP801), and, with --train-steps, what a copy trained in memory shows (AMP801 over the
steps, attention-logit growth AMP802), judged as ampaudit report judges a trace; their healthy twins stay quiet."""
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from conftest import ROOT, load_module
from typer.testing import CliRunner

import ampaudit
import ampaudit.cli.commands  # noqa: F401  registers the commands
from ampaudit.cli.app import app
from ampaudit.errors import UsageError

PLANTED = Path(__file__).resolve().parent / "planted"


def planted(name):
    return load_module(PLANTED / f"{name}.py")


def _check(m, model=None, **options):
    """check --calibrate on a planted file as the CLI runs it: its hooks for training, bf16 on CPU."""
    return ampaudit.check(model if model is not None else m.build_model(), *m.example_inputs(), device="cpu",
                          dtype="bfloat16", calibrate=True, train_data=getattr(m, "train_data", None),
                          loss_fn=getattr(m, "loss_fn", None), optimizer=getattr(m, "make_optimizer", None),
                          scheduler=getattr(m, "make_scheduler", None), **options)


def _found(report, rule, severities=("warning", "error")):
    return [f for f in report.findings if f.rule == rule and f.severity in severities]


@pytest.mark.slow
def test_ema_teacher_in_bf16_loses_its_updates_over_training_steps(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)           # nothing may be left on disk: no trace, no halt checkpoint
    m = planted("ema_teacher_bf16")
    # In eval mode the forward does not update the teacher, so any change would be the check's own.
    model = m.build_model().eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    report = _check(m, model, opt_level="O2", train_steps=2)
    found = _found(report, "AMP801")
    assert found and {f.module.split(".")[0] for f in found} == {"teacher"}, report.findings
    f = found[0]
    assert "loses its updates in training" in f.message and "bfloat16 at O2" in f.message
    assert "EMA" in f.why and "no FP32 master" in f.why and "keep teacher in float32" in f.fix
    # the user's line that writes it: t.mul_(momentum).add_(...)
    assert f.location["file"].endswith("ema_teacher_bf16.py")
    assert "mul_" in (PLANTED / "ema_teacher_bf16.py").read_text().splitlines()[f.location["line"] - 1]
    assert any("trained a copy 2 step(s) at O2 in bfloat16" in n for n in report.notes)
    assert list(tmp_path.iterdir()) == []
    # the user's model is not the one trained or cast
    assert not model.training and all(v.dtype == torch.float32 for v in model.state_dict().values())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_ema_teacher_kept_fp32_is_quiet():
    report = _check(planted("ema_teacher_fp32"), opt_level="O2", train_steps=2)
    assert [f for f in report.findings if f.rule.startswith("AMP8")] == []


def test_under_o1_the_teacher_stays_fp32_and_nothing_is_said():
    report = _check(planted("ema_teacher_bf16"))
    assert [f for f in report.findings if f.rule.startswith("AMP8")] == []


def test_without_steps_o2_names_the_state_the_forward_updates_as_an_info():
    # At initialization the teacher equals the student: FP32 would not move it, so nothing is measured yet.
    report = _check(planted("ema_teacher_bf16"), opt_level="O2")
    found = [f for f in report.findings if f.rule == "AMP801"]
    assert found and all(f.severity == "info" and f.module.startswith("teacher") for f in found)
    assert "not measured yet" in found[0].message and "--train-steps" in found[0].why


def test_running_buffers_far_into_a_run_round_away_in_one_forward():
    m = planted("running_mean_buffer")
    model = m.build_model()
    with torch.no_grad():                 # the state of step 300: count past bf16's 256, the mean settled
        model.norm.count.fill_(300.0)
        model.norm.mean.fill_(3.0)
    report = _check(m, model, opt_level="O2")
    found = _found(report, "AMP801")
    assert found and {f.module for f in found} == {"norm"}
    f = found[0]
    assert "in the calibration forward" in f.message and "buffer updated in place in bfloat16" in f.why
    assert f.location["file"].endswith("running_mean_buffer.py")
    # O1 keeps the buffers fp32: the same state loses nothing
    assert _found(_check(m, model), "AMP801") == []


def test_pure_bf16_weights_lose_their_updates_as_the_users_loop_steps_them(tmp_path, monkeypatch):
    """A model stored in bf16 trains as its own loop steps it (the built-in trainer refuses it at O1): AdamW's
    updates at lr 2e-5 round away in the weights, named per parameter; the float32 twin is quiet."""
    monkeypatch.chdir(tmp_path)
    m = planted("pure_bf16_adamw")
    model = m.build_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    report = _check(m, model, train_steps=4)
    found = _found(report, "AMP801")
    assert {f.message.split(" ", 1)[0] for f in found} == set(m.EXPECT["tensors"]), report.findings
    assert all(f.module.startswith("body.") and "bfloat16 at O1, no FP32 master" in f.message for f in found)
    assert all("lr*grad" in f.why for f in found)
    assert any("as a plain loop steps its bfloat16 weights" in n for n in report.notes)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()) and list(tmp_path.iterdir()) == []
    fixed = _check(m, m.build_fixed_model(), train_steps=4)
    assert [f for f in fixed.findings if f.rule.startswith("AMP8")] == []


@pytest.mark.slow
def test_running_mean_buffer_loses_its_updates_over_training_steps():
    report = _check(planted("running_mean_buffer"), opt_level="O2", train_steps=16)
    found = _found(report, "AMP801")
    assert [f.module for f in found] == ["norm"] and "norm.mean" in found[0].message


@pytest.mark.slow
def test_attention_logit_growth_is_named_with_the_step_it_crossed():
    report = _check(planted("attn_logit_growth"), train_steps=20)
    found = _found(report, "AMP802")
    assert [f.module for f in found][:1] == ["blocks.1.attn"], report.findings
    assert "crossed 100 at step 17 of 20" in found[0].message and "qk-layernorm" in found[0].fix
    assert "Wortsman" in found[0].why


@pytest.mark.slow
@pytest.mark.parametrize("how", ["qk-layernorm", "low lr"])
def test_attention_logits_stay_bounded_in_the_healthy_twins(how):
    m = planted("attn_logit_growth")
    options = {"model": m.build_qknorm_model()} if how == "qk-layernorm" else {"lr": 0.02}
    report = _check(m, train_steps=20, **options)
    assert [f for f in report.findings if f.family == "precursor"] == []


def test_train_steps_on_a_model_without_train_data():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))
    report = ampaudit.check(model, torch.randn(4, 16), device="cpu", dtype="bfloat16", calibrate=True,
                            train_steps=3)
    said = [n for n in report.notes if n.startswith("trained a copy")]
    assert said and "3 step(s) at O1" in said[0] and "example inputs, repeated" in said[0], report.notes
    assert [f for f in report.findings if f.rule.startswith("AMP8")] == []


@pytest.mark.parametrize("options, says", [
    ({"opt_level": "O3"}, "unknown opt level 'O3'"),
    ({"train_steps": -1}, "train_steps must be a whole number >= 0"),
    ({"train_steps": 2, "calibrate": False}, "--train-steps needs --calibrate"),
])
def test_bad_training_options_are_usage_errors(options, says):
    options = {"calibrate": True, **options}
    with pytest.raises(UsageError, match=says):
        ampaudit.check(nn.Linear(4, 4), torch.randn(2, 4), device="cpu", dtype="bfloat16", **options)


@pytest.mark.parametrize("args, says", [
    (["--calibrate", "--opt-level", "O3"], "unknown --opt-level 'O3'"),
    (["--calibrate", "--train-steps", "-1"], "--train-steps must be >= 0, got -1"),
    (["--train-steps", "2"], "--train-steps needs --calibrate"),
    (["--calibrate", "--lr", "0.1"], "--lr needs --train-steps"),
])
def test_cli_bad_training_values_exit_2_with_one_line(args, says):
    r = CliRunner().invoke(app, ["check", str(ROOT / "samples" / "clean_mlp.py"), *args])
    assert r.exit_code == 2, r.output
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], r.stderr


def _findings_of(events):
    """The AMP80x hits the matchers make of a trace's verdicts (what --train-steps hands them)."""
    from types import SimpleNamespace

    from ampaudit.report.trace_verdicts import training_verdicts
    from ampaudit.rules.loader import load_rules
    from ampaudit.rules.registry import MATCHERS

    v = training_verdicts(events)
    cal = SimpleNamespace(trained={"steps": v["steps"], "diverged_step": v["diverged_step"]},
                          precursors=v["precursors"], opt_level="O1",
                          swamping=[{**r, "origin": "training"} for r in v["swamping"]])
    out = {}
    for rule in (r for r in load_rules() if r.id.startswith("AMP8")):
        hits = list(MATCHERS.load()[rule.matcher].fn(SimpleNamespace(calibration=cal), rule))
        out[rule.id] = [(h.module, h.details) for h in hits]
        out[f"{rule.id}_variants"] = [h.variant for h in hits]
    return out


def test_the_report_verdicts_become_one_rule_each():
    from trace_events import ev, steps

    events = [ev("meta", version=3, dtype="bfloat16", source="train"), *steps([2.0] * 30),
              ev("precursor", 9, signal="attn_logit", module="blocks.0.attn", value=150.0, max_step=9, crossed_step=7),
              ev("precursor", 9, signal="attn_logit", module="blocks.1.attn", value=40.0, max_step=9),
              ev("precursor", 9, signal="output_logit", module="", value=100.0, max_step=9, crossed_step=9),
              ev("precursor", 9, signal="massive_activation", module="blocks.3", value=2500.0, absmax=800.0,
                 median=0.32, max_step=9),
              ev("swamping", 9, tensor="ema.weight", module="ema", kind="param", dtype="bfloat16", share_rounded=0.9,
                 realized_ratio=0.1, update_rel=1e-4, half_ulp_rel=0.0039, why="no FP32 master", fix="keep ema fp32")]
    found = _findings_of(events)
    assert [m for m, _ in found["AMP802"]] == ["blocks.0.attn"] and found["AMP802"][0][1]["step"] == 7
    assert "qk-layernorm" in found["AMP802"][0][1]["fixes"]
    assert [m for m, _ in found["AMP803"]] == [""] and "z-loss" in found["AMP803"][0][1]["fixes"]
    assert [m for m, _ in found["AMP804"]] == ["blocks.3"] and found["AMP804"][0][1]["step"] == 9
    assert found["AMP804_variants"] == ["no_fp8"]      # bf16 run, no fp8 layers: the info variant
    assert [m for m, _ in found["AMP801"]] == ["ema"] and found["AMP801"][0][1]["share"] == 0.9
    # a run whose signals stay under their lines gives none
    quiet = [ev("meta", version=3, dtype="bfloat16", source="train"), *steps([2.0] * 30),
             ev("precursor", 9, signal="attn_logit", module="blocks.0.attn", value=30.0, max_step=9)]
    assert all(v == [] for v in _findings_of(quiet).values())


def test_output_logit_divergence_is_on_the_module_that_made_the_output():
    # A version-6 trace names the output's maker: AMP803 is on it, with fixes that act on it; without, the top module.
    from trace_events import ev, steps

    events = [ev("meta", version=6, dtype="bfloat16", source="train"), *steps([2.0] * 30),
              ev("precursor", 9, signal="output_logit", module="", value=100.0, max_step=9, crossed_step=9,
                 producer="lm_head")]
    (module, details), = _findings_of(events)["AMP803"]
    assert module == "lm_head" and "ampaudit.keep_fp32(model, ['lm_head'])" in details["fixes"], details


def test_massive_activations_with_fp8_layers_are_amp804_at_warning():
    from ampaudit.rules.loader import load_rules
    from trace_events import ev, steps

    massive = ev("precursor", 9, signal="massive_activation", module="blocks.3", value=2500.0, absmax=800.0,
                 median=0.32, max_step=9)
    head = [ev("meta", version=3, dtype="bfloat16", source="train"), *steps([2.0] * 30)]
    with_fp8 = _findings_of([*head, ev("fp8", 9, module="blocks.3.fc", input={"amax": 2.0}), massive])
    assert [m for m, _ in with_fp8["AMP804"]] == ["blocks.3"] and with_fp8["AMP804_variants"] == [None]
    rule = next(r for r in load_rules() if r.id == "AMP804")
    assert rule.severity == "warning" and rule.variant("no_fp8")["severity"] == "info"
    assert "fp8 scaling" in rule.variant("no_fp8")["message"]
