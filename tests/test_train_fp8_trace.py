"""A plan's float8 layers in a training trace (ampaudit/runtime/fp8_stats.py): `fp8` events on the sampled steps,
equal to the plan's cast_stats; one `fp8_budget` event for a layer whose input flushes; --fp8-fallback; the
report's section; nothing changes for a model without Float8Linear."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
from conftest import ASSETS
from typer.testing import CliRunner

import ampaudit.cli.commands  # noqa: F401  registers the commands
from ampaudit.cli.app import app
from ampaudit.runtime.trace import read_trace
from ampaudit.train.trainer import Trainer

pytest.importorskip("torchao")

from ampaudit.planning.apply import apply_plan  # noqa: E402
from ampaudit.precision.fp8 import cast_stats  # noqa: E402
from ampaudit.policy import settings  # noqa: E402
from trace_events import ev

KEYS = {"amax", "scale", "flushed_share", "clipped_share"}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(32, 64), nn.Linear(64, 16)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _plan(*float8: str) -> dict:
    shapes = {"fc1": (32, 64), "fc2": (64, 16)}
    return {"version": 1, "recipe": "tensorwise",
            "layers": [{"module": m, "choice": "float8" if m in float8 else "bfloat16",
                        "shape": {"in_features": i, "out_features": o}} for m, (i, o) in shapes.items()]}


def _batches(massive: bool = False, steps: int = 5) -> list:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        x = torch.randn(8, 32, generator=g)
        if massive:          # one feature a million times the rest: the tensorwise scale flushes the others
            x[:, 0] *= 1e6
        out.append((x, torch.randn(8, 16, generator=g)))
    return out


def _train(tmp_path, model, batches, *, every=2, fallback=False, name="run.jsonl"):
    torch.manual_seed(0)
    trace = tmp_path / name
    trainer = Trainer(model, lambda o, y: ((o.float() - y) ** 2).mean(), lambda: iter(batches), dtype="bfloat16",
                      trace=trace, trace_every=every, fp8_fallback=fallback)
    trainer.fit(len(batches))
    return trainer, read_trace(trace)[0]


def _model(*float8: str) -> Net:
    torch.manual_seed(0)
    model = Net()
    if float8:
        apply_plan(model, _plan(*float8))
    return model


def test_fp8_events_on_sampled_steps_equal_cast_stats(tmp_path):
    model = _model("fc1", "fc2")
    weight0 = model.fc1.weight.detach().clone()
    batches = _batches()
    _, events = _train(tmp_path, model, batches)
    fp8 = [e for e in events if e["event"] == "fp8"]
    assert [(e["step"], e["module"]) for e in fp8] == [(s, m) for s in (1, 3, 5) for m in ("fc1", "fc2")]
    for e in fp8:
        assert {"input", "weight", "grad_output"} <= e.keys()
        assert all(set(e[role]) == KEYS for role in ("input", "weight", "grad_output"))
    first = fp8[0]
    e4m3 = torch.float8_e4m3fn
    # the input as cast: under CPU bf16 autocast the plan's Float8Linear casts it to bf16, as torchao's does on CUDA
    for role, tensor in (("input", batches[0][0].bfloat16()), ("weight", weight0)):
        want = cast_stats(tensor, dtype=e4m3, granularity="tensorwise")
        got = first[role]
        assert got["amax"] == pytest.approx(want["amax"])
        assert got["flushed_share"] == want["flushed_share"] and got["clipped_share"] == want["clipped_share"]
        # torchao's tensorwise scale: the format's max over amax, in fp32
        assert got["scale"] == pytest.approx(torch.finfo(e4m3).max / want["amax"], rel=1e-6)
    assert not [e for e in events if e["event"] == "fp8_budget"]


def test_a_flushing_input_is_named_once(tmp_path):
    _, events = _train(tmp_path, _model("fc1"), _batches(massive=True))
    fp8 = [e for e in events if e["event"] == "fp8"]
    cap = settings()["plan"]["max_flushed_share"]
    assert len(fp8) == 3 and all(e["input"]["flushed_share"] > cap for e in fp8)
    budget = [e for e in events if e["event"] == "fp8_budget"]
    assert len(budget) == 1
    b = budget[0]
    assert (b["step"], b["module"], b["role"], b["fallback"]) == (1, "fc1", "input", False)
    assert b["flushed_share"] == fp8[0]["input"]["flushed_share"] and b["max_flushed_share"] == cap


def test_fallback_walks_the_safer_chain_to_bf16(tmp_path):
    """--fp8-fallback is --fallback: a massive input feature flushes tensorwise, rowwise and rowwise_with_gw_hp
    alike (it sits in every row), so fc1 walks recipes.toml's chain to bf16; the object and its weight stay."""
    model = _model("fc1", "fc2")
    weight = model.fc1.weight
    trainer, events = _train(tmp_path, model, _batches(massive=True), fallback=True)
    falls = [(e["step"], e["module"], e["from"], e["to"], e["reason"]) for e in events if e["event"] == "fallback"]
    assert falls == [(1, "fc1", "float8_tensorwise", "float8_rowwise", "input_flushed"),
                     (2, "fc1", "float8_rowwise", "float8_rowwise_with_gw_hp", "input_flushed"),
                     (4, "fc1", "float8_rowwise_with_gw_hp", "bfloat16", "input_flushed")]
    budget = [e for e in events if e["event"] == "fp8_budget"]
    assert [(b["module"], b["role"], b["fallback"]) for b in budget] == [("fc1", "input", False)]
    assert type(model.fc1) is nn.Linear and type(model.fc2).__name__ == "Float8Linear"
    assert model.fc1.weight is weight and any(p is weight for g in trainer.optimizer.param_groups for p in g["params"])
    # the float8 statistics follow the layer: none for fc1 once it trains in bf16 (from step 5)
    assert [e["module"] for e in events if e["event"] == "fp8" and e["step"] == 5] == ["fc2"]
    assert list(model.state_dict()) == list(Net().state_dict())


def test_no_float8_no_fp8_events_and_the_same_trace(tmp_path, monkeypatch):
    _, events = _train(tmp_path, _model(), _batches())
    assert not [e for e in events if e["event"].startswith("fp8")]
    from ampaudit.runtime.fp8_stats import Fp8Stats

    monkeypatch.setattr(Fp8Stats, "attach", classmethod(lambda cls, *a, **k: None))
    _, before = _train(tmp_path, _model(), _batches(), name="without.jsonl")

    def strip(evs):
        return [{k: v for k, v in e.items() if k != "time"} for e in evs]
    assert strip(events) == strip(before)


def test_report_shows_the_float8_section(tmp_path):
    plan = tmp_path / "plan.json"
    shapes = {"fc1": (16, 64), "fc2": (64, 64), "head": (64, 1)}
    plan.write_text(json.dumps({"version": 1, "recipe": "tensorwise", "layers": [
        {"module": m, "choice": "float8" if m == "fc2" else "bfloat16",
         "shape": {"in_features": i, "out_features": o}} for m, (i, o) in shapes.items()]}))
    trace = tmp_path / "run.jsonl"
    runner = CliRunner(env={"COLUMNS": "160"})
    r = runner.invoke(app, ["train", str(ASSETS / "train_mlp.py"), "--steps", "3", "--plan", str(plan),
                            "--trace", str(trace), "--trace-every", "2"])
    assert r.exit_code == 0, r.output
    assert [(e["step"], e["module"]) for e in read_trace(trace)[0] if e["event"] == "fp8"] == [(1, "fc2"), (3, "fc2")]
    # a budget event, as a run whose layer flushed would write it
    with open(trace, "a") as fh:
        fh.write(json.dumps(ev("fp8_budget", 3, module="fc2", role="grad_output", flushed_share=0.8,
                               max_flushed_share=0.5, fallback=False)) + "\n")
    r = runner.invoke(app, ["report", str(trace)])
    assert r.exit_code == 0, r.output
    section = r.stdout.split("Float8 layers")[1].split("Recommendations")[0]
    assert "fc2" in section and "input" in section and "flushed" in section      # a header stacked in two lines
    assert "step 3: 80% of fc2's grad_output flushes to 0 in fp8 (budget 50%)" in section
    assert "ignored unknown events" not in r.stdout
    r = runner.invoke(app, ["report", str(trace), "--json"])
    fp8 = json.loads(r.stdout)["fp8"]
    assert [row["step"] for row in fp8["layers"]] == [3] and fp8["budget"][0]["role"] == "grad_output"


def test_fallback_needs_a_trace():
    r = CliRunner().invoke(app, ["train", str(ASSETS / "train_mlp.py"), "--steps", "1", "--fp8-fallback"])
    assert r.exit_code == 2 and "--fp8-fallback needs --trace" in r.output


@pytest.mark.slow
def test_the_trainer_and_the_hooks_import_no_torchao():
    code = ("import sys, ampaudit.train, ampaudit.runtime.session, ampaudit.runtime.fp8_stats; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torchao', 'rich')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
