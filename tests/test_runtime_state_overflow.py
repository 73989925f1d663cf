"""State that overflows its storage: a half model's BatchNorm running_var beyond fp16's 65504 (../shared/planted/
bn_running_var.py) is named by ``ampaudit.watch`` on a user's own loop (a ``state_overflow`` event, the report's
warning with the fix); state that stays in range, or was inf in FP32 too, gets none; the swamping fixes say O2's
cast only for an O2 run."""
import pytest
import torch
import torch.nn as nn
from conftest import load_planted
from typer.testing import CliRunner

import ampaudit
import ampaudit.cli.commands  # noqa: F401  registers the commands
from ampaudit.cli.app import app
from ampaudit.report.trace_summary import summarize
from ampaudit.runtime.session import WatchSession
from ampaudit.runtime.swamping import Candidate, SwampMeter, describe


def _half_loop(model, batches, *, steps=3, every=2, trace=None):
    """A user's loop on a half model: SGD, the file's loss, ``every``-step sampling."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with ampaudit.watch(model, trace, every=every) as w:
        for _, (x, y) in zip(range(steps), batches):
            loss = torch.nn.functional.cross_entropy(model(x.half()).float(), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
    return w.events


def test_a_watched_half_model_names_its_batchnorm_running_var_beyond_fp16(tmp_path):
    m = load_planted("bn_running_var")
    model = m.build_model().half().train()
    trace = tmp_path / "run.jsonl"
    events = _half_loop(model, m.train_data(), trace=str(trace))
    overflows = [e for e in events if e["event"] == "state_overflow"]
    assert {e["step"] for e in overflows} == {0, 2}            # the sampled steps: the first, one per `every`
    ev = overflows[0]
    assert (ev["tensor"], ev["module"], ev["kind"], ev["dtype"]) == ("bn.running_var", "bn", "buffer", "float16")
    assert ev["elements"] == 16 and ev["limit"] == 65504.0 and 65504.0 < ev["fp32_absmax"] < float("inf")
    assert "eval reads this buffer" in ev["why"] and "keep BatchNorm in float32" in ev["fix"]
    assert "O2 cast" not in ev["fix"]                           # the user cast it, not an O2 run
    (rec,) = [r for r in summarize(events)["recommendations"] if r["kind"] == "state_overflow"]
    assert rec["severity"] == "warning" and rec["modules"] == ["bn"] and rec["tensors"] == ["bn.running_var"]
    out = CliRunner().invoke(app, ["report", str(trace)], env={"COLUMNS": "400"})
    assert "bn.running_var" in out.output and "keep BatchNorm in float32" in out.output


def test_batchnorm_in_range_and_an_fp32_model_overflow_nothing():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(4, 8, 3, padding=1), nn.BatchNorm1d(8), nn.Flatten(), nn.Linear(8 * 16, 3))
    batches = [(torch.randn(4, 4, 16), torch.randint(0, 3, (4,))) for _ in range(3)]
    events = _half_loop(model.half().train(), batches)
    assert any(e["event"] == "swamping" for e in events)        # the meter measured the half model's state
    assert not [e for e in events if e["event"] == "state_overflow"]
    fp32 = nn.BatchNorm1d(4).train()
    with ampaudit.watch(fp32) as w:
        fp32(torch.randn(8, 4) * 1e3)
    assert not [e for e in w.events if e["event"] in ("state_overflow", "swamping")]


class Accumulates(nn.Module):
    """A buffer ``acc`` the forward scales in place by ``factor``."""

    def __init__(self, start: float, factor: float):
        super().__init__()
        self.factor = factor
        self.lin = nn.Linear(4, 4)
        self.register_buffer("acc", torch.full((6,), start))

    def forward(self, x):
        self.acc.mul_(self.factor)
        return self.lin(x)


@pytest.mark.parametrize(("start", "factor", "found"), [
    (40000.0, 2.0, True),               # crosses 65504 during the step: stored inf, FP32 8e4
    (1000.0, 2.0, False),               # stays in range
    (float("inf"), 0.5, False),         # inf before the step: FP32 from 65504 gives 32752, in range: unknown
    (float("inf"), 2.0, True),          # even 65504 doubled is beyond the range
])
def test_a_buffer_is_named_only_where_fp32_holds_it_finite_beyond_the_range(start, factor, found):
    model = Accumulates(start, factor).half()
    meter = SwampMeter(model)
    assert meter.begin(1)
    model(torch.randn(2, 4, dtype=torch.float16))
    meter.finish()
    assert [e["tensor"] for e in meter.overflows] == (["acc"] if found else [])
    if found:
        assert meter.overflows[0]["fp32_absmax"] == pytest.approx(min(start, 65504.0) * factor)
        # From an inf start the FP32 value is a lower bound, and the why says so.
        assert ("already inf" in meter.overflows[0]["why"]) == (start == float("inf"))


def test_the_session_measures_once_and_writes_the_overflow():
    m = load_planted("bn_running_var")
    model = m.build_model().half().train()
    session = WatchSession(every=4)
    session.start(model, dtype=torch.float16, integration="test")
    for step, (x, _) in zip(range(1, 3), m.train_data()):
        session.begin_step(step)
        model(x.half()).float().mean().backward()
        session.end_step(skipped=False, scale=None)
    events = session.events
    session.close()
    assert [e["step"] for e in events if e["event"] == "state_overflow"] == [1]


def test_the_buffer_and_teacher_fixes_name_the_o2_cast_only_for_an_o2_run():
    row = {"dtype": "bfloat16", "update_rel": 1e-4, "half_ulp_rel": 0.0039, "share_rounded": 1.0}
    for cand in (Candidate("ema.mean", "ema", "buffer", torch.zeros(1)),
                 Candidate("teacher.w", "teacher", "param", torch.zeros(1), frozen=True, owner="teacher")):
        assert "after the O2 cast" in describe(cand, row, o2=True)["fix"]
        o1 = describe(cand, row, o2=False)["fix"]
        assert "O2" not in o1 and "where the model is made bfloat16" in o1


def test_the_html_report_shows_the_overflow():
    pytest.importorskip("plotly")
    from ampaudit.report.html import build_html

    events = [{"event": "meta", "version": 5, "dtype": "float16"}, {"event": "step", "step": 0, "loss": 1.0},
              {"event": "state_overflow", "step": 0, "tensor": "bn.running_var", "module": "bn", "kind": "buffer",
               "dtype": "float16", "elements": 16, "numel": 16, "fp32_absmax": 1.0e5, "limit": 65504.0,
               "why": "beyond float16", "fix": "keep BatchNorm in float32"}]
    page = build_html(events)
    assert "state overflow" in page and "bn.running_var" in page and "keep BatchNorm in float32" in page


def test_the_preflight_names_the_o2_cast_only_for_an_o2_run():
    from ampaudit.train.preflight_state import check_updates

    model = Accumulates(1.0, 0.999).bfloat16()
    batch = (torch.randn(2, 4, dtype=torch.bfloat16), None)
    o2, plain = (check_updates(model, batch, dtype=torch.bfloat16, o2=flag) for flag in (True, False))
    assert o2.status == plain.status == "warn" and "acc" in o2.message
    assert "after the O2 cast" in o2.hint and "O2" not in plain.hint
