"""A replay whose forward keeps a graph stops before memory runs out, and checks the forward without the backward
(ampaudit/runtime/memory_guard.py), where the OOM killer would end the check without a word."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import ampaudit
import ampaudit.runtime.memory_guard as memory_guard
from ampaudit.notes import collect
from ampaudit.runtime.locate import judge_against_fp32, replay
from ampaudit.runtime.memory_guard import MemoryGuard, MemoryShort, out_of_memory


class _Overflows(nn.Module):
    """fp16 overflows in the forward (1e6 times an activation is past 65504)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x) * 1e6


def _free(monkeypatch, mib_in_forward: float, mib_in_backward: float) -> None:
    monkeypatch.setattr(MemoryGuard, "EVERY_S", 0.0)
    monkeypatch.setattr(memory_guard, "free_mib", lambda: mib_in_backward
                        if torch._C._current_autograd_node() is not None else mib_in_forward)


def test_the_guard_raises_under_its_floor_and_reads_at_most_every_interval():
    reads = []
    guard = MemoryGuard(100, reader=lambda: reads.append(1) or 50.0, every_s=3600)
    with pytest.raises(MemoryShort, match="50 MiB .* under the 100 MiB floor"):
        guard.check()
    guard.check()                          # within the interval: not read again
    assert len(reads) == 1 and guard.lowest == 50.0
    MemoryGuard(10, reader=lambda: 50.0).check()
    assert out_of_memory(MemoryShort("x")) and out_of_memory(RuntimeError("DefaultCPUAllocator: can't allocate memory"))
    assert not out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))


def test_a_forward_short_of_memory_is_checked_again_without_the_backward(monkeypatch):
    torch.manual_seed(0)
    model, x = _Overflows(), torch.randn(2, 4)
    loss = lambda out: out.float().mean()          # noqa: E731
    full = replay(model, (x,), {}, dtype=torch.float16, loss=loss)
    _free(monkeypatch, 1.0, 1.0)
    with collect() as notes:
        short = replay(model, (x,), {}, dtype=torch.float16, loss=loss)
    assert short.backward_checked is False and full.backward_checked is True
    assert [e for e in full if e["phase"] == "forward"] == list(short)
    assert short and all(e["kind"] != "error" for e in short)
    assert any("backward pass was not checked for inf/NaN: memory ran short" in n for n in notes), notes
    assert all(p.grad is None for p in model.parameters())


def test_a_backward_short_of_memory_keeps_the_forward_events(monkeypatch):
    torch.manual_seed(0)
    model, x = _Overflows(), torch.randn(2, 4)
    _free(monkeypatch, 1e9, 1.0)
    with collect() as notes:
        events = replay(model, (x,), {}, dtype=torch.float16, loss=lambda out: out.float().sum() * 1e6)
    assert events.backward_checked is False
    assert events and all(e["phase"] == "forward" and e["kind"] != "error" for e in events)
    assert any("memory ran short while it ran" in n for n in notes), notes
    # FP32's backward short of memory too: a low-precision backward origin is not judged, its forward ones are.
    fake = [{**events[0]}, {**events[0], "phase": "backward", "op": "aten.mm"}]
    judged = judge_against_fp32(model, fake, (x,), {}, dtype=torch.float16, loss=lambda out: out.float().sum())
    assert [e["phase"] for e in judged] == ["forward"]


def test_check_calibrate_completes_with_a_note_when_memory_is_short(monkeypatch):
    torch.manual_seed(0)
    model, x = _Overflows(), torch.randn(2, 4)
    _free(monkeypatch, 1.0, 1.0)
    report = ampaudit.check(model, x, calibrate=True)
    assert any("backward pass was not checked for inf/NaN: memory ran short" in n for n in report.notes)
    assert any(f.family == "nonfinite" for f in report.findings)      # the forward's overflow is still found


def test_watch_warns_when_its_replay_runs_short_of_memory(monkeypatch):
    from ampaudit.runtime.memory_guard import MemoryShortWarning
    from ampaudit.runtime.watch import watch

    torch.manual_seed(0)
    model = _Overflows()
    _free(monkeypatch, 1.0, 1.0)
    with pytest.warns(MemoryShortWarning, match="replaying step 0: its backward was not checked"):
        with watch(model, stats=False) as w:        # the first pass is replayed under the locator
            w.set_step(0)
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(torch.randn(2, 4))
            out.float().mean().backward()
    assert w.nonfinite and all(e["phase"] == "forward" for e in w.nonfinite)
