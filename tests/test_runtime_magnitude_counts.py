"""Counts read off one histogram of magnitude bits equal one integer compare per threshold, at every threshold's
edge, for every (tensor dtype, target dtype) pair; and a watch run gives the same events either way."""
from __future__ import annotations

import copy
import itertools
import math

import pytest
import torch

import ampaudit.runtime.grad_hist as grad_hist
import ampaudit.runtime.magnitude_counts as mc
from ampaudit.loading import load_target
from ampaudit.runtime.magnitude_counts import count_ge, full_counts, key_histogram, magnitude_bits, thresholds
from ampaudit.runtime.watch import watch

SOURCES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.float8_e4m3fn]
TARGETS = [torch.float16, torch.bfloat16, torch.float32]
_IVIEW = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32}


def compared(t: torch.Tensor, target: torch.dtype) -> tuple[list[int], float]:
    """One integer compare per threshold (how the counts were taken before the histogram), and the smallest
    finite nonzero magnitude as float32 (inf if none)."""
    t = t if t.dtype in _IVIEW or t.dtype == torch.float64 else t.float()
    th = thresholds(t.dtype, target)
    bits = magnitude_bits(t)
    counts = [int(count_ge(bits, thr, th.width)) for thr in th.columns]
    a = t.double().abs()
    finite = a[(a > 0) & torch.isfinite(a)]
    return counts, finite.min().float().item() if finite.numel() else math.inf


def planted(src: torch.dtype, n: int, g: torch.Generator) -> torch.Tensor:
    """Values over a wide range with zeros, inf and NaN, and bit patterns at, below and above every threshold of
    every target (both signs)."""
    x = torch.randn(n, generator=g, dtype=torch.float64) * torch.exp(torch.randn(n, generator=g, dtype=torch.float64) * 25)
    kind = torch.randint(0, 10, (n,), generator=g)
    x = torch.where(kind == 0, 0.0, x)
    x = torch.where(kind == 1, math.inf, x)
    x = torch.where(kind == 2, math.nan, x).to(src)
    if src in _IVIEW:
        top = 1 << (torch.finfo(src).bits - 1)
        nans = {p for p in (0x7F800002, 0x7FC00000) if p < top}       # fp32 NaNs: low payload, the usual one
        edges = sorted({b + d for tg in TARGETS for b in thresholds(src, tg).columns for d in (-1, 0, 1)
                        if 0 <= b + d < top} | nans)
        y = x.view(_IVIEW[src]).clone()
        at = torch.randperm(n, generator=g)[: 2 * len(edges)]
        pats = torch.tensor(edges * 2, dtype=torch.int64)[torch.randperm(2 * len(edges), generator=g)][: len(at)]
        signs = torch.tensor([1, -1] * len(edges), dtype=torch.int64)[: len(at)]
        y[at] = torch.where(signs > 0, pats, pats - top).to(_IVIEW[src])     # -top: the sign bit set
        x = y.view(src)
    return x


@pytest.mark.parametrize("src", SOURCES)
@pytest.mark.parametrize("target", TARGETS)
def test_histogram_counts_equal_one_compare_per_threshold(src, target):
    g = torch.Generator().manual_seed(SOURCES.index(src) * 10 + TARGETS.index(target))
    for n in (1, 7, 300, 5000):
        x = planted(src, n, g)
        for t in (x, x[::3], x.reshape(-1, 1).expand(-1, 2)):       # contiguous, strided, expanded
            want, smallest = compared(t, target)
            counts, min_nz = full_counts(t, target)
            assert counts.tolist() == want
            assert min_nz.item() == smallest
            if src != torch.float64:                                 # the shared histogram gives the same
                again, min_again = full_counts(t, target, key_histogram(t))
                assert again.tolist() == want and min_again.item() == min_nz.item()


@pytest.mark.parametrize("src", [torch.float16, torch.bfloat16, torch.float32])
def test_all_zero_all_nonfinite_and_empty(src):
    for values in ([0.0, -0.0], [math.inf, -math.inf], [math.nan, 0.0], []):
        t = torch.tensor(values, dtype=torch.float64).to(src)
        counts, min_nz = full_counts(t, torch.float16)
        assert counts.tolist() == (compared(t, torch.float16)[0] if values else [0] * 6)
        assert min_nz.item() == math.inf                           # no finite nonzero: reported as None


def test_fp32_subnormal_beside_zeros_is_counted_exactly():
    # Half of bf16's smallest subnormal sits inside fp32's lowest key, with the zeros: the exact compare decides.
    t = torch.tensor([0.0, 0.0, 2.0 ** -140, 2.0 ** -134, 2.0 ** -133, 1.0])
    want, _ = compared(t, torch.bfloat16)
    assert full_counts(t, torch.bfloat16)[0].tolist() == want
    assert want[1] == 3          # >= 2^-134 (key 0, with the zeros and 2^-140), 2^-133 and 1 (keys above)


def test_log2_counts_from_a_shared_histogram():
    g = torch.Generator().manual_seed(3)
    for src in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        t = planted(src, 2000, g)
        assert torch.equal(grad_hist.log2_counts(t, key_histogram(t)), grad_hist.log2_counts(t))


def _reference_counts(t, target, histogram=None, **already):
    want, smallest = compared(t, target) if t.numel() else ([0] * 6, math.inf)
    return torch.tensor(want), torch.tensor(smallest, dtype=torch.float32)


def _events(monkeypatch, reference: bool) -> list[dict]:
    if reference:
        monkeypatch.setattr(mc, "full_counts", _reference_counts)
        monkeypatch.setattr("ampaudit.runtime.stats.full_counts", _reference_counts)
    loaded = load_target("samples/char_transformer.py")
    torch.manual_seed(0)
    model = copy.deepcopy(loaded.model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    w = watch(model, dtype=torch.float16, every=4, stats_every=2)
    for step, (x, y) in enumerate(itertools.islice(loaded.hook("train_data")(), 8)):
        w.set_step(step)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        loss = loaded.hook("loss_fn")(out, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    w.close()
    monkeypatch.undo()
    return w.events


def test_watch_events_equal_those_of_one_compare_per_threshold(monkeypatch):
    # fp16 judged, bf16 computed: fp32 tensors meet fp16's max inside a key, bf16 ones off their own grid.
    assert _events(monkeypatch, reference=False) == _events(monkeypatch, reference=True)


@pytest.mark.parametrize("src", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("target", TARGETS)
def test_counts_from_known_extremes_equal_one_compare_per_threshold(src, target):
    # On CPU a finite tensor whose (min, max) are known is counted without a histogram: the nonzeros, their smallest
    # magnitude and, below a low threshold, one compare. Planted edges of every threshold, with and without zeros,
    # small-only and clamped; non-finite and overflowing tensors take the histogram instead, with the same counts.
    g = torch.Generator().manual_seed(100 + SOURCES.index(src) * 10 + TARGETS.index(target))
    took = {True: 0, False: 0}
    for n in (1, 7, 300, 5000):
        for variant in range(5):
            x = planted(src, n, g)
            if variant:
                x = torch.where(torch.isfinite(x), x, torch.zeros((), dtype=src))
            if variant == 2:
                x = x.clamp(-1000, 1000)
            if variant == 3:
                x = torch.where(x == 0, torch.ones((), dtype=src), x)
            if variant == 4:
                x = x * 0
            for t in (x, x[::3], x.reshape(-1, 1).expand(-1, 2)):
                want, smallest = compared(t, target)
                lohi = (t.amin(), t.amax())
                took[mc._finite_counts(t, target, lohi) is not None] += 1
                counts, min_nz = full_counts(t, target, extremes=lohi)
                assert counts.tolist() == want and counts.dtype == torch.int64
                assert min_nz.item() == smallest and min_nz.dtype == torch.float32 and min_nz.dim() == 0
    assert took[True] and took[False]                      # both ways were taken
