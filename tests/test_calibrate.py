"""check --calibrate: measured non-finite, range and divergence findings name the module whose own code is at fault."""
from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

import ampaudit
import ampaudit.cli.commands  # noqa: F401
from ampaudit.cli.app import app

from conftest import ASSETS, PLANTED

runner = CliRunner()
MEASURED = ("range", "nonfinite", "divergence")


def calibrated_json(path, *extra):
    r = runner.invoke(app, ["check", str(path), "--calibrate", "-f", "json", "--fail-on", "never", *extra])
    assert r.exit_code == 0, r.output
    return json.loads(r.output)


@pytest.mark.skipif(not PLANTED.is_dir(), reason="planted models absent")
@pytest.mark.parametrize("name", ["mask_fill", "mask_fill_crash", "gelu_cube", "cumsum_pool", "bn_running_var"])
def test_planted_culprit_is_the_first_measured_finding(planted, name):
    expect = planted(name).EXPECT
    doc = calibrated_json(PLANTED / f"{name}.py", "--device", "cpu")
    measured = [f for f in doc["findings"] if f["family"] in MEASURED]
    nonfinite = [f for f in measured if f["family"] == "nonfinite"]
    first = nonfinite[0] if nonfinite else measured[0]
    assert first["module"] == expect["culprit"], measured
    if expect.get("raises"):
        assert first["rule"] == "AMP602" and first["location"]["line"] == 12


@pytest.mark.skipif(not PLANTED.is_dir(), reason="planted models absent")
def test_cuda_target_is_simulated_with_cuda_upcasts(planted):
    # CUDA autocast runs pow and cumsum in fp32, so the faults CPU autocast shows do not happen there.
    for name in ("gelu_cube", "cumsum_pool"):
        doc = calibrated_json(PLANTED / f"{name}.py", "--device", "cuda")
        assert not [f for f in doc["findings"] if f["family"] == "nonfinite"], name
        assert any("simulated" in n for n in doc["notes"])
    doc = calibrated_json(PLANTED / "mask_fill.py", "--device", "cuda")
    assert [f["module"] for f in doc["findings"] if f["family"] == "nonfinite"][:1] == ["attn"]


@pytest.mark.skipif(not PLANTED.is_dir(), reason="planted models absent")
def test_calibrate_batches_from_train_data(planted):
    doc = calibrated_json(PLANTED / "gelu_cube.py", "--device", "cpu", "--calibrate-batches", "3")
    assert any("3 batch" in n for n in doc["notes"])
    assert [f["module"] for f in doc["findings"] if f["family"] == "nonfinite"][:1] == ["mlp.act"]


def test_clean_model_has_no_measured_findings():
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
    report = ampaudit.check(model, torch.randn(8, 16), device="cpu", calibrate=True)
    assert not [f for f in report.findings if f.family in MEASURED]


def test_divergence_names_the_child_not_the_parent():
    class Lossy(nn.Module):
        def forward(self, x):
            return (x * 3000.0).exp() / (x * 3000.0).exp().sum(-1, keepdim=True)   # hand-written softmax

    class Parent(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(16, 16)
            self.lossy = Lossy()

        def forward(self, x):
            return self.lossy(self.fc(x))

    report = ampaudit.check(Parent(), torch.randn(4, 16) * 0.01, device="cpu", calibrate=True,
                            select=["divergence", "nonfinite"])
    modules = [f.module for f in report.findings]
    assert modules and modules[0] == "lossy" and "" not in modules


def test_meta_model_cannot_be_calibrated():
    with torch.device("meta"):
        model = nn.Linear(8, 8)
    with pytest.raises(ampaudit.AmpAuditError, match="meta"):
        ampaudit.check(model, torch.randn(2, 8), calibrate=True)


@pytest.mark.parametrize("name, args, words", [
    pytest.param("hangs.py", ["--timeout", "3"], "did not finish within 3 s", marks=pytest.mark.slow),  # waits 3 s
    ("returns_string.py", [], "returns str, not tensors"),
    ("forward_raises.py", [], "raised ValueError: bad shapes"),
])
def test_forward_problems_are_one_line_errors(name, args, words):
    r = runner.invoke(app, ["check", str(ASSETS / "bad" / name), *args])
    assert r.exit_code == 2
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and words in lines[0], r.output


def test_calibrate_batches_needs_calibrate(tmp_path):
    r = runner.invoke(app, ["check", str(ASSETS / "bad" / "returns_string.py"), "--calibrate-batches", "2"])
    assert r.exit_code == 2 and "needs --calibrate" in r.output


def test_an_inf_an_fp32_op_makes_is_not_a_precision_finding():
    # log(0) in FP32, masked right after (as T5's relative-position buckets do): an FP32 run has it too.
    from _shared_models import MaskedLogBuckets
    report = ampaudit.check(MaskedLogBuckets(8), torch.randn(8, 8), device="cpu", calibrate=True)
    assert not [f for f in report.findings if f.family == "nonfinite"]


def test_infinite_buffers_that_mean_no_clamp_are_not_range_findings():
    """gemma4_vit keeps clamp bounds as buffers of +-inf: they are inf in the low dtype too, nothing changes."""
    import ampaudit
    from torch import nn

    class Clamped(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(16, 16)
            self.register_buffer("input_min", torch.tensor(-float("inf")))
            self.register_buffer("input_max", torch.tensor(float("inf")))
            self.register_buffer("big", torch.tensor(1e6))       # a finite value past fp16's max still is one

        def forward(self, x):
            return self.fc(x.clamp(self.input_min, self.input_max))

    report = ampaudit.check(Clamped(), torch.randn(8, 16), device="cuda", dtype="float16", calibrate=True)
    flagged = [f.message for f in report.findings if f.rule == "AMP501"]
    assert len(flagged) == 1 and flagged[0].startswith("big "), flagged


class _ClipBound(nn.Module):
    """gemma3n's audio conformer: a 1e10 buffer bounds a clamp (negated for the lower bound); another large buffer
    scales the output, where inf in fp16 does change the result."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.register_buffer("gradient_clipping", torch.tensor(1e10), persistent=False)
        self.register_buffer("cap", torch.tensor(1e9))
        self.register_buffer("scale", torch.tensor(1e5))

    def forward(self, x):
        h = torch.clamp(self.fc(x), -self.gradient_clipping, self.gradient_clipping)
        h = torch.minimum(h, self.cap.to(h.dtype))
        return h * self.scale


def test_large_buffers_that_only_bound_a_clamp_are_not_range_findings():
    import ampaudit.notes as notes_mod

    with notes_mod.collect() as notes:
        report = ampaudit.check(_ClipBound(), torch.randn(8, 16), device="cuda", dtype="float16", calibrate=True)
    flagged = [f.message.split()[0] for f in report.findings if f.rule == "AMP501" and f.op == "buffer"]
    assert flagged == ["scale"], [f.message for f in report.findings]
    assert any("gradient_clipping (and 1 more)" in n and "only bounds a clamp" in n for n in notes), notes


class _UnreadTower(nn.Module):
    """A branch the calibration inputs never reach (gemma3n's audio tower on text): its buffers are judged by
    how its forward's source uses them."""

    def __init__(self):
        super().__init__()
        self.register_buffer("clip", torch.tensor(1e10))
        self.register_buffer("gain", torch.tensor(1e10))

    def forward(self, x):
        x = x.clamp(-self.clip, max=self.clip)
        return torch.clamp(x, min=-self.clip) * self.gain


class _TextOnly(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.audio = _UnreadTower()
        self.with_audio = False

    def forward(self, x):
        return self.fc(x) + self.audio(x) if self.with_audio else self.fc(x)


def test_large_buffers_of_a_module_the_inputs_never_reach_are_judged_by_its_source():
    from ampaudit.runtime.buffer_uses import _bound_in_source

    assert _bound_in_source(_UnreadTower(), "clip") and not _bound_in_source(_UnreadTower(), "gain")
    report = ampaudit.check(_TextOnly(), torch.randn(8, 16), device="cuda", dtype="float16", calibrate=True)
    flagged = [f.message.split()[0] for f in report.findings if f.rule == "AMP501" and f.op == "buffer"]
    assert flagged == ["audio.gain"], [f.message for f in report.findings]


class _AbsorbedOverflow(nn.Module):
    """A linear layer that overflows fp16 and a where() right after it that drops the inf: the loss stays finite."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        with torch.no_grad():
            self.fc.weight.fill_(1e3)
            self.fc.bias.zero_()

    def forward(self, x):
        y = self.fc(x)
        return torch.where(torch.isfinite(y), y, torch.zeros_like(y)).float()


def test_amp601_fires_for_an_inf_a_later_op_absorbs_and_its_why_claims_no_more():
    """AMP601 names the first op to make inf/NaN whether or not it reaches the loss, so its why may not say that
    everything after it passes the fault along: here a where() drops it and the output is finite."""
    model, x = _AbsorbedOverflow(), torch.full((2, 4), 100.0)        # 4e5 per output: past fp16's 65504
    from ampaudit.policy import Policy
    from ampaudit.simulate import target_autocast

    with target_autocast(Policy.load("cuda", "float16"), "cpu"):
        assert not torch.isfinite(model.fc(x)).all() and torch.isfinite(model(x)).all()                           # absorbed: nothing reaches the loss
    report = ampaudit.check(model, x, device="cuda", dtype="float16", calibrate=True)
    found = [f for f in report.findings if f.rule == "AMP601" and f.details["phase"] == "forward"]
    assert found and found[0].module == "fc", report.findings
    assert "only passes the fault along" not in found[0].why and "absorb it" in found[0].why


def _ZeroCodebookDecoder():
    """wavtokenizer's decoder on an untrained codebook (tests/assets/noise_floor/zero_codebook.py)."""
    from conftest import load_module

    return load_module(ASSETS / "noise_floor" / "zero_codebook.py").ZeroCodebookDecoder()


def test_a_module_whose_fp32_output_is_rounding_noise_is_not_a_divergence_culprit():
    import ampaudit.analysis.calibrate as calibrate_mod
    from ampaudit.notes import collect

    torch.manual_seed(0)
    codes = torch.randint(0, 16, (2, 40))
    with collect() as notes:
        report = ampaudit.check(_ZeroCodebookDecoder(), codes, device="cuda", dtype="float16", calibrate=True)
    assert not [f for f in report.findings if f.rule == "AMP701"], [f.message for f in report.findings]
    assert any(n.startswith("own error of norm and 1 more not judged") for n in notes), notes
    # Without the FP32 floor the same two GroupNorms are AMP701 errors: one noise against another.
    saved, calibrate_mod._judge_fp32_floor = calibrate_mod._judge_fp32_floor, lambda *a: None
    try:
        report = ampaudit.check(_ZeroCodebookDecoder(), codes, device="cuda", dtype="float16", calibrate=True)
    finally:
        calibrate_mod._judge_fp32_floor = saved
    assert {f.module for f in report.findings if f.rule == "AMP701" and f.severity == "error"} == {"norm", "norm2"}


def test_fp32_moved_is_large_only_where_fp32_does_not_determine_the_output():
    from ampaudit.runtime.fp32_floor import fp32_moved

    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(32, 32)
            self.norm = nn.GroupNorm(32, 32, eps=1e-6)

        def forward(self, x):
            return self.fc(x) + self.norm(x[:, :, None].expand(-1, -1, 40)).mean(-1)

    torch.manual_seed(0)
    model = Two()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    moved = fp32_moved(model, (torch.randn(4, 32),), {}, ["fc", "norm"])
    assert moved["fc"] < 1e-5 and moved["norm"] > 0.5, moved
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


class _OffsetVariance(nn.Module):
    """E[y^2] - E[y]^2 of fp16 values offset by 100: fp16 spaces 1e4 by 8, so the variance is lost (a real fault
    of the dtype; in FP32 one ulp of the inputs moves the answer by ~1e-5)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(32, 32)

    def forward(self, x):
        y = self.fc(x) + 100.0
        return (y * y).mean(-1, keepdim=True) - y.mean(-1, keepdim=True) ** 2


class _NoiseThenFault(nn.Module):
    def __init__(self):
        super().__init__()
        self.decoder = _ZeroCodebookDecoder()
        self.stats = _OffsetVariance()

    def forward(self, codes, x):
        return self.decoder(codes).mean() + self.stats(x)


def test_the_fp32_floor_leaves_a_real_fault_beside_the_noise_flagged():
    torch.manual_seed(0)
    report = ampaudit.check(_NoiseThenFault(), torch.randint(0, 16, (2, 40)), torch.randn(8, 32), device="cuda",
                            dtype="float16", calibrate=True)
    assert {f.module for f in report.findings if f.rule == "AMP701"} == {"stats"}, \
        [(f.rule, f.module, f.message) for f in report.findings]
