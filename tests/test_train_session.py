"""The trainer's trace goes through the callbacks' WatchSession: one meta line per trace (a resumed run appends),
a shared TraceWriter left open, no trace at all on request, and skip attribution under O1 and O2."""
import io
import json
import math

import pytest
import torch
from conftest import ASSETS, load_module

from ampaudit.runtime.session import WatchSession
from ampaudit.runtime.trace import MemoryTrace, TraceWriter, read_trace
from ampaudit.train import Trainer


@pytest.fixture(scope="module")
def mlp():
    return load_module(ASSETS / "train_mlp.py")


def _trainer(mlp, **kwargs):
    return Trainer(mlp.build_model(dropout=0.0), mlp.loss_fn, mlp.train_data, dtype="float16", trace_every=2,
                   handle_signals=False, **kwargs)


def _events(path):
    events, problems = read_trace(path)
    assert not problems
    return events


def test_the_trainer_holds_the_callbacks_session(mlp, tmp_path):
    trainer = _trainer(mlp, trace=tmp_path / "t.jsonl")
    assert type(trainer.session) is WatchSession
    trainer.fit(steps=2)
    events = _events(tmp_path / "t.jsonl")
    meta = events[0]
    # the trainer's own meta line: no callback fields, the run's step
    assert meta["event"] == "meta" and meta["source"] == "train" and meta["step"] == 0 and "integration" not in meta
    assert meta["opt_level"] == "O1" and meta["device"] == "cpu" and meta["clip"] == {"mode": None, "max": None}
    steps = [e for e in events if e["event"] == "step"]
    assert [s["step"] for s in steps] == [1, 2]
    assert set(steps[0]) == {"event", "step", "loss", "scale", "skipped", "grad_norm", "clipped", "lr", "time"}
    assert steps[0]["grad_norm"] > 0 and steps[0]["time"] > 0
    assert any(e["event"] == "stats" for e in events) and not trainer.session.active


def test_a_resumed_run_appends_without_a_second_meta(mlp, tmp_path):
    trace, ckpt = tmp_path / "t.jsonl", tmp_path / "ckpt"
    _trainer(mlp, trace=trace, checkpoint_dir=ckpt).fit(steps=3)
    _trainer(mlp, trace=trace, checkpoint_dir=ckpt).fit(steps=5, resume=True)
    events = _events(trace)
    assert [e["event"] for e in events].count("meta") == 1
    assert [e["step"] for e in events if e["event"] == "step"] == [1, 2, 3, 4, 5]
    assert [e["step"] for e in events if e["event"] == "checkpoint"] == [3, 5]
    # a fresh run starts the trace over
    _trainer(mlp, trace=trace).fit(steps=1)
    assert [e["event"] for e in _events(trace)].count("meta") == 1
    assert [e["step"] for e in _events(trace) if e["event"] == "step"] == [1]


def test_a_shared_writer_gets_one_meta_and_stays_open(mlp):
    buf = io.StringIO()
    writer = TraceWriter(buf)
    trainer = _trainer(mlp, trace=writer)
    trainer.fit(steps=2)
    trainer.fit(steps=3)      # continued: appends
    writer.write("note", step=None)
    events = [json.loads(line) for line in buf.getvalue().splitlines()]
    assert [e["event"] for e in events].count("meta") == 1 and events[-1]["event"] == "note"
    assert [e["step"] for e in events if e["event"] == "step"] == [1, 2, 3]


def test_no_trace_means_no_watch_and_no_events(mlp):
    trainer = _trainer(mlp)
    trainer.fit(steps=2)
    assert not trainer.session.active and trainer.session.events == []
    model = mlp.build_model()
    session = WatchSession(None, memory=False)
    session.start(model, dtype=torch.float16, source="train", meta={"dtype": "float16"})
    session.begin_step(1)
    session.write_step(loss=1.0, scale=None, skipped=False, grad_norm=None, clipped=False, lr=None)
    session.write("checkpoint", step=1, path="x")
    session.close_watch()
    session.close()
    assert not session.active and session.events == [] and session.watch is None
    assert not model._forward_hooks and not model._forward_pre_hooks


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_skips_name_the_overflowing_parameter(mlp, tmp_path, opt_level):
    model = mlp.build_model(dropout=0.0)
    trainer = Trainer(model, mlp.loss_fn, mlp.train_data, dtype="float16", opt_level=opt_level,
                      trace=tmp_path / "t.jsonl", handle_signals=False)
    bad = 2
    model.fc2.weight.register_hook(lambda g: g * math.inf if trainer.step + 1 == bad else g)
    trainer.fit(steps=3)
    events = _events(tmp_path / "t.jsonl")
    skips = [e for e in events if e["event"] == "skip"]
    assert [e["step"] for e in skips] == [bad] and "fc2.weight" in skips[0]["params"] and "fc2" in skips[0]["modules"]
    assert skips[0]["scale"] == 65536.0
    assert [e["skipped"] for e in events if e["event"] == "step"] == [False, True, False]
    assert trainer._skips.last["params"] == skips[0]["params"]


def _memory_run(mlp, trace=None):
    session = WatchSession(trace, every=1)
    session.start(mlp.build_model(dropout=0.0), dtype=torch.float16, source="train", meta={"dtype": "float16"})
    session.begin_step(1)
    session.write_step(loss=0.5, scale=65536.0, skipped=False, grad_norm=math.inf, clipped=None, lr=1e-3)
    session.write("note", step=1, sizes=(1, 2), amax=torch.tensor(float("nan")))    # a caller's own kind
    session.close()
    return session


def test_memory_mode_events_read_as_a_trace_file_would(mlp):
    session = _memory_run(mlp)
    events = session.events
    assert [e["event"] for e in events] == ["meta", "step", "note"]
    assert events[1]["grad_norm"] == "inf" and events[2]["sizes"] == [1, 2] and events[2]["amax"] == "nan"
    assert json.loads(json.dumps(events)) == events
    events.append({"event": "mine"})      # each read is the caller's own list
    assert session.events == events[:-1]


def test_a_shared_memory_trace_is_the_sessions_events(mlp):
    trace = MemoryTrace()
    session = _memory_run(mlp, trace)
    assert [e["event"] for e in session.events] == ["meta", "step", "note"]
    assert session.events == trace.events
