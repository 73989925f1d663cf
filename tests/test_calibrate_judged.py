"""check --calibrate judges against FP32: non-finite only under autocast, backward-only faults, and own error on
the inputs a module really receives (a finite bf16 fault ranked first)."""
from __future__ import annotations

import torch
from torch import nn

import ampaudit


class Tiny(nn.Module):
    """Scales to ~1e-8: fp16 flushes it to 0 (and the next op sees 0), FP32 keeps it."""

    def forward(self, x):
        return x * 1e-8


class LogFp32(nn.Module):
    """log in fp32 of what arrives: finite in FP32, -inf where fp16 flushed the input upstream."""

    def forward(self, x):
        return torch.log(x.float().abs() * 1e-4)


class FlushThenLog(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.tiny = Tiny()
        self.log = LogFp32()

    def forward(self, x):
        return self.log(self.tiny(self.fc(x)))


def nonfinite(report):
    return [f for f in report.findings if f.family == "nonfinite"]


def test_an_inf_an_fp32_op_makes_only_under_autocast_is_reported():
    torch.manual_seed(0)
    report = ampaudit.check(FlushThenLog(), torch.randn(4, 8), device="cpu", dtype="float16", calibrate=True)
    found = nonfinite(report)
    assert found and found[0].module == "log" and "where FP32 stays finite" in found[0].message


class MaskedLog(nn.Module):
    """T5's pattern: log(0) in FP32 as well, masked right after: the model's own inf, not a precision fault."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        pos = torch.arange(8, dtype=torch.float32)
        big = torch.log(pos)                          # -inf at position 0, in FP32 too
        big = torch.where(pos > 0, big, torch.zeros_like(big))
        return self.fc(x) + big


def test_an_inf_fp32_also_makes_is_not_a_finding():
    report = ampaudit.check(MaskedLog(), torch.randn(4, 8), device="cpu", dtype="float16", calibrate=True)
    assert nonfinite(report) == []


class SqrtOfSquares(nn.Module):
    """sqrt(sum(x**2)) of tiny activations: the sum underflows to 0 in fp16, sqrt(0) = 0 is finite, but its
    gradient 1 / (2 sqrt(0)) is inf: a backward-only fault."""

    def forward(self, x):
        return torch.sqrt((x * x).sum(-1, keepdim=True))


class BackwardOnly(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.norm = SqrtOfSquares()
        self.head = nn.Linear(1, 2)

    def forward(self, x):
        return self.head(self.norm(self.fc(x) * 1e-5))


def test_a_backward_only_fault_is_located_with_its_phase():
    torch.manual_seed(0)
    model, x = BackwardOnly(), torch.randn(4, 8)
    with torch.autocast("cpu", dtype=torch.float16):
        assert torch.isfinite(model(x)).all()          # the forward is fine
    report = ampaudit.check(model, x, device="cpu", dtype="float16", calibrate=True)
    found = nonfinite(report)
    assert found, report.findings
    assert found[0].module == "norm" and "in the backward pass" in found[0].message


class OffsetRound(nn.Module):
    """Adds then removes a large offset: unlisted ops, so in bf16 only because bf16 arrives (8 bits at 300)."""

    def forward(self, x):
        return (x + 300.0) - 300.0


class FiniteBf16Fault(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.offset = OffsetRound()
        self.b = nn.Linear(16, 16)

    def forward(self, x):
        return self.b(self.offset(self.a(x)))


def test_a_finite_bf16_fault_is_ranked_first_by_own_error():
    torch.manual_seed(0)
    report = ampaudit.check(FiniteBf16Fault(), torch.randn(64, 16), device="cuda", dtype="bfloat16", calibrate=True)
    div = [f for f in report.findings if f.family == "divergence"]
    assert div and div[0].module == "offset" and div[0].severity == "error"
    assert div[0].details["rank"] == 1 and div[0].details["units"] > 100
    # The top-ranked culprit is also the first in execution order: no note points elsewhere.
    assert "execution order" not in div[0].message
    assert not [f for f in div if f.module in ("a", "b")]         # GEMMs stay within a few unit roundoffs


def test_a_dataclass_output_is_audited_and_calibrated_backward_too():
    import dataclasses

    @dataclasses.dataclass
    class Out:
        logits: torch.Tensor
        norm: torch.Tensor

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)
            self.dist = SqrtOfSquares()

        def forward(self, x):
            h = self.fc(x)
            return Out(h, self.dist(h * 1e-5))

    torch.manual_seed(0)
    report = ampaudit.check(Net(), torch.randn(4, 8), device="cpu", dtype="float16", calibrate=True)
    found = nonfinite(report)
    assert found and found[0].module == "dist" and "backward" in found[0].message


def test_a_module_whose_re_run_raises_costs_its_own_error_only():
    class OnceOnly(nn.Module):
        """Raises when called twice (a stateful module): the local re-run cannot run it."""

        def __init__(self):
            super().__init__()
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            if self.calls > 2:                    # the autocast run and the FP32 shadow are allowed
                raise RuntimeError("called again")
            return x * 2

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)
            self.once = OnceOnly()

        def forward(self, x):
            return self.once(self.fc(x))

    from ampaudit.notes import collect
    from ampaudit.runtime.compare import compare_to_fp32

    with collect() as notes:
        rows = compare_to_fp32(Net(), (torch.randn(4, 8),), {}, dtype=torch.bfloat16)
    assert {r["module"] for r in rows} >= {"fc", "once"}
    assert any("own error of once skipped" in n for n in notes)


class OverflowThenChain(nn.Module):
    """resnet152's pattern at random init: one layer's output passes fp16's max, the layers after it are fed inf.
    Beside it efficientnet's squeeze-excitation gate: a layer whose exact answer (~2.4e-8) is all below fp16's
    smallest subnormal, while its fp16 weights (3e-8 rounds to 6e-8) give one subnormal step."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(16, 16)
        self.chain = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)])
        self.gate = nn.Linear(16, 16)
        with torch.no_grad():
            self.up.weight.mul_(1e5)
            self.gate.weight.fill_(3e-8)
            self.gate.bias.zero_()

    def forward(self, x):
        return self.chain(self.up(x)) * torch.sigmoid(self.gate(torch.sigmoid(x) * 0.1))


def test_an_overflow_is_named_where_it_happens_not_at_every_module_fed_its_inf():
    torch.manual_seed(0)
    report = ampaudit.check(OverflowThenChain(), torch.randn(8, 16), calibrate=True)
    div = {f.module: f for f in report.findings if f.rule == "AMP701"}
    assert list(div) == ["up"] and div["up"].severity == "error"           # chain.*: NaN on inf inputs
    assert [f.module for f in nonfinite(report)] == ["up"]
    assert "up" in {f.module for f in report.findings if f.rule == "AMP501"}
    # gate's exact answer is all zero in fp16: its own error divides by that zero (inf). AMP503 says so.
    assert "gate" in {f.module for f in report.findings if f.rule == "AMP503"}


class ConvBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.bn = nn.BatchNorm2d(8)

    def forward(self, x):
        return self.bn(self.conv(x))


def test_batchnorm_never_updated_is_said_since_eval_mode_does_not_normalise_there():
    # resnet152 at random init: eval-mode BatchNorm with its initial statistics is an identity, the activations
    # grow to inf in fp16 where a train-mode forward keeps them near 1. The report says which it measured.
    torch.manual_seed(0)
    model, x = ConvBN(), torch.randn(2, 3, 8, 8)
    notes = ampaudit.check(model, x, device="cuda", dtype="bfloat16", calibrate=True).notes
    said = [n for n in notes if "BatchNorm layer(s) never updated" in n]
    assert len(said) == 1 and "(bn: running mean 0, variance 1)" in said[0]
    model.train()
    with torch.no_grad():
        model(x)                                  # one training-mode forward: the statistics are the data's
    model.eval()
    notes = ampaudit.check(model, x, device="cuda", dtype="bfloat16", calibrate=True).notes
    assert not [n for n in notes if "never updated" in n]
