"""Swamping: low-precision state that changes without an FP32 master is measured on sampled steps (against an FP32
truth computed here), written to the trace, warned about by report, and named by the O2 preflight; healthy runs
(the same EMA kept fp32, an O1 run, O2's mastered weights) get none of it."""
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from conftest import ASSETS, load_module
from typer.testing import CliRunner

import ampaudit.cli.commands  # noqa: F401  registers the commands
from ampaudit.cli.app import app
from ampaudit.report.trace_summary import summarize
from ampaudit.runtime.session import WatchSession
from ampaudit.runtime.swamping import SwampMeter, candidates
from ampaudit.runtime.trace import read_trace
from ampaudit.train import Trainer
from ampaudit.train.masters import cast_model_o2
from ampaudit.train.preflight_state import check_optimizer_state
from trace_events import ev

PLANTED = Path(__file__).resolve().parent / "planted"


def planted(name):
    return load_module(PLANTED / f"{name}.py")


def _o2_teacher(drift=0.02):
    """The planted self-distillation model under O2, its student moved away from the teacher (as training does)."""
    m = planted("ema_teacher_bf16")
    model = cast_model_o2(m.build_model(), torch.bfloat16)
    torch.manual_seed(3)
    with torch.no_grad():
        for p in model.student.parameters():
            p.add_(torch.randn_like(p) * drift)
    return m, model


def _truth(start, student, momentum):
    """What the EMA would store in FP32, and the stored bf16 result, computed independently of the meter."""
    want = momentum * start.float() + (1 - momentum) * student.float() - start.float()
    return want


@pytest.mark.parametrize("style", ["mul_add", "lerp", "copy", "foreach"])
def test_measured_ratio_is_the_fp32_truth(style):
    m, model = _o2_teacher()
    teacher, student = list(model.teacher.parameters()), list(model.student.parameters())
    start = [t.detach().clone() for t in teacher]
    meter = SwampMeter(model, mastered=student + list(model.predictor.parameters()))
    assert meter.begin(7)
    with torch.no_grad():
        if style == "foreach":
            torch._foreach_lerp_(teacher, student, 1 - m.MOMENTUM)
        for t, s in zip(teacher, student) if style != "foreach" else ():
            if style == "mul_add":
                t.data.mul_(m.MOMENTUM).add_(s.data, alpha=1 - m.MOMENTUM)
            elif style == "lerp":
                t.lerp_(s, 1 - m.MOMENTUM)
            else:   # timm ModelEmaV2's form: the sum computed out of place in bf16, then copied in
                t.copy_(t * m.MOMENTUM + (1 - m.MOMENTUM) * s)
    events = {e["tensor"]: e for e in meter.finish()}
    assert not meter.active
    weight = events["teacher.0.weight"]
    assert weight["step"] == 7 and weight["module"] == "teacher.0" and weight["kind"] == "param"
    want = _truth(start[0], student[0], m.MOMENTUM)
    got = teacher[0].detach().float() - start[0].float()
    want, start0 = want.detach(), start[0].detach()
    moving = want.abs() > 4 * torch.finfo(torch.float32).eps * start0.float().abs()
    true_ratio = float(got[moving].norm() / want[moving].norm())
    true_share = float((got[moving] == 0).float().mean())
    assert true_share > 0.5             # the fault is there: most updates round away in bf16
    assert weight["realized_ratio"] == pytest.approx(true_ratio, abs=0.03)
    assert weight["share_rounded"] == pytest.approx(true_share, abs=0.03)
    assert "EMA" in weight["why"] and "float32" in weight["fix"]


def test_meter_costs_nothing_without_low_precision_state():
    model = nn.Linear(4, 4)
    meter = SwampMeter(model, optimizer=torch.optim.AdamW(model.parameters()))
    assert not meter.begin(1) and not meter.active      # no dispatch mode entered for an fp32 model
    bf16 = cast_model_o2(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)), torch.bfloat16)
    assert candidates(bf16, mastered=list(bf16.parameters())) == []   # masters and fp32 BatchNorm: nothing


def _train(name, tmp_path, steps, *, opt_level="O2", every=10, **kwargs):
    m = planted(name)
    trace = tmp_path / f"{name}.jsonl"
    kwargs.setdefault("optimizer", getattr(m, "make_optimizer", None))
    with Trainer(m.build_model(), m.loss_fn, m.train_data, dtype="bfloat16", opt_level=opt_level, trace=trace, trace_every=every, handle_signals=False,
                 **kwargs) as t:
        t.fit(steps)
    events, problems = read_trace(trace)
    assert not problems
    return t, events


def test_running_buffers_in_bf16_are_traced_and_named_by_preflight(tmp_path):
    t, events = _train("running_mean_buffer", tmp_path, 260, every=130)
    found = {(e["step"], e["tensor"]) for e in events if e["event"] == "swamping"}
    # The mean's 1/count updates round away from the first sampled steps; the count stops at 256 (256 + 1 = 256).
    assert (130, "norm.mean") in found and (260, "norm.count") in found and (130, "norm.count") not in found
    count = next(e for e in events if e["event"] == "swamping" and e["tensor"] == "norm.count")
    assert count["kind"] == "buffer" and count["share_rounded"] == 1.0 and count["realized_ratio"] == 0.0
    updates = next(c for c in t.preflight if c.name == "updates")
    assert updates.status == "warn" and "norm.count (buffer, bfloat16" in updates.message and "norm.mean" in \
        updates.message and "model.norm.float()" in updates.hint
    assert any("preflight updates" in w for w in t.warnings)


def test_cli_ema_teacher_is_traced_and_report_warns(tmp_path):
    model, trace = str(PLANTED / "ema_teacher_bf16.py"), tmp_path / "run.jsonl"
    runner = CliRunner(env={"COLUMNS": "200"})
    r = runner.invoke(app, ["train", model, "--opt-level", "O2", "--dtype", "bfloat16", "--device", "cpu",
                            "--steps", "20", "--trace", str(trace), "--trace-every", "10"])
    assert r.exit_code == 0, r.output
    assert "preflight updates: 4 tensor(s)" in r.output and "teacher.0.weight" in r.output
    events, _ = read_trace(trace)
    swamped = [e for e in events if e["event"] == "swamping" and e["step"] == 20]
    assert {e["tensor"] for e in swamped} >= set(planted("ema_teacher_bf16").EXPECT["tensors"])
    assert all(e["module"].startswith("teacher.") and e["dtype"] == "bfloat16" for e in swamped)
    assert not [e for e in events if e["event"] == "swamping" and not e["tensor"].startswith("teacher.")]
    r = runner.invoke(app, ["report", str(trace)])
    assert r.exit_code == 0, r.output
    text = " ".join(r.output.split())
    assert "looks healthy" not in text
    assert "Swamping" in text and "teacher.0.weight" in text and "rounded away" in text
    assert "Fix: keep teacher in float32" in text


def test_fp32_teacher_and_o1_runs_stay_quiet(tmp_path):
    t, events = _train("ema_teacher_fp32", tmp_path, 20)
    assert not [e for e in events if e["event"] == "swamping"]
    assert [c.status for c in t.preflight] == ["ok", "ok"]
    summary = summarize(events)
    assert summary["swamping"]["tensors"] == [] and summary["recommendations"] == []
    mlp = load_module(ASSETS / "train_mlp.py")
    trace = tmp_path / "o1.jsonl"
    with Trainer(mlp.build_model(), mlp.loss_fn, mlp.train_data, dtype="bfloat16", trace=trace, trace_every=2,
                 handle_signals=False) as o1:
        o1.fit(6)
    assert not [e for e in read_trace(trace)[0] if e["event"] in ("swamping", "preflight")]


class BF16AdamW(torch.optim.Optimizer):
    """A user's memory-saving AdamW: moments kept in bf16 whatever the parameter's dtype."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps})

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.bfloat16)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.bfloat16)
                g = p.grad.to(torch.bfloat16)
                state["exp_avg"].lerp_(g, 1 - b1)
                state["exp_avg_sq"].mul_(b2).addcmul_(g, g, value=1 - b2)
                p.add_(state["exp_avg"].float() / (state["exp_avg_sq"].float().sqrt() + group["eps"]),
                       alpha=-group["lr"])


def test_bf16_optimizer_states_are_named_by_preflight_and_measured(tmp_path):
    mlp = load_module(ASSETS / "train_mlp.py")
    model = mlp.build_model()
    check = check_optimizer_state(BF16AdamW(model.parameters()), {id(p): n for n, p in model.named_parameters()})
    assert check.status == "warn" and "group0.float32.exp_avg (bfloat16)" in check.message
    assert check_optimizer_state(torch.optim.AdamW(model.parameters())).status == "ok"
    t, events = _train("ema_teacher_fp32", tmp_path, 300, every=150, optimizer=lambda ps: BF16AdamW(ps, lr=1e-3))
    assert next(c for c in t.preflight if c.name == "optimizer state").status == "warn"
    states = [e for e in events if e["event"] == "swamping" and e["kind"] == "optimizer_state"]
    # exp_avg_sq (beta2 0.999) takes updates of ~1/n of itself at step n: below half a bf16 ulp from n ~ 256 (and
    # for many elements before); at step 1 the states did not exist when the step began.
    assert states and 300 in {e["step"] for e in states} and 1 not in {e["step"] for e in states}
    assert any(e["tensor"] == "student.0.weight.exp_avg_sq" for e in states)
    assert all(e["module"] and "optimizer state kept in bfloat16" in e["why"] for e in states)


def test_torchao_low_bit_states_are_named():
    """torchao's AdamW8bit keeps OptimState8bit states (a step compiles its kernel: the state is built directly)."""
    low_bit = pytest.importorskip("torchao.optim.subclass_8bit")
    model = nn.Linear(256, 256)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.state[model.weight]["exp_avg"] = low_bit.OptimState8bit.zeros(model.weight.shape, True, 256)
    check = check_optimizer_state(opt, {id(model.weight): "weight"})
    assert check.status == "warn" and "weight.exp_avg (8-bit block-quantized)" in check.message


def test_bf16_weights_stepped_without_masters_in_a_plain_loop():
    """The callbacks' path (a session with no trainer): a bf16 model stepped by torch's AdamW directly."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1)).bfloat16()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    session = WatchSession(every=4)
    session.start(model, dtype=torch.bfloat16, integration="test")
    session.measure_updates(optimizer=opt)
    for step in range(1, 9):
        session.begin_step(step)
        x = torch.randn(16, 32, dtype=torch.bfloat16)
        loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        session.end_step(skipped=False, scale=None)
        assert not session.swamp.active
    events = [e for e in session.events if e["event"] == "swamping"]
    session.close()
    params = [e for e in events if e["kind"] == "param"]
    assert params and all("lr*grad" in e["why"] for e in params) and {e["step"] for e in params} == {1, 4, 8}
    assert {e["tensor"] for e in params} >= {"0.weight", "2.weight"} and all(e["module"] in ("0", "2") for e in params)


def test_report_reads_swamping_and_preflight_events():
    meta = ev("meta", version=3, dtype="bfloat16")
    steps = [ev("step", i, loss=1.0, skipped=False) for i in (1, 2)]
    good = ev("swamping", 2, tensor="ema.w", module="ema", kind="param", dtype="bfloat16", share_rounded=0.97,
              realized_ratio=0.04, elements=100, numel=100, update_rel=1e-4, half_ulp_rel=0.0039,
              why="no FP32 master", fix="keep ema in float32")
    s = summarize([meta, *steps, good, {**good, "step": "bad", "share_rounded": "x"}, {"event": "swamping"}])
    (row,) = s["swamping"]["tensors"]
    assert row["tensor"] == "ema.w" and row["steps"] == 2 and row["share_rounded"] == 0.97
    (rec,) = [r for r in s["recommendations"] if r["kind"] == "swamping"]
    assert rec["severity"] == "warning" and rec["modules"] == ["ema"]
    assert "ema.w" in rec["message"] and "97%" in rec["message"] and "keep ema in float32" in rec["message"]
    check = {"name": "updates", "status": "warn", "message": "2 tensor(s) change", "hint": "keep them fp32"}
    s = summarize([meta, ev("preflight", 0, checks=[check, {**check, "name": "memory"}]), *steps])
    (rec,) = s["recommendations"]
    assert rec["kind"] == "preflight" and "updates: 2 tensor(s) change -> keep them fp32" in rec["message"]
    assert "preflight" not in s["unknown_events"]


def test_preflight_dry_forward_leaves_the_model_and_rng_as_they_were():
    from ampaudit.train.preflight_state import updated_in_forward

    mlp = load_module(ASSETS / "train_mlp.py")     # fp32 BatchNorm (its statistics, its counter) and dropout
    model = cast_model_o2(mlp.build_model(), torch.bfloat16)
    model.register_buffer("ema", torch.ones(4, dtype=torch.bfloat16))
    forward = model.forward
    model.forward = lambda x: (model.ema.mul_(0.5), forward(x))[1]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    found = updated_in_forward(model, next(iter(mlp.train_data())), dtype=torch.bfloat16,
                               skip=list(model.parameters()))
    assert [(n, k) for n, k, _ in found] == [("ema", "buffer")]      # the fp32 BatchNorm stats are not reported
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.equal(torch.get_rng_state(), rng)


def test_html_page_shows_swamping():
    pytest.importorskip("plotly")
    from ampaudit.report.html import build_html

    swamped = ev("swamping", 2, tensor="ema.<w>", module="ema", kind="param", dtype="bfloat16", share_rounded=0.97,
                 realized_ratio=0.04, why="no FP32 master", fix="keep ema in float32")
    page = build_html([ev("meta", version=3), ev("step", 1, loss=1.0), swamped])
    assert "swamping</td>" in page and "<b>ema.&lt;w&gt;</b> (bfloat16): 97% of updates rounded away" in page
    assert "keep ema in float32" in page and "looks healthy" not in page


def test_preflight_only_names_the_teacher_and_exits_0():
    r = CliRunner(env={"COLUMNS": "200"}).invoke(app, ["train", str(PLANTED / "ema_teacher_bf16.py"), "--opt-level",
                                                       "O2", "--dtype", "bfloat16", "--device", "cpu",
                                                       "--preflight-only"])
    assert r.exit_code == 0, r.output          # a warning, not a refusal: the run is valid
    (line,) = [x for x in r.output.splitlines() if x.startswith("warn updates")]
    assert "teacher.0.weight (parameter, bfloat16, updated in forward)" in line and "model.teacher.float()" in line
    assert "ok   optimizer state: SGD keeps its states in float32" in r.output
