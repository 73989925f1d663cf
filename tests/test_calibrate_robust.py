"""Calibration never crashes on a real model's outputs: empty tensors (a detector without detections), integer
and boolean outputs, tuples, dicts and dataclasses, float8, an op CPU has no float16 kernel for, a statistic that
fails. What could not be measured is noted (ampaudit.notes), not raised."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import ampaudit
from ampaudit.analysis.calibrate import calibrate
from ampaudit.notes import collect
from ampaudit.policy import Policy


class _Net(nn.Module):
    def __init__(self, out):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.head = nn.Linear(8, 4)
        self.out = out

    def forward(self, x):
        return self.out(self, self.fc(x))


@dataclasses.dataclass
class Detections:
    scores: torch.Tensor
    boxes: torch.Tensor


OUTPUTS = {
    "empty": lambda m, y: y[y > 1e6],                           # no value that large: nothing selected
    "empty batch through a module": lambda m, y: (y.sum(), m.head(y[:0])),
    "dict": lambda m, y: {"logits": y, "labels": y.argmax(-1), "keep": y > 0, "none": None, "empty": y[:0]},
    "bool": lambda m, y: y > 0,
    "int": lambda m, y: y.argmax(-1),
    "tuple": lambda m, y: (y, (y.argmax(-1), [y[:0]]), 3),
    "float8": lambda m, y: (y, y.to(torch.float8_e4m3fn)),
}


@pytest.mark.parametrize("device", ["cuda", "cpu"])
@pytest.mark.parametrize("kind", sorted(OUTPUTS))
def test_check_calibrate_completes_on_any_output(kind, device):
    torch.manual_seed(0)
    report = ampaudit.check(_Net(OUTPUTS[kind]), torch.randn(4, 8), device=device, calibrate=True)
    assert any(n.startswith("calibrated on 1 batch") for n in report.notes)


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_dataclass_outputs_are_compared(device):
    torch.manual_seed(0)
    model = _Net(lambda m, y: Detections(y, m.head(y)[:0]))
    cal = calibrate(model, [((torch.randn(4, 8),), {})], Policy.load(device, "float16"))
    assert "" in cal.modules and "rel_l2" in cal.modules[""]     # the root's dataclass output was compared
    assert not cal.nonfinite


def test_an_empty_detector_output_has_no_range_row():
    # torchvision's Faster R-CNN with random weights detects nothing: amin() of its empty boxes raised.
    from ampaudit.runtime.compare import compare_to_fp32

    torch.manual_seed(0)
    rows = {r["module"]: r for r in compare_to_fp32(_Net(OUTPUTS["empty"]), (torch.randn(4, 8),))}
    assert "absmax" in rows["fc"] and "absmax" not in rows.get("", {})


def test_a_statistic_that_fails_costs_that_statistic(monkeypatch):
    import ampaudit.runtime.divergence_results as divergence_results

    real = divergence_results.full_counts

    def flaky(t, target):
        if t.shape[-1] == 4:           # the head's output
            raise RuntimeError("no kernel for this")
        return real(t, target)

    monkeypatch.setattr(divergence_results, "full_counts", flaky)
    torch.manual_seed(0)
    with collect() as notes:
        cal = calibrate(_Net(lambda m, y: m.head(y)), [((torch.randn(4, 8),), {})], Policy.load("cuda", "float16"))
    assert "absmax" in cal.modules["fc"] and "absmax" not in cal.modules["head"]
    assert "rel_l2" in cal.modules["head"]                    # the divergence of that module is still there
    assert any("range statistics of head skipped" in n and "no kernel for this" in n for n in notes), notes


@torch.library.custom_op("ampaudit_test::cpu_lacks_half", mutates_args=())
def _cpu_lacks_half(x: torch.Tensor) -> torch.Tensor:
    if x.dtype == torch.float16:
        raise NotImplementedError('"cpu_lacks_half" not implemented for \'Half\'')
    return x.clone()


def test_op_without_a_cpu_half_kernel_is_emulated_for_cuda_and_a_machine_note_for_cpu():
    torch.manual_seed(0)
    model = _Net(lambda m, y: m.head(_cpu_lacks_half(y)))
    with collect() as notes:
        cuda = ampaudit.check(model, torch.randn(4, 8), device="cuda", calibrate=True)
    assert not [f for f in cuda.findings if f.family == "nonfinite"], [f.message for f in cuda.findings]
    assert any("cpu_lacks_half" in n for n in notes), notes
    assert any("backward pass was not checked" in n for n in notes), notes     # the op has no derivative
    cpu = ampaudit.check(model, torch.randn(4, 8), device="cpu", calibrate=True)
    # CPU autocast really cannot run it, on any CPU: torch's kernel is missing, the model is not at fault.
    assert not [f for f in cpu.findings if f.family == "nonfinite"], [f.message for f in cpu.findings]
    assert ("torch's CPU kernels have no float16 cpu_lacks_half kernel; the forward stops at the top module under "
            "float16 autocast on this machine, so nothing from there on was measured; every CPU lacks it with this "
            "torch (use --dtype bfloat16)") in cpu.notes, cpu.notes
