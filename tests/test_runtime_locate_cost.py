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


class _Stack(nn.Module):
    def __init__(self, depth: int = 4):
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(8, 8) for _ in range(depth)])

    def forward(self, x):
        return self.layers(x)


def test_backward_drops_each_parameter_gradient_once_made():
    # The replay's backward reads every op; it does not keep the parameters' gradients (the model's size again):
    # by the time the first layer's gradient arrives, those of the layers after it are freed.
    import weakref

    model, alive = _Stack(), []
    refs: dict[str, weakref.ref] = {}
    names = {p: n for n, p in model.named_parameters()}
    handles = [p.register_hook(lambda g, n=n: refs.__setitem__(n, weakref.ref(g))) for p, n in names.items()]
    first = model.layers[0].weight
    handles.append(first.register_hook(
        lambda g: alive.append(sorted(n for n, r in refs.items() if r() is not None and not n.startswith("layers.0")))))
    x = torch.randn(3, 8)
    events = replay(model, (x,), {}, dtype=torch.bfloat16, loss=lambda out: out.float().mean())
    for h in handles:
        h.remove()
    assert events == [] and len(refs) == 8
    assert alive == [[]], alive
    assert all(p.grad is None for p in model.parameters())        # nothing written, as before
