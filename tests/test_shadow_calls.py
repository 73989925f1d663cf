"""A composite's own re-run takes a child's answer from the FP32 shadow only where the child's inputs, RNG and
tensors are the shadow's (ampaudit/runtime/shadow_calls.py): compare_to_fp32's rows are the same numbers with and
without it, and containers stop costing an FP32 forward per nesting level."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

import ampaudit.runtime.shadow_calls as shadow_calls
from ampaudit.policy import settings
from ampaudit.runtime.compare import compare_to_fp32


class Block(nn.Module):
    """A residual block: ``norm`` is fed the block's input untouched (servable), ``fc2`` what the block computed
    itself after an in-place add (never servable)."""

    def __init__(self, d: int = 16, p: float = 0.0):
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, d), nn.Linear(d, d)
        self.drop = nn.Dropout(p)

    def forward(self, x):
        h = self.fc1(self.norm(x))
        h += x                       # in place on fc1's output: its kept answer is stale
        return self.fc2(self.drop(torch.relu(h)))


class Net(nn.Module):
    def __init__(self, p: float = 0.0):
        super().__init__()
        self.shared = nn.Linear(16, 16)
        self.body = nn.Sequential(Block(p=p), Block(p=p), nn.Sequential(Block(p=p)))
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.shared(self.body(self.shared(x))))


def _rows(model, x, cap_mib, monkeypatch):
    monkeypatch.setitem(settings()["calibration"], "shadow_calls_mib", cap_mib)
    made = []
    real_init = shadow_calls.ShadowCalls.__init__

    def init(self, *a, **k):
        real_init(self, *a, **k)
        made.append(self)
    monkeypatch.setattr(shadow_calls.ShadowCalls, "__init__", init)
    torch.manual_seed(1)
    rows = compare_to_fp32(model, (x,), {}, dtype=torch.bfloat16)
    return rows, sum(c.served for c in made)


def _same(a, b):
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


@pytest.mark.parametrize("train", [False, True])
def test_rows_are_identical_with_and_without_the_kept_calls(train, monkeypatch):
    torch.manual_seed(0)
    model, x = Net(p=0.3 if train else 0.0).train(train), torch.randn(3, 16)
    kept, served = _rows(model, x, 2048, monkeypatch)
    again, none = _rows(model, x, 0, monkeypatch)
    assert none == 0 and served > 0
    assert [r["module"] for r in kept] == [r["module"] for r in again]
    for r, s in zip(kept, again):
        assert r.keys() == s.keys()
        assert all(_same(r[k], s[k]) for k in r), r["module"]
    assert any(r.get("local_rel_l2", 0) > 0 for r in kept)       # the re-runs measured something


def test_a_container_serves_every_child_and_a_written_output_is_computed_again(monkeypatch):
    torch.manual_seed(0)
    model, x = Net().eval(), torch.randn(3, 16)
    calls = []
    real = shadow_calls.ShadowCalls._matches

    def matches(self, call, args, kwargs):
        ok = real(self, call, args, kwargs)
        calls.append((type(call.mod).__name__, ok))
        return ok
    monkeypatch.setattr(shadow_calls.ShadowCalls, "_matches", matches)
    _rows(model, x, 2048, monkeypatch)
    served = {name for name, ok in calls if ok}
    # The root hands the Sequential the shared layer's output and each Block gets the previous one's: served.
    assert {"Block", "Sequential", "LayerNorm"} <= served
    # fc1's output is written by `h += x` after the shadow's call; fc2 sees what the block computed.
    linear = [ok for name, ok in calls if name == "Linear"]
    assert linear and not all(linear)


def test_the_kept_tensors_stay_under_the_cap(monkeypatch):
    torch.manual_seed(0)
    model, x = Net().eval(), torch.randn(3, 16)
    seen = []
    real_post = shadow_calls.ShadowCalls._post

    def post(self, *a):
        real_post(self, *a)
        seen.append(self.held)
    monkeypatch.setattr(shadow_calls.ShadowCalls, "_post", post)
    monkeypatch.setitem(settings()["calibration"], "shadow_calls_mib", 0)
    compare_to_fp32(model, (x,), {}, dtype=torch.bfloat16)
    assert seen and max(seen) == 0


def test_a_leafs_own_rerun_is_not_kept_as_a_shadow_call(monkeypatch):
    torch.manual_seed(0)
    model, x = Net().eval(), torch.randn(3, 16)
    kept = []
    real_post = shadow_calls.ShadowCalls._post

    def post(self, mod, args, kwargs, out):
        before = len(self._stack)
        real_post(self, mod, args, kwargs, out)
        if not self.paused and len(self._stack) < before:
            kept.append(mod)
    monkeypatch.setattr(shadow_calls.ShadowCalls, "_post", post)
    compare_to_fp32(model, (x,), {}, dtype=torch.bfloat16)
    # One frame per module call of the shadow (the shared Linear twice), none for the re-runs.
    assert len(kept) == sum(1 for _ in model.modules()) + 1


class WritesKeyword(nn.Module):
    def forward(self, x, *, scale):
        scale.mul_(1.0)              # a write that keeps the values: only the version counter tells
        return x * scale


class PassesKeyword(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.child = nn.Linear(16, 16), WritesKeyword()

    def forward(self, x):
        return self.child(self.lin(x), scale=torch.ones(16))


def test_a_child_that_writes_into_a_keyword_input_is_computed_not_served(monkeypatch):
    torch.manual_seed(0)
    outcomes = []
    real = shadow_calls.ShadowCalls._matches

    def matches(self, call, args, kwargs):
        ok = real(self, call, args, kwargs)
        outcomes.append((type(call.mod).__name__, ok))
        return ok
    monkeypatch.setattr(shadow_calls.ShadowCalls, "_matches", matches)
    _rows(nn.Sequential(PassesKeyword()).eval(), torch.randn(3, 16), 2048, monkeypatch)
    assert ("PassesKeyword", True) in outcomes          # the container's child is served ...
    assert all(name != "WritesKeyword" for name, _ in outcomes)    # ... the writer is never kept


class Knob:
    """A mutable argument that is not a tensor: its value can change while the object stays the same."""

    def __init__(self):
        self.gain = 1.0


class Gain(nn.Module):
    def forward(self, x, opts, factor, knob=None):
        return x * (opts["gain"] * factor * (knob.gain if knob is not None else 1.0))


class TurnsItsKnobs(nn.Module):
    """Calls its child with its input untouched (servable) and, by ``changes``, a dict or an object it changes
    after the call: then the child's answer in the re-run is not the shadow's, though every argument is the same
    object as the shadow's."""

    def __init__(self, changes: str):
        super().__init__()
        self.gain, self.fc, self.changes = Gain(), nn.Linear(16, 16), changes
        self.knob, self.opts = Knob(), {"gain": 1.0}

    def forward(self, x):
        y = self.gain(x, self.opts, 2.0, *([self.knob] if self.changes == "object" else []))
        if self.changes == "dict":
            self.opts["gain"] += 1.0
        elif self.changes == "object":
            self.knob.gain += 1.0
        return self.fc(y)


@pytest.mark.parametrize("changes", ["nothing", "dict", "object"])
def test_a_mutable_argument_is_not_taken_as_unchanged_because_it_is_the_same_object(changes, monkeypatch):
    # The rows are what computing every call gives (cap 0: nothing kept); unchanged plain arguments still serve.
    x = torch.randn(3, 16)
    torch.manual_seed(0)
    kept, served = _rows(TurnsItsKnobs(changes).eval(), x, 2048, monkeypatch)
    torch.manual_seed(0)
    again, _ = _rows(TurnsItsKnobs(changes).eval(), x, 0, monkeypatch)
    assert [(r["module"], r.get("local_rel_l2")) for r in kept] == [(r["module"], r.get("local_rel_l2"))
                                                                   for r in again]
    assert (served > 0) is (changes == "nothing")


class Encoder(nn.Module):
    """Returns a dict, as transformers' encoders return a ModelOutput (a pooled output beside the states)."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        h = self.fc(x)
        return {"last_hidden_state": h, "pooler_output": h[:, 0]}


class Tower(nn.Module):
    """CLIP's get_text_features: the caller rebinds a field of the container its child returned,
    ``outputs["pooler_output"] = projection(outputs["pooler_output"])``."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.encoder, self.projection = Encoder(d), nn.Linear(d, d)

    def forward(self, x):
        out = self.encoder(x)
        out["pooler_output"] = self.projection(out["pooler_output"])
        return out["pooler_output"] * 2.0, out


def test_a_container_the_caller_rebinds_a_field_of_is_served_as_the_child_returned_it(monkeypatch):
    # The kept call held the container itself: served to the re-run after the caller had rebound its field, the
    # encoder "returned" the projected output, which the re-run projected again, and the tower's own error read
    # 100x the dtype's rounding (a false AMP701 error on CLIP's top module).
    torch.manual_seed(0)
    model, x = Tower().eval(), torch.randn(3, 4, 16)
    kept, served = _rows(model, x, 2048, monkeypatch)
    again, _ = _rows(model, x, 0, monkeypatch)
    assert served > 0
    own = {r["module"]: r["local_rel_l2"] for r in kept}
    assert own[""] == pytest.approx({r["module"]: r["local_rel_l2"] for r in again}[""], rel=1e-6)
    assert own[""] < 0.01
