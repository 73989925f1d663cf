"""On-device statistics: exact counts against the target dtype, absmax/headroom, the per-pass flag."""
from __future__ import annotations

import math

import pytest
import torch

from ampaudit.runtime.stats import StatsAccumulator, count_ge, full_counts, magnitude_bits, thresholds

VALUES = [0.0, -0.0, 1e-9, 1e-6, 1e-3, 1.0, 7e4, math.inf, -math.inf, math.nan, -2.0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_full_counts_match_a_direct_count(dtype):
    x = torch.tensor(VALUES).to(dtype)
    counts, min_nz = full_counts(x, torch.float16)
    nonzero, _, ge_tiny, ge_over, ge_inf, ge_nan = counts.tolist()
    xf = x.double()
    a = xf.abs()
    assert nonzero == int((xf != 0).sum())                     # NaN != 0 too
    assert ge_nan == int(torch.isnan(xf).sum())
    assert ge_inf - ge_nan == int(torch.isinf(xf).sum())
    assert nonzero - ge_tiny == int(((a > 0) & (a < torch.finfo(torch.float16).tiny)).sum())
    assert ge_over - ge_inf == int(((a > 65504) & torch.isfinite(a)).sum())
    smallest = a[(a > 0) & torch.isfinite(a)].min().item()
    assert min_nz.item() == pytest.approx(smallest, rel=1e-2)


def test_count_ge_is_an_integer_compare_on_magnitudes():
    x = torch.randn(1000) * 100
    th = thresholds(torch.float32, torch.float16)
    bits = magnitude_bits(x)
    assert count_ge(bits, th.tiny, th.width).item() == int((x.abs() >= torch.finfo(torch.float16).tiny).sum())


def test_accumulator_folds_passes_and_reports_nonfinite_slots():
    acc = StatsAccumulator(torch.float16)
    a, b = acc.slot("fc", "forward"), acc.slot("fc", "backward")
    acc.observe(a, torch.tensor([-5.0, 2.0]), full=True)
    acc.observe(b, torch.zeros(4, dtype=torch.float16), full=True)
    assert acc.end_pass(full=True) == []
    acc.observe(a, torch.tensor([1.0, math.nan]), full=False)
    assert acc.end_pass() == [("fc", "forward")]
    recs = {(r["module"], r["phase"]): r for r in acc.drain()}
    fwd, bwd = recs[("fc", "forward")], recs[("fc", "backward")]
    assert fwd["absmax"] == math.inf and fwd["nonfinite_passes"] == 1 and fwd["passes"] == 2
    assert fwd["counted_passes"] == 1 and fwd["numel"] == 2 and fwd["zeros"] == 0
    assert bwd["absmax"] == 0.0 and bwd["zeros"] == 4 and bwd["min_nonzero"] is None
    assert bwd["headroom_bits"] == math.inf
    assert acc.drain() == []                                   # drained


def test_headroom_is_log2_of_dtype_max_over_absmax():
    acc = StatsAccumulator(torch.float16)
    s = acc.slot("x", "forward")
    acc.observe(s, torch.tensor([1024.0]), full=False)
    acc.end_pass()
    rec = acc.drain()[0]
    assert rec["headroom_bits"] == pytest.approx(math.log2(65504 / 1024))
