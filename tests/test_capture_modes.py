"""fx, torch.export and dispatch-level captures give the same findings on the same model."""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from torch import nn

import ampaudit

from conftest import PLANTED, SAMPLES, load_module

MODELS = sorted(p for folder in (PLANTED, SAMPLES) if folder.is_dir() for p in folder.glob("*.py"))


def keys(report, *, drop_info: bool = False):
    # Distinct (rule, module, line): captures that decompose an op differently hit it a different number of times.
    return sorted({(f.rule, f.module, (f.location or {}).get("line")) for f in report.findings
                   if not (drop_info and f.severity == "info")})


@pytest.mark.parametrize("path", MODELS, ids=lambda p: p.name)
def test_export_and_dispatch_agree_with_fx(path):
    m = load_module(path)
    args = m.example_inputs()
    fx_report = ampaudit.check(m.build_model(), *args, device="cpu", capture_mode="fx")
    assert fx_report.capture == "fx"
    ex = ampaudit.check(m.build_model(), *args, device="cpu", capture_mode="export")
    assert ex.capture == "export" and keys(ex) == keys(fx_report)
    # Dispatch sees the decomposed ops (adaptive pooling runs as a mean): it may add an info, never lose one.
    di = ampaudit.check(m.build_model(), *args, device="cpu", capture_mode="dispatch")
    assert di.capture == "dispatch" and keys(di, drop_info=True) == keys(fx_report, drop_info=True)


class DataDependent(nn.Module):
    """fx and export cannot follow `if h.sum() > 0`; the dispatch recorder takes the path these inputs take."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 30)
        self.norm = nn.LayerNorm(30)

    def forward(self, x):
        h = self.fc(x)
        if h.sum() > 0:
            h = torch.softmax(h, -1)
        else:
            h = torch.softmax(-h, -1)
        return self.norm(h)


def test_auto_falls_back_to_dispatch_with_module_and_line():
    report = ampaudit.check(DataDependent(), torch.randn(4, 16), device="cpu")
    assert report.capture == "dispatch"
    notes = [n for n in report.notes if n.startswith("audited the whole model through dispatch-level recording")]
    # One note says what ran and why each earlier capture did not, by the first sentence of its error.
    assert len(notes) == 1 and "(fx was not used: " in notes[0] and "; export was not used: " in notes[0]
    found = {(f.rule, f.module) for f in report.findings}
    assert {("AMP101", "fc"), ("AMP201", ""), ("AMP301", "norm")} <= found
    softmax = next(f for f in report.findings if f.rule == "AMP201")
    assert softmax.location["file"].endswith("test_capture_modes.py") and "softmax" in softmax.code


def test_forward_raising_under_autocast_is_recorded_in_fp32(planted):
    m = planted("mask_fill_crash")
    report = ampaudit.check(m.build_model(), *m.example_inputs(), device="cpu", capture_mode="dispatch")
    assert any("raised" in n for n in report.notes)
    assert any(f.rule == "AMP401" and f.module == "attn" for f in report.findings)


def test_dispatch_capture_keeps_shapes_past_data_dependent_ops():
    class Select(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 32)
            self.fc2 = nn.Linear(32, 30)

        def forward(self, x):
            h = self.fc(x)
            keep = torch.nonzero(h[:, 0] > -1e9).squeeze(1)   # no fake kernel: output size depends on values
            return self.fc2(h[keep]).softmax(-1)

    report = ampaudit.check(Select(), torch.randn(4, 8), device="cpu", capture_mode="dispatch")
    assert not any("shapes unknown" in n for n in report.notes)
    softmax = next(f for f in report.findings if f.rule == "AMP201")
    assert softmax.details["depth"] == 30


@pytest.mark.parametrize("mode", ["fx", "export", "dispatch"])
def test_an_audit_changes_no_buffer_of_a_training_mode_model(mode):
    # Capturing runs the model: BatchNorm in training mode would move its statistics and count a batch.
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8)).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ampaudit.check(model, torch.randn(2, 3, 8, 8), capture_mode=mode)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


class MovesItsState(nn.Module):
    """A training-mode forward that writes what the user holds: an EMA teacher (in place, or through ``.data``,
    which the parameter's version counter does not see and torch.export cannot capture), BatchNorm statistics, a
    submodule's mode and a requires_grad flag."""

    def __init__(self, via_data: bool):
        super().__init__()
        self.via_data = via_data
        self.student = nn.Linear(8, 8)
        self.teacher = nn.Linear(8, 8).requires_grad_(False)
        self.norm = nn.BatchNorm1d(8)

    def forward(self, x):
        if self.training:
            with torch.no_grad():
                for t, s in zip(self.teacher.parameters(), self.student.parameters()):
                    (t.data if self.via_data else t).mul_(0.5).add_(s.detach(), alpha=0.5)
            self.teacher.eval()
            self.student.bias.requires_grad_(False)
        return self.norm(self.student(x)) + self.teacher(x)


def _state(model: nn.Module):
    tensors = {k: (v.detach().clone(), v._version) for k, v in
               list(model.named_parameters()) + list(model.named_buffers())}
    flags = {k: p.requires_grad for k, p in model.named_parameters()}
    modes = {k: m.training for k, m in model.named_modules()}
    return tensors, flags, modes


@pytest.mark.parametrize("calibrate", [False, True], ids=["check", "calibrate"])
@pytest.mark.parametrize("mode", ["fx", "export", "dispatch"])
def test_an_audit_leaves_every_parameter_buffer_mode_and_flag_as_the_user_had_them(mode, calibrate):
    torch.manual_seed(0)
    model = MovesItsState(via_data=mode != "export").train()
    (tensors, flags, modes), objects = _state(model), dict(model.named_parameters())
    report = ampaudit.check(model, torch.randn(4, 8), device="cpu", dtype="bfloat16", capture_mode=mode,
                            calibrate=calibrate)
    assert report.capture == mode
    after, after_flags, after_modes = _state(model)
    for name, (value, version) in tensors.items():
        assert torch.equal(after[name][0], value), name
    assert after_flags == flags and after_modes == modes
    assert all(p is objects[k] for k, p in model.named_parameters())
    # Tensors the forward did not write keep their version counter: nothing the caller holds is invalidated.
    assert after["student.weight"][1] == tensors["student.weight"][1]


def test_a_check_leaves_the_planted_ema_teacher_where_it_was():
    # tests/planted/ema_teacher_bf16.py updates its teacher in forward (training mode): check must not.
    m = load_module(Path(__file__).parent / "planted" / "ema_teacher_bf16.py")
    model = m.build_model().train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ampaudit.check(model, *m.example_inputs(), device="cpu", dtype="bfloat16")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


class DrawsFromEveryRng(nn.Module):
    """Dropout (torch's generator), and a stochastic-depth coin from Python's ``random`` and NumPy's."""

    def __init__(self):
        super().__init__()
        self.fc, self.drop = nn.Linear(8, 8), nn.Dropout(0.5)

    def forward(self, x):
        import numpy as np

        keep = random.random() < 0.9 and np.random.rand() < 0.9
        return self.drop(self.fc(x)) if keep else x


@pytest.mark.parametrize("calibrate", [False, True], ids=["check", "calibrate"])
@pytest.mark.parametrize("mode", ["fx", "dispatch"])
def test_a_script_draws_the_same_numbers_after_a_check_as_without_it(mode, calibrate):
    import numpy as np

    model, x = DrawsFromEveryRng().train(), torch.randn(4, 8)

    def draws():
        return torch.rand(3), random.random(), float(np.random.rand())

    torch.manual_seed(3), random.seed(3), np.random.seed(3)
    without = draws()
    torch.manual_seed(3), random.seed(3), np.random.seed(3)
    ampaudit.check(model, x, device="cpu", dtype="bfloat16", capture_mode=mode, calibrate=calibrate)
    after = draws()
    assert torch.equal(after[0], without[0]) and after[1:] == without[1:]


def test_the_snapshot_puts_the_rngs_back_each_time_it_is_called():
    from ampaudit.runtime.replay_state import state_snapshot

    model = nn.Linear(2, 2)
    torch.manual_seed(5), random.seed(5)
    restore = state_snapshot(model)
    first = torch.rand(2), random.random()
    restore()
    assert torch.equal(torch.rand(2), first[0]) and random.random() == first[1]
    restore()
    assert torch.equal(torch.rand(2), first[0])


def _draws():
    import numpy as np

    return torch.rand(3), random.random(), float(np.random.rand())


def test_one_rng_owner_serves_the_snapshot_and_the_checkpoint(tmp_path):
    """The global RNGs (torch, Python, NumPy) captured once: put back in memory, and after a weights-only load."""
    import numpy as np

    from ampaudit.runtime.replay_state import global_rng_state, rng_snapshot, set_global_rng_state

    torch.manual_seed(11), random.seed(11), np.random.seed(11)
    state, restore = global_rng_state(), rng_snapshot()
    first = _draws()
    torch.save(state, tmp_path / "rng.pt")
    restore()
    assert _equal(_draws(), first)
    torch.manual_seed(0), random.seed(0), np.random.seed(0)
    set_global_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert _equal(_draws(), first)
    assert _equal(_draws(), _draws()) is False      # the draws do move on: the test can fail


def _equal(a: tuple, b: tuple) -> bool:
    return bool(torch.equal(a[0], b[0])) and a[1:] == b[1:]
