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


@pytest.mark.parametrize("target", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("zeros", [0, 3])
def test_fp32_counts_with_and_without_zeros_equal_one_compare_per_threshold(target, zeros):
    # Thresholds that fall inside a 15-bit key's bin (fp16's max, half of a subnormal) and values on both
    # sides of them; without zeros the counts skip the nonzero count and the zero-masking minimum.
    edge = [65504.0, 65505.0, 65519.9, 65520.0, 2.0 ** -25, 2.0 ** -24 * 1.5, 3e38, math.inf, math.nan]
    g = torch.Generator().manual_seed(1)
    x = torch.cat([torch.randn(4000, generator=g) * 1e3, torch.tensor(edge), torch.zeros(zeros)])
    if zeros:                   # fp32 below 2^-133 shares the zeros' key
        x = torch.cat([x, torch.tensor([2.0 ** -134])])
    counts, min_nz = full_counts(x, target)
    th = thresholds(torch.float32, target)
    bits = magnitude_bits(x)
    assert counts.tolist() == [count_ge(bits, thr, th.width).item() for thr in th.columns]
    a = x.abs()
    assert min_nz.item() == a[(a > 0) & torch.isfinite(a)].min().item()
    assert full_counts(torch.tensor([math.inf, math.nan] + [0.0] * zeros), target)[1].item() == math.inf


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


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_nonfinite_now_reads_a_sum_and_tells_overflow_from_inf(dtype):
    from ampaudit.runtime.stats import nonfinite_now

    big = torch.finfo(dtype).max
    assert not nonfinite_now(torch.tensor([], dtype=dtype))
    assert not nonfinite_now(torch.randn(300).to(dtype))
    assert not nonfinite_now(torch.full((64,), big, dtype=dtype))            # the sum overflows, no value does
    assert not nonfinite_now(torch.full((70000,), 1.0, dtype=dtype))          # past fp16's max as a sum
    for bad in (math.inf, -math.inf, math.nan):
        x = torch.randn(301).to(dtype)
        x[151] = bad
        assert nonfinite_now(x) and nonfinite_now(x[149:152]) and not nonfinite_now(x[::2])
    both = torch.tensor([math.inf, -math.inf], dtype=dtype)                   # their sum is NaN: still non-finite
    assert nonfinite_now(both)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_extremes_are_amin_and_amax_nan_and_inf_included(dtype):
    from ampaudit.runtime.stats import extremes

    x = torch.randn(257).to(dtype)
    for bad in (None, math.inf, -math.inf, math.nan):
        y = x.clone()
        if bad is not None:
            y[100] = bad
        for t in (y, y[::3], y.reshape(-1, 1).expand(-1, 2)):
            lo, hi = extremes(t)
            assert (lo.isnan().item() and t.amin().isnan().item()) or lo.item() == t.amin().item()
            assert (hi.isnan().item() and t.amax().isnan().item()) or hi.item() == t.amax().item()
    assert [v.item() for v in extremes(torch.tensor([], dtype=dtype))] == [0.0, 0.0]
