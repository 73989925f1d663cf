"""Exact counts of a tensor's magnitudes against a target dtype's limits, from one histogram of its bit patterns.

    counts, min_nz = full_counts(t, torch.float16)   # counts[6] int64 (COUNT_FIELDS), min_nonzero: 0-d float32
    raw = key_histogram(t)                           # (32768,) int64: elements per 15-bit magnitude key
    counts, min_nz = full_counts(t, torch.float16, histogram=raw)   # the same, reusing a histogram
    hit = count_ge(magnitude_bits(t), threshold, width)              # one threshold, by integer compare

With the sign bit cleared, an IEEE float's bits order like its magnitude, so "|x| >= threshold" is an integer
compare, and every threshold at once is a suffix sum of a histogram of the bits. A 16-bit float's 15 magnitude bits
index a 32768-entry ``bincount`` (one pass over the tensor, then a few ops on the 32768 counts); that gives every
count and the smallest nonzero magnitude exactly. An fp32 tensor is binned by its top 15 magnitude bits (exponent
and 7 mantissa bits: bf16's patterns, the keys :mod:`ampaudit.runtime.grad_hist` counts too, so a gradient's one
histogram serves both); a threshold inside a bin (fp16's max, NaN above inf, half of bf16's smallest subnormal)
takes the bin's elements at or above it from an exact compare, which on CPU runs only when that bin is not empty
(a read there costs no synchronisation), elsewhere always. Measured on a shared CPU, 1 thread, process CPU time,
against six compares of ``count_ge`` each: 65536 bf16 values ~150 -> ~100 us, 262144 bf16 ~770 -> ~250 us,
65536 fp32 ~370 -> ~175 us (varies with the load by about 30%).

On CPU, a finite tensor whose (min, max) the caller already has (the watch's statistics read them first) skips
the histogram when nothing is past the target's max: a count of the nonzeros and the smallest nonzero magnitude
give every count, with one compare more per low threshold that minimum sits below. In a training step (the sample
transformer's counting pass, process CPU time per tensor, both ways on the same tensors) that took an fp32 output
of 65536 values ~330 -> ~140 us and a bf16 one ~220 -> ~180 us; a 16-bit gradient, whose histogram the log2 bins
need anyway, is read off that (65536 bf16 values ~105 us against ~125 us without it, 262144 ~130 against ~420).

Thresholds are those of the *target* dtype (the one autocast lowers to), expressed in the tensor's own
dtype: an fp32 residual stream is judged by whether it would fit fp16.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ampaudit.dtypes import limits

# Signed integer dtype with the same width as each float dtype (bit-pattern views).
_INT_VIEW = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32,
             torch.float64: torch.int64}
# Count columns of a count, in order.
COUNT_FIELDS = ("nonzero", "ge_underflow", "ge_tiny", "ge_over", "ge_inf", "ge_nan")
KEYS = 1 << 15                       # 15-bit magnitude keys
_KEY_SHIFT = {torch.float16: 0, torch.bfloat16: 0, torch.float32: 16}


@dataclass(frozen=True)
class _Thresholds:
    """Bit-pattern thresholds of one (tensor dtype, target dtype) pair."""

    itype: torch.dtype
    width: int
    underflow: int      # |x| below this rounds to zero in the target dtype
    tiny: int           # smallest normal of the target dtype
    over: int           # first magnitude above the target dtype's max
    inf: int            # bits of +inf in the tensor's dtype (NaN bits are larger)

    @property
    def columns(self) -> tuple[int, ...]:
        """The threshold of each of COUNT_FIELDS."""
        return (1, self.underflow, self.tiny, self.over, self.inf, self.inf + 1)


def _bits(value: float, dtype: torch.dtype) -> int:
    return int(torch.tensor(value, dtype=torch.float64).to(dtype).view(_INT_VIEW[dtype]).item())


_THRESHOLDS: dict[tuple[torch.dtype, torch.dtype], _Thresholds] = {}


def thresholds(dtype: torch.dtype, target: torch.dtype) -> _Thresholds:
    """Bit thresholds for tensors of ``dtype`` judged against ``target`` (cached)."""
    key = (dtype, target)
    if key not in _THRESHOLDS:
        fi, ti = limits(dtype), limits(target)
        inf = _bits(math.inf, dtype)
        underflow = max(1, _bits(ti.subnormal / 2, dtype))
        tiny = max(underflow, _bits(ti.normal, dtype))
        over = inf if ti.max >= fi.max else max(tiny, _bits(ti.max, dtype) + 1)
        _THRESHOLDS[key] = _Thresholds(_INT_VIEW[dtype], fi.bits, underflow, tiny, over, inf)
    return _THRESHOLDS[key]


def magnitude_bits(t: torch.Tensor) -> torch.Tensor:
    """|t| viewed as signed integers of the same width: monotone in magnitude, NaN above inf."""
    return t.detach().abs().view(_INT_VIEW[t.dtype])


def count_ge(bits: torch.Tensor, threshold: int, width: int) -> torch.Tensor:
    """0-d int64 device tensor: how many ``bits >= threshold`` (threshold >= 1), without a bool pass."""
    # bits + (2^(w-1) - threshold) reaches the sign bit exactly when bits >= threshold; the arithmetic
    # shift turns that into -1, everything else into 0 (on CPU a compare-to-bool plus sum is ~3x slower).
    return torch.count_nonzero((bits + ((1 << (width - 1)) - threshold)) >> (width - 1))


def _keyed(t: torch.Tensor) -> torch.Tensor:
    """``t`` detached, in a dtype that has 15-bit keys (other floats as float32)."""
    t = t.detach()
    return t if t.dtype in _KEY_SHIFT else t.float()


def cumulative_counts(raw: torch.Tensor, histogram: torch.Tensor | None,
                      cumulative: torch.Tensor | None) -> torch.Tensor:
    """``raw``'s cumulative count: the caller's ``cumulative`` where it came with the ``histogram`` it was summed
    from (a gradient's, shared by its counts and its log2 bins), else summed here."""
    return cumulative if cumulative is not None and histogram is not None else raw.cumsum(0)


def key_histogram(t: torch.Tensor) -> torch.Tensor:
    """(32768,) int64 device tensor: how many of ``t``'s elements have each 15-bit magnitude key (a 16-bit float's
    magnitude bits; an fp32's top 15, bf16's patterns; other floats as fp32). Queues device work only."""
    t = _keyed(t)
    if t.dtype == torch.float32:
        keys = (t.view(torch.int32) >> 16) & 0x7FFF
    else:
        keys = t.view(torch.int16) & 0x7FFF
    return torch.bincount(keys.reshape(-1), minlength=KEYS)


@dataclass(frozen=True)
class _Plan:
    """How one (dtype, target, device) reads its counts off a key histogram."""

    below: torch.Tensor           # per column: the key whose cumulative count is subtracted from numel
    inside: tuple[tuple[int, int, int], ...]    # (column, threshold, its key): thresholds inside a key's bin
    inside_keys: torch.Tensor


_PLANS: dict[tuple[torch.dtype, torch.dtype, torch.device], _Plan] = {}


def _plan(dtype: torch.dtype, target: torch.dtype, device: torch.device) -> _Plan:
    key = (dtype, target, device)
    if key not in _PLANS:
        shift = _KEY_SHIFT[dtype]
        below, inside = [], []
        for col, thr in enumerate(thresholds(dtype, target).columns):
            # ge(thr) = numel - cumsum[key(thr) - 1] when thr starts its key's bin; else numel - cumsum[key(thr)],
            # plus the elements of that bin at or above thr (column 0, nonzero, is counted directly).
            aligned = thr & ((1 << shift) - 1) == 0
            below.append((thr >> shift) - (1 if aligned else 0))
            if not aligned and col:
                inside.append((col, thr, thr >> shift))
        _PLANS[key] = _Plan(torch.tensor(below, device=device), tuple(inside),
                            torch.tensor([k for _, _, k in inside], dtype=torch.long, device=device))
    return _PLANS[key]


def full_counts(t: torch.Tensor, target: torch.dtype, histogram: torch.Tensor | None = None,
                extremes: tuple[torch.Tensor, torch.Tensor] | None = None,
                cumulative: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(counts[6] int64, min_nonzero 0-d float32)`` of one float tensor, all on its device (an empty tensor:
    zero counts, min_nonzero inf). ``histogram``: :func:`key_histogram` of ``t``, if already made, and
    ``cumulative`` its ``cumsum(0)``, if made too. ``extremes``: ``t``'s (min, max) 0-d tensors, if already made:
    on CPU a finite tensor is then counted without a histogram (:func:`_finite_counts`), unless it is a 16-bit
    one whose histogram is given (reading the counts off that costs less, measured in a training step)."""
    if not t.numel():                       # amin of nothing raises (a detector with no detections)
        return (torch.zeros(len(COUNT_FIELDS), dtype=torch.int64, device=t.device),
                torch.full((), math.inf, device=t.device))
    if (extremes is not None and t.device.type == "cpu" and t.dtype in _KEY_SHIFT
            and (histogram is None or t.dtype == torch.float32)):
        found = _finite_counts(t.detach(), target, extremes)
        if found is not None:
            return found
    t = _keyed(t) if t.dtype != torch.float64 else t.detach()   # float8: exact in float32, thresholds too
    if t.dtype == torch.float64:
        return _compared_counts(t, target)
    th = thresholds(t.dtype, target)
    plan = _plan(t.dtype, target, t.device)
    n = t.numel()
    if t.dtype != torch.float32:
        raw = histogram if histogram is not None else key_histogram(t)
        cum = cumulative_counts(raw, histogram, cumulative)
        counts = n - cum.index_select(0, plan.below)
        # The smallest nonzero key: the first where the (sorted) cumulative count passes the zeros' (a binary
        # search); none below inf -> inf, reported as None.
        first = torch.searchsorted(cum, cum[:1], right=True).clamp_(max=th.inf).reshape(())
        return counts, first.to(th.itype).view(t.dtype).float()
    bits = t.abs().view(torch.int32)
    raw = histogram if histogram is not None else torch.bincount((bits >> 16).reshape(-1), minlength=KEYS)
    cum = cumulative_counts(raw, histogram, cumulative)
    counts = n - cum.index_select(0, plan.below)
    on_cpu = t.device.type == "cpu"
    # Key 0 holds the zeros (and fp32 values below 2^-133). On CPU its count is read for free: when it is
    # empty, every element is nonzero and the smallest magnitude is the smallest nonzero one, so neither a
    # count of the nonzeros nor the zero-masking minimum has to pass over the tensor.
    lowest = (raw[:1] if on_cpu else None)
    if lowest is not None and not int(lowest):
        counts[0] = n
        seen = raw.index_select(0, plan.inside_keys).tolist() if plan.inside else []
        due = [(col, thr) for (col, thr, _), c in zip(plan.inside, seen) if c]
        for col, thr in due:
            counts[col] = count_ge(bits, thr, th.width)
        return counts, bits.amin().clamp(max=th.inf).to(th.itype).view(t.dtype).float()
    nonzero = torch.count_nonzero(bits)
    counts[0] = nonzero
    if plan.inside:
        if on_cpu:
            # Elements of each such bin other than the zeros (key 0 holds them): when none, the suffix is exact.
            seen = torch.cat([raw.index_select(0, plan.inside_keys), nonzero.reshape(1)]).tolist()
            due = [(col, thr) for (col, thr, k), c in zip(plan.inside, seen) if c - (n - seen[-1] if k == 0 else 0)]
        else:
            due = [(col, thr) for col, thr, _ in plan.inside]
        for col, thr in due:
            counts[col] = count_ge(bits, thr, th.width)
    # zero -> all ones (largest), so amin finds the smallest nonzero; +1 undoes the shift.
    min_bits = bits.sub_(1).bitwise_and_(0x7FFFFFFF).amin().clamp(max=th.inf - 1) + 1
    return counts, min_bits.to(th.itype).view(t.dtype).float()


_SCREENS: dict[tuple[torch.dtype, torch.dtype], tuple[float, tuple[int, int]]] = {}


def _screen(dtype: torch.dtype, target: torch.dtype) -> tuple[float, tuple[int, int]]:
    """(|x| from which ``dtype`` values overflow ``target``, as a float; the underflow and tiny thresholds)."""
    key = (dtype, target)
    if key not in _SCREENS:
        th = thresholds(dtype, target)
        over = torch.tensor(th.over, dtype=torch.int64).to(th.itype).view(dtype).item()
        _SCREENS[key] = (over, (th.underflow, th.tiny))
    return _SCREENS[key]


def _finite_counts(t: torch.Tensor, target: torch.dtype,
                   extremes: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """:func:`full_counts` of a 16- or 32-bit CPU tensor whose (min, max) are known, without a histogram: None
    when a count needs one (an inf/NaN, or a value past the target's max).

    Finite extremes below the overflow threshold leave three counts to take: the nonzeros (one count) and,
    from the smallest nonzero magnitude (one minimum), the values at or above the underflow and tiny thresholds,
    which are all the nonzeros unless that minimum sits below them (then one integer compare each). On CPU the
    extremes are read without a synchronisation; the 32768-entry histogram and its cumulative count cost more
    than these passes over the tensor (docs/watch.md)."""
    lo, hi = extremes[0].item(), extremes[1].item()
    over, low_thresholds = _screen(t.dtype, target)
    if not (math.isfinite(lo) and math.isfinite(hi)) or max(-lo, hi) >= over:
        return None
    th = thresholds(t.dtype, target)
    n = t.numel()
    nonzero = int(torch.count_nonzero(t))
    if not nonzero:
        return torch.zeros(len(COUNT_FIELDS), dtype=torch.int64), torch.full((), math.inf)
    # Bits minus one with the sign cleared: a zero (either sign) becomes the largest pattern, so the minimum is the
    # smallest nonzero magnitude's bits minus one; a compare on these counts the zeros too (taken off below).
    shifted = t.view(th.itype).sub(1).bitwise_and_((1 << (th.width - 1)) - 1)
    smallest = int(shifted.amin()) + 1
    ge = [nonzero if thr <= smallest else int(count_ge(shifted, thr - 1, th.width)) - (n - nonzero)
          for thr in low_thresholds]
    counts = torch.tensor([nonzero, ge[0], ge[1], 0, 0, 0], dtype=torch.int64)
    return counts, torch.tensor(smallest, dtype=th.itype).view(t.dtype).float()


def _compared_counts(t: torch.Tensor, target: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    # float64: one integer compare per threshold (no histogram key covers 64-bit patterns).
    th = thresholds(t.dtype, target)
    bits = magnitude_bits(t)
    done = {1: torch.count_nonzero(bits)}
    for thr in th.columns[1:]:
        if thr not in done:                 # thresholds that coincide count once
            done[thr] = count_ge(bits, thr, th.width)
    counts = torch.stack([done[thr] for thr in th.columns])
    mask = (1 << (th.width - 1)) - 1
    min_bits = ((bits - 1) & mask).amin().clamp(max=th.inf - 1) + 1   # all zero -> inf -> reported None
    return counts, min_bits.to(th.itype).view(t.dtype).float()
