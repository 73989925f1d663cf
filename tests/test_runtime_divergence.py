"""FP32 shadow comparisons: metric arithmetic, compare_to_fp32 on planted and benign models."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from ampaudit.runtime.compare import compare_to_fp32
from ampaudit.runtime.metric_batch import batched_sums, finish_metrics, metric_sums

from conftest import load_planted


def test_metrics_match_their_definitions():
    torch.manual_seed(0)
    b = torch.randn(1000)
    a = b + 0.01 * torch.randn(1000)
    m = finish_metrics(metric_sums([(a, b)]).tolist())
    d = a - b
    assert m["rel_l2"] == pytest.approx((d.norm() / b.norm()).item(), rel=1e-4)
    assert m["cosine"] == pytest.approx(torch.nn.functional.cosine_similarity(a, b, 0).item(), abs=1e-6)
    assert m["max_abs"] == pytest.approx(d.abs().max().item(), rel=1e-6)
    assert m["sqnr_db"] == pytest.approx(20 * math.log10(b.norm() / d.norm()), rel=1e-4)
    same = finish_metrics(metric_sums([(b, b)]).tolist())
    assert same == {"rel_l2": 0.0, "cosine": 1.0, "max_abs": 0.0, "sqnr_db": math.inf}
    rows = batched_sums([(a[:10], b[:10]), (a, b)])
    assert torch.allclose(rows[1], metric_sums([(a, b)]), rtol=1e-4)


def test_compare_to_fp32_on_a_benign_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8))
    rows = {r["module"]: r for r in compare_to_fp32(model, (torch.randn(4, 16),), {}, dtype=torch.bfloat16)}
    assert set(rows) == {"0", "1", "2", ""}
    for name, r in rows.items():
        assert r["cosine"] > 0.999 and r["rel_l2"] < 0.02 and r["sqnr_db"] > 30, (name, r)
        assert r["headroom_bits"] > 100                      # bf16 has fp32's range
    # The root has an own error too: its code between its children. A Sequential has none: it hands on its last
    # child's output, whose rounding to bf16 is the dtype's, not the Sequential's.
    assert "local_rel_l2" in rows["2"] and rows[""]["local_rel_l2"] == 0.0
    assert rows["1"]["local_rel_l2"] < rows["1"]["rel_l2"] + 1e-9   # tanh alone adds little error


class _KeepsProjFP32(nn.Module):
    """T5's fix for its fp16 overflow: the caller runs one Linear with autocast off, on an FP32 input."""

    def __init__(self):
        super().__init__()
        self.up, self.proj = nn.Linear(16, 64), nn.Linear(64, 16)

    def forward(self, x):
        h = torch.relu(self.up(x))
        with torch.autocast("cpu", enabled=False):
            return self.proj(h.float())


def test_own_error_rerun_keeps_autocast_off_where_the_caller_turned_it_off():
    """A module called with autocast off computes in FP32: its own re-run must too, or it is charged the error of a
    bf16 GEMM it never ran (an inf where that GEMM overflows fp16: a healthy twin named the culprit)."""
    torch.manual_seed(0)
    rows = {r["module"]: r for r in compare_to_fp32(_KeepsProjFP32(), (torch.randn(8, 16),), {},
                                                    dtype=torch.bfloat16)}
    assert rows["proj"]["local_rel_l2"] < 1e-6, rows["proj"]
    assert rows["up"]["local_rel_l2"] > 1e-4, rows["up"]              # the bf16 GEMM still has its own error


def test_compare_to_fp32_flags_the_overflowing_pool():
    planted = load_planted("cumsum_pool")
    rows = {r["module"]: r for r in compare_to_fp32(planted.build_model(), planted.example_inputs(), {},
                                                     dtype=torch.float16)}
    pool = rows["pool"]
    assert pool["headroom_bits"] > 0                       # its output fits fp16 ...
    assert not (pool["rel_l2"] < 0.01)                     # ... but the fp16 run is ruined (inf/NaN)
    assert rows["enc"]["rel_l2"] < 0.01                    # upstream of the culprit all is well


def test_compare_to_fp32_reports_ranges_and_underflow_share():
    planted = load_planted("gelu_cube")
    rows = {r["module"]: r for r in compare_to_fp32(planted.build_model(), planted.example_inputs(), {})}
    up = rows["mlp.up"]
    assert up["absmax"] > 25 and 0 < up["headroom_bits"] < 16 and up["overflow"] == 0
    assert 0.0 <= rows["mlp.act"]["underflow_share"] <= 1.0


def test_shadow_runs_in_ieee_fp32_and_restores_the_users_precision():
    # CUDA convolutions default to TF32 and set_float32_matmul_precision("medium") lets oneDNN use bf16 for
    # FP32 matmuls: a reference computed that way would carry fp16-sized errors of its own.
    seen = []

    class Spy(nn.Linear):
        def forward(self, x):
            if not torch.is_autocast_enabled("cpu"):
                seen.append((torch.backends.mkldnn.matmul.fp32_precision,
                             torch.backends.cudnn.conv.fp32_precision, torch.backends.cuda.matmul.fp32_precision))
            return super().forward(x)

    before = torch.get_float32_matmul_precision()
    conv_before = torch.backends.cudnn.conv.fp32_precision
    torch.set_float32_matmul_precision("medium")
    try:
        user = (torch.backends.mkldnn.matmul.fp32_precision, torch.backends.cuda.matmul.fp32_precision)
        assert user != ("ieee", "ieee")
        rows = compare_to_fp32(nn.Sequential(Spy(4, 4)), (torch.randn(2, 4),), {}, dtype=torch.bfloat16)
        # Without CUDA only oneDNN decides an FP32 matmul here; cuda and cudnn are left as the user had them.
        cuda = torch.cuda.is_available()
        want = ("ieee", "ieee" if cuda else conv_before, "ieee" if cuda else user[1])
        assert rows and seen and all(s == want for s in seen)
        assert (torch.backends.mkldnn.matmul.fp32_precision, torch.backends.cuda.matmul.fp32_precision) == user
        assert torch.backends.cudnn.conv.fp32_precision == conv_before
        torch.backends.cudnn.allow_tf32        # the legacy flags still read back (no mixed-API error)
    finally:
        torch.set_float32_matmul_precision(before)


@pytest.mark.skipif(torch.cuda.is_available(), reason="PyTorch refuses the legacy flag beside the new API on CUDA")
def test_a_forward_that_reads_the_legacy_tf32_flag_is_compared_on_a_cpu():
    # transformers' pe_audio reads torch.backends.cudnn.allow_tf32 in its forward; with cudnn's settings "ieee"
    # PyTorch raises there, and its calibration stopped.
    class ReadsFlag(nn.Linear):
        def forward(self, x):
            return super().forward(x) * (1.0 if torch.backends.cudnn.allow_tf32 else 1.0)

    rows = compare_to_fp32(nn.Sequential(ReadsFlag(4, 4)), (torch.randn(2, 4),), {}, dtype=torch.bfloat16)
    assert rows and all("error" not in r for r in rows)


class _AddsInPlace(nn.Module):
    """Returns its child's output tensor after writing into it: the same object, other values."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        y = self.lin(x)
        y += 1000.0
        return y


def test_a_container_reuses_its_childs_range_only_while_the_tensor_is_unwritten():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), _AddsInPlace())
    rows = {r["module"]: r for r in compare_to_fp32(model, (torch.randn(4, 8),), {}, dtype=torch.bfloat16)}
    # The Sequential returns the last child's output as it is: the same statistics.
    for key in ("absmax", "headroom_bits", "underflow_share", "flush_share", "overflow"):
        assert rows[""][key] == rows["2"][key]
    # `y += 1000` wrote into lin's output after lin returned: measured again, on the values the wrapper returns.
    assert rows["2"]["absmax"] > 900 > rows["2.lin"]["absmax"]


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.act = nn.Linear(16, 16), nn.Tanh()

    def forward(self, x):
        return self.act(self.fc(x)) + x


def test_a_users_hooks_run_once_in_a_modules_own_rerun():
    """The real forward ran each module's forward pre-hooks once (a doubling one here, on a leaf and on a
    composite) and its forward hooks after the recorded output: the own-error re-run on the recorded inputs must
    neither double them again nor apply the forward hook (own error ~rounding, not ~1)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), _Block(), nn.Linear(16, 4))
    double = lambda mod, args: tuple(a * 2 for a in args)     # noqa: E731
    model[0].register_forward_pre_hook(double)
    model[1].register_forward_pre_hook(double)
    model[1].fc.register_forward_pre_hook(lambda mod, args, kwargs: ((args[0] * 2,), kwargs), with_kwargs=True)
    model[2].register_forward_hook(lambda mod, args, out: out * 3)
    rows = {r["module"]: r for r in compare_to_fp32(model, (torch.randn(8, 16),), {}, dtype=torch.bfloat16)}
    for name in ("0", "1", "1.fc", "2", ""):
        assert rows[name]["local_rel_l2"] < 0.02, (name, rows[name])
