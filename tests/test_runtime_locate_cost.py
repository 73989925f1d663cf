"""The locator's cheap paths find what the elementwise check and anomaly mode would: one aminmax per output,
anomaly mode's stacks only on the rerun a backward origin triggers."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import ampaudit.runtime.locate as locate
from ampaudit.runtime.locate import _finite, replay


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf"), None])
@pytest.mark.parametrize("n", [1, 33, 70000])
def test_finite_agrees_with_isfinite_all(dtype, value, n):
    t = torch.randn(n).to(dtype)
    if value is not None:
        t[n // 2] = value
    for view in (t, t[::2], t.view(-1, 1).expand(n, 3).t()):
        if view.numel():
            assert _finite(view) == bool(torch.isfinite(view).all())


def test_finite_holds_the_dtype_extremes_and_complex():
    assert _finite(torch.tensor([65504.0, -65504.0], dtype=torch.float16))     # max and min: no overflow
    assert not _finite(torch.tensor([1 + 1j, complex("inf")]))                 # no aminmax: elementwise


class _Finite(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x).relu()


def _count_anomaly(monkeypatch) -> list[int]:
    calls = []
    real = torch.autograd.detect_anomaly

    def counted(*a, **k):
        calls.append(1)
        return real(*a, **k)
    monkeypatch.setattr(locate.torch.autograd, "detect_anomaly", counted)
    return calls


def test_a_clean_backward_replays_once_without_anomaly_mode(monkeypatch):
    calls = _count_anomaly(monkeypatch)
    events = replay(_Finite(), (torch.randn(2, 4),), {}, dtype=torch.bfloat16,
                    loss=lambda out: out.float().mean())
    assert events == [] and calls == []


def test_a_backward_origin_reruns_with_anomaly_mode_for_its_line(monkeypatch):
    from _shared_models import BackwardOverflow

    calls = _count_anomaly(monkeypatch)
    torch.manual_seed(0)
    events = replay(BackwardOverflow(), (torch.randn(4, 8) * 1e-4,), {}, dtype=torch.float16,
                    upstream=[torch.full((4, 1), 1000.0)])
    backward = [e for e in events if e["phase"] == "backward"]
    assert calls == [1]                                   # the first replay ran without it
    assert backward and backward[0]["module"] == "boost"
    assert (backward[0]["source"] or "").endswith("_shared_models.py:28")   # a line only anomaly mode gives
