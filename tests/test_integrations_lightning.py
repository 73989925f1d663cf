"""AmpAuditCallback inside a real Lightning ``fit`` on CPU, with Lightning's own fp16 GradScaler."""
from __future__ import annotations

import importlib
import sys
import warnings

import pytest
import torch
import torch.nn as nn

from _integrations_env import import_or_skip
from ampaudit.integrations import MissingExtraError

L = import_or_skip("lightning", "lightning")
from lightning.pytorch.plugins import MixedPrecision  # noqa: E402

from ampaudit.integrations.lightning import AmpAuditCallback, precision_dtype  # noqa: E402
from ampaudit.report.trace_summary import collect  # noqa: E402
from ampaudit.runtime.trace import read_trace  # noqa: E402
from ampaudit.runtime.watch import NonFiniteError  # noqa: E402


class Cube(nn.Module):
    """x**3 overflows fp16 above 40: an inf that appears inside this module."""

    def forward(self, x):
        return x + 0.044715 * x ** 3


class Net(L.LightningModule):
    def __init__(self, gain: float = 1.0):
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.act = Cube()
        self.out = nn.Linear(32, 1)
        self.gain = gain
        self.poison_step: int | None = None      # make inp.weight's gradient inf on this step
        self.inp.weight.register_hook(self._poison)

    def _poison(self, grad):
        return grad * float("inf") if self.trainer.global_step == self.poison_step else grad

    def forward(self, x):
        return self.out(self.act(self.inp(x) * self.gain))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self(x).float(), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _loader(n: int = 48):
    g = torch.Generator().manual_seed(0)
    ds = torch.utils.data.TensorDataset(torch.randn(n, 16, generator=g), torch.randn(n, 1, generator=g))
    return torch.utils.data.DataLoader(ds, batch_size=8)


def _fit(model: Net, callback: AmpAuditCallback, steps: int, **kw) -> L.Trainer:
    # CPU fp16 autocast with a real GradScaler: Lightning's "16-mixed" plugin, given explicitly (the
    # precision="16-mixed" flag turns into bf16 on CPU).
    # A modest initial scale: the default 65536 overflows this model's fp16 weight gradients on step 0.
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=1024.0))
    trainer = L.Trainer(accelerator="cpu", plugins=[plugin], max_steps=steps,
                        callbacks=[callback], logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, _loader())
    return trainer


def test_fit_writes_a_trace_with_steps_stats_divergence_and_skip_attribution(tmp_path):
    torch.manual_seed(0)
    model = Net()
    model.poison_step = 2
    trace = tmp_path / "run.jsonl"
    callback = AmpAuditCallback(trace, every=2, divergence_every=3)
    _fit(model, callback, steps=5)
    events, problems = read_trace(trace)
    assert problems == []
    meta = events[0]
    assert meta["event"] == "meta" and meta["integration"] == "lightning" and meta["dtype"] == "float16"
    data = collect(events)
    assert [r.step for r in data.steps] == [0, 1, 2, 3, 4]
    assert data.skipped_steps == [2]
    # the skip comes from Lightning's scaler (the scale backs off) and names the poisoned parameter
    assert [(s["step"], s["params"], s["modules"]) for s in data.skips] == [(2, ["inp.weight"], ["inp"])]
    scales = {r.step: r.scale for r in data.steps}
    assert scales[3] == scales[2] / 2
    assert all(r.loss is not None and math_finite(r.loss) for r in data.steps)
    assert all(math_finite(r.grad_norm) for r in data.steps if r.step != 2)
    assert {s["module"] for s in data.stats} >= {"inp", "act", "out"}
    assert {d["step"] for d in data.divergence} == {0, 3}
    assert {d["module"] for d in data.divergence if d["scope"] == "local"} >= {"inp", "act", "out"}
    # the hooks are gone once fit ends
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_first_nonfinite_names_the_module_and_op():
    torch.manual_seed(0)
    model = Net(gain=60.0)                        # |x| > 40 inside act: x**3 overflows fp16
    callback = AmpAuditCallback(every=1)          # no trace file: events stay in memory
    _fit(model, callback, steps=2)
    first = next(e for e in callback.events if e["event"] == "nonfinite")
    assert (first["module"], first["op"], first["phase"]) == ("act", "aten.pow", "forward")
    assert "test_integrations_lightning.py" in first["source"]


def test_raise_on_nonfinite_stops_fit_and_removes_hooks():
    torch.manual_seed(0)
    model = Net(gain=60.0)
    with pytest.raises(NonFiniteError, match="act"):
        _fit(model, AmpAuditCallback(raise_on_nonfinite=True), steps=3)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_the_callback_and_the_trainer_drive_one_session_class():
    # one owner of a watched run's trace: the callback's session is the class the Trainer holds
    from ampaudit.runtime.session import WatchSession
    from ampaudit.train import Trainer

    trainer = Trainer(nn.Linear(4, 1), lambda out, y: out.mean(), lambda: [], dtype="float16", handle_signals=False)
    assert type(AmpAuditCallback().session) is type(trainer.session) is WatchSession


def test_precision_dtype():
    assert precision_dtype("16-mixed") is torch.float16
    assert precision_dtype("bf16-mixed") is torch.bfloat16
    assert precision_dtype("32-true") is torch.float32


def test_missing_lightning_names_the_extra(monkeypatch):
    for name in ("lightning", "lightning.pytorch", "pytorch_lightning"):
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.delitem(sys.modules, "ampaudit.integrations.lightning", raising=False)
    with pytest.raises(MissingExtraError) as info:
        importlib.import_module("ampaudit.integrations.lightning")
    assert "needs the 'lightning' package" in str(info.value)
    assert info.value.hint == "pip install 'ampaudit[lightning]'"
    assert isinstance(info.value, ImportError)


def math_finite(x) -> bool:
    return x is not None and x == x and abs(x) != float("inf")
