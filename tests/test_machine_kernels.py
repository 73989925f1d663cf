"""A kernel the machine running ampaudit lacks for a dtype (oneDNN's fp16 LSTM on many CPUs) is a note about this
machine, never a finding about the target; a kernel that refuses what it is given (index_add_ on two dtypes, which
CUDA refuses too) stays a finding. The capability probe answers for this CPU, or as forced by
AMPAUDIT_FORCE_NO_FP16_KERNELS, and the tests that need the kernels skip on its word.

Every CPU runs these the same way: ``no_fp16_lstm`` makes fp16 LSTM kernels fail as oneDNN does where it has none."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

import ampaudit
import ampaudit.cli.commands  # noqa: F401  registers the commands
from ampaudit.analysis.calibrate import calibration_data
from ampaudit.cli.app import app
from ampaudit.loading import load_target
from ampaudit.machine.kernels import FORCE_ENV, KernelGap, fp16_kernel_missing, kernel_gap

from _kernel_gaps import MESSAGE, no_fp16_lstm
from conftest import SAMPLES, cpu_fp16_gap, load_module

LSTM = SAMPLES / "lstm_forecaster.py"
ONEDNN = MESSAGE.format("forward")


@pytest.mark.parametrize("message, gap", [
    (ONEDNN, KernelGap("oneDNN", "float16", "LSTM")),
    ('"addmm_impl_cpu_" not implemented for \'Half\'', KernelGap("", "float16", "addmm_impl_cpu_")),
    ("\"cumsum_cpu\" not implemented for 'BFloat16'", KernelGap("", "bfloat16", "cumsum_cpu")),
    ("index_add_(): self (Half) and source (Float) must have the same scalar type", None),
    ("expected scalar type BFloat16 but found Float", None),
    ("value cannot be converted to type at::Half without overflow", None),
    ("Unsupported dtype Half", KernelGap("", "float16", "FFT", on_gpu="cuFFT computes float16 FFTs of power-of-two "
                                                                        "sizes only")),
    ("Unsupported dtype BFloat16", None),     # cuFFT has no bfloat16 either: a finding on the GPU target too
])
def test_a_missing_kernel_is_told_from_a_kernel_that_refuses_its_inputs(message, gap):
    assert kernel_gap(RuntimeError(message), torch.float16) == gap


def test_the_sentence_is_true_for_the_target():
    gap = KernelGap("oneDNN", "float16", "LSTM")
    assert gap.sentence("cuda") == "this CPU's oneDNN has no float16 LSTM kernel; the cuda target is unaffected"
    assert gap.sentence("cpu").endswith("a CPU with native float16 may have it (here, use --dtype bfloat16)")
    # torch's CPU kernels are the same on every CPU: no "another CPU may have it" there.
    build = KernelGap("", "bfloat16", "cumsum_cpu").sentence("cpu")
    assert build == "torch's CPU kernels have no bfloat16 cumsum_cpu kernel; every CPU lacks it with this torch " \
                    "(use --dtype float16)"


def _lstm_trains_in_fp16() -> bool:
    try:
        with torch.autocast("cpu", dtype=torch.float16):
            nn.LSTM(3, 8, batch_first=True)(torch.randn(2, 4, 3))[0].float().sum().backward()
    except RuntimeError:
        return False
    return True


def test_the_probe_answers_for_this_cpu_or_as_forced(monkeypatch):
    monkeypatch.delenv(FORCE_ENV, raising=False)
    missing = fp16_kernel_missing("LSTM")
    assert (missing is None) == _lstm_trains_in_fp16()
    if missing is not None:
        assert missing == "this CPU's oneDNN has no float16 LSTM kernel"
    monkeypatch.setenv(FORCE_ENV, "1")
    assert FORCE_ENV in fp16_kernel_missing("LSTM") and FORCE_ENV in fp16_kernel_missing("LSTM", grad=False)
    monkeypatch.setenv(FORCE_ENV, "0")
    assert fp16_kernel_missing("LSTM") is None and fp16_kernel_missing("LSTM", grad=False) is None


def test_tests_skip_on_the_probes_word(monkeypatch):
    sample = load_module(LSTM)
    monkeypatch.setenv(FORCE_ENV, "1")
    assert cpu_fp16_gap(sample, grad=False).startswith(sample.EXPECT["cpu_fp16_unsupported"])
    monkeypatch.setenv(FORCE_ENV, "0")
    assert cpu_fp16_gap(sample, grad=True) is None
    assert cpu_fp16_gap(load_module(SAMPLES / "clean_mlp.py"), grad=True) is None   # declares no gap


def _calibrated(device):
    loaded = load_target(str(LSTM))
    return ampaudit.check(loaded.model, *loaded.args, device=device, dtype="float16", calibrate=True,
                          data=calibration_data(loaded), select=["AMP6"])


def test_cuda_target_runs_past_the_missing_kernel():
    with no_fp16_lstm():
        report = _calibrated("cuda")
    assert not report.findings, report.to_dict()["findings"]
    assert "CUDA simulation: this CPU's oneDNN has no float16 kernel for aten.mkldnn_rnn_layer; it ran in " \
           "float32, rounded to float16" in report.notes


def test_cpu_target_missing_kernel_is_a_machine_note():
    with no_fp16_lstm():
        report = _calibrated("cpu")
    assert not report.findings, report.to_dict()["findings"]
    assert ("this CPU's oneDNN has no float16 LSTM kernel; the forward stops at lstm under float16 autocast on "
            "this machine, so nothing from there on was measured; a CPU with native float16 may have it (here, use "
            "--dtype bfloat16)") in report.notes


def test_this_cpu_as_it_is(monkeypatch):
    """No simulated gap: where this CPU lacks the kernel the note says so; where it has it, nothing is said."""
    monkeypatch.delenv(FORCE_ENV, raising=False)
    report = _calibrated("cpu")
    assert not report.findings
    noted = any("has no float16 LSTM kernel" in n for n in report.notes)
    assert noted == (fp16_kernel_missing("LSTM") is not None)


def test_a_kernel_the_target_refuses_stays_a_finding():
    class MixedIndexAdd(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(16, 16)

        def forward(self, x):
            return torch.zeros(4, 16).index_add_(0, torch.arange(4), self.lin(x))

    with no_fp16_lstm():
        report = ampaudit.check(MixedIndexAdd(), torch.randn(4, 16), device="cuda", dtype="float16", calibrate=True)
    assert [f.rule for f in report.findings if f.rule == "AMP602"] == ["AMP602"], report.to_dict()["findings"]


def test_train_blames_the_machine_not_the_data():
    with no_fp16_lstm():
        result = CliRunner().invoke(app, ["train", str(LSTM), "--device", "cpu", "--dtype", "float16", "--steps", "1"])
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert "this CPU's oneDNN has no float16 LSTM kernel, so float16 autocast cannot run this model" in text
    assert "--dtype bfloat16" in text and "check that train_data() yields" not in text


def test_the_simulation_test_passes_on_a_cpu_without_the_kernel():
    """tests/test_simulate.py's LSTM case runs through the CUDA simulation, which falls back to fp32 there."""
    from test_simulate import test_static_audit_dtypes_match_the_simulation

    with no_fp16_lstm():
        test_static_audit_dtypes_match_the_simulation(LSTM, "float16")


def test_the_policy_table_test_skips_on_a_cpu_without_the_kernel(monkeypatch):
    from test_policy_tables import test_propagated_dtypes_match_real_cpu_autocast

    monkeypatch.setenv(FORCE_ENV, "1")      # what the probe says on such a CPU
    with no_fp16_lstm(), pytest.raises(pytest.skip.Exception, match="oneDNN has no fp16 LSTM kernel"):
        test_propagated_dtypes_match_real_cpu_autocast(LSTM, "float16")


def test_evaluation_blames_the_machine_not_the_data():
    from ampaudit.errors import TrainError
    from ampaudit.train.evaluate import Evaluator

    sample = load_module(LSTM)
    evaluator = Evaluator(lambda: iter([next(iter(sample.train_data()))]), sample.loss_fn, every=1,
                          dtype=torch.float16, device=torch.device("cpu"))
    with no_fp16_lstm(), pytest.raises(TrainError) as info:
        evaluator.run(sample.build_model(), 1)
    assert str(info.value.message).startswith("this CPU's oneDNN has no float16 LSTM kernel, so float16 autocast")
    assert "eval batch 0" in info.value.message and info.value.hint == "train with --dtype bfloat16 here"


def test_an_fft_under_cpu_float16_is_a_machine_gap_not_a_raising_forward():
    """FNet's token mixing (torch.fft.fftn of the hidden states) raised AMP602 on CPU for a cuda float16 target."""

    class FourierMix(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 8)

        def forward(self, x):
            return torch.fft.fftn(self.proj(x), dim=(-1, -2)).real

    report = ampaudit.check(FourierMix(), torch.randn(2, 4, 8), calibrate=True, device="cuda", dtype="float16")
    assert [f.rule for f in report.findings if f.rule == "AMP602"] == []
    assert any("no float16 FFT kernel" in n and "power-of-two" in n for n in report.notes)
