"""Per-module tensor statistics, accumulated per pass and read once per pass and once per interval.

    acc = StatsAccumulator(target=torch.float16)
    slot = acc.slot("mlp.fc", "forward")
    acc.observe(slot, tensor, full=True)      # inside a hook: queues device ops (on CPU, counts read a few values)
    nonfinite_slots = acc.end_pass()          # once per forward/backward pass: ONE host read
    records = acc.drain()                     # once per interval: list of ``stats`` event fields

Two tiers keep the hot path cheap (measured on CPU: counting costs ~5-8x a max):
- every sampled pass, every tensor: its (min, max) (one or two reductions, :func:`extremes`). A NaN/inf makes
  them non-finite, so the same numbers double as the per-module non-finite flag; ``end_pass`` stacks the pass's
  extremes and reads them once (the one sync a GradScaler makes per step, on a GPU), folding ``max(-min, max)``
  into each slot's absmax on the host.
- on "full" passes (one in ``counts_every``): exact counts of zeros, values that would flush to zero or be
  subnormal in the target dtype, values above its max, inf and NaN, and the smallest nonzero magnitude.

Counting reads one histogram of the tensor's magnitude bits, or on CPU, for a finite tensor whose extremes are
known, a count of its nonzeros and their smallest magnitude (:mod:`ampaudit.runtime.magnitude_counts`);
thresholds are those of the *target* dtype (the one autocast lowers to), expressed in the tensor's own
dtype: an fp32 residual stream is judged by whether it would fit fp16 (the ``dtype`` field, the output's own,
tells the reader that it is already FP32).
"""
from __future__ import annotations

import math

import torch

from ampaudit.dtypes import is_half, limits
# Re-exported: the counting helpers lived here first.
from ampaudit.runtime.magnitude_counts import (COUNT_FIELDS, count_ge, full_counts, key_histogram,  # noqa: F401
                                               magnitude_bits, thresholds)


def extremes(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """0-d device tensors (min, max) of ``t``; NaN propagates, so they double as the non-finite flag."""
    t = t.detach()
    if not t.numel():                       # nothing to be non-finite: (0, 0), where aminmax would raise
        zero = t.new_zeros(())
        return zero, zero
    # One pass: on CPU aminmax beats abs().amax() (which also allocates a copy) for every dtype, and beats a
    # separate amin and amax for fp32 too inside a training step, where the tensor is read from memory twice
    # (sampled passes of the sample transformer, amin + amax against aminmax on its fp32 tensors, the same
    # steps side by side: +3.82/+3.87 ms against +3.64/+3.54 ms per pass), though not on a warm, idle core.
    if is_half(t.dtype) or t.dtype in (torch.float32, torch.float64):
        return torch.aminmax(t)
    return t.amin(), t.amax()


def nonfinite_now(t: torch.Tensor) -> bool:
    """Whether the CPU tensor ``t`` holds an inf or NaN, read now: one sum, and :func:`extremes` only when it is not
    finite.

    Any inf or NaN element makes a float sum inf or NaN, so a finite sum clears the tensor; a sum that overflows
    from finite values is told apart by the extremes. A sum is one pass at about half an aminmax's cost on CPU
    (bf16 4.5 us against 9.4 us per 59392 values, fp32 3.1 us against 9.9 us for amin + amax); fp16 sums in fp32
    (its own range would overflow on ordinary logits).
    """
    t = t.detach()
    total = t.sum(dtype=torch.float32) if t.dtype == torch.float16 else t.sum()
    if math.isfinite(total.item()):
        return False
    lo, hi = extremes(t)
    return not (math.isfinite(lo.item()) and math.isfinite(hi.item()))


def any_nonfinite(values: list[torch.Tensor]) -> bool:
    """Whether any of the 0-d device tensors ``values`` (say :func:`extremes`) is inf or NaN: one host read.

    On CPU a read costs no synchronisation: reading each value beats any kernel that combines them (in a
    training loop each small op costs 10-30 us on CPU, caches cold, more than its data). Elsewhere the
    values are combined on the device and read once.
    """
    if not values:
        return False
    device = values[0].device.type
    if device == "cpu":
        return not all(math.isfinite(v.item()) for v in values)
    stacked = torch.stack(values)
    if device == "mps":                    # no float64 there
        return not bool(torch.isfinite(stacked).all())
    # A float64 sum of the values is finite exactly when they all are (inf - inf gives NaN).
    return not math.isfinite(stacked.sum(dtype=torch.float64).item())


def _read_float32(stacks: list[torch.Tensor]) -> list[list[float]]:
    """The values of 1-d device tensors as float32, as lists: one read per tensor on CPU (where a read waits on
    nothing), else one read of them all."""
    if stacks[0].device.type == "cpu":
        return [s.float().tolist() for s in stacks]
    flat = torch.cat([s.float() for s in stacks]).tolist()
    out, at = [], 0
    for s in stacks:
        out.append(flat[at:at + s.numel()])
        at += s.numel()
    return out


class StatsAccumulator:
    """Accumulators for (module, phase) slots; see the module docstring for the calling pattern."""

    def __init__(self, target: torch.dtype = torch.float16):
        self.target = target
        self.names: list[tuple[str, str]] = []
        self._index: dict[tuple[str, str], int] = {}
        self._device: torch.device | None = None
        # This pass: dtype -> (slots, [min, max, min, max, ...]). ``_last``: the last tensor seen and its results; a
        # container returning its last child's output sees that same tensor right after the child does.
        self._pass_max: dict[torch.dtype, tuple[list[int], list[torch.Tensor]]] = {}
        self._last: tuple | None = None
        self._reset()

    def slot(self, module: str, phase: str) -> int:
        """Index of the (module, phase) slot, created on first use."""
        key = (module, phase)
        if key not in self._index:
            self._index[key] = len(self.names)
            self.names.append(key)
        return self._index[key]

    def _reset(self) -> None:
        self._absmax: dict[int, float] = {}          # slot -> largest |x| of the interval (inf once non-finite)
        self._nonfinite_passes: dict[int, int] = {}
        self._counts: dict[int, torch.Tensor] = {}
        self._min_nz: dict[int, torch.Tensor] = {}
        self._numel: dict[int, int] = {}
        self._observed: dict[int, int] = {}
        self._full_passes: dict[int, int] = {}
        self._dtype: dict[int, torch.dtype] = {}     # slot -> its output's dtype (a low-precision one wins)

    def observe(self, slot: int, t: torch.Tensor, *, full: bool, histogram: torch.Tensor | None = None,
                cumulative: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Queue statistics of ``t`` (a floating tensor) for ``slot``; reads nothing back. Returns ``t``'s
        (min, max) 0-d device tensors. ``histogram``: ``key_histogram(t)``, if the caller already made it, and
        ``cumulative`` its ``cumsum(0)``."""
        if self._device is None:
            self._device = t.device
        seen = self._last
        if seen is not None and seen[0] is t:
            # The same tensor again (a container returning its last child's output): reuse its results.
            lohi, counts, min_nz = seen[1], seen[2], seen[3]
        else:
            lohi = extremes(t)
            counts = min_nz = None
            if full:
                counts, min_nz = full_counts(t, self.target, histogram, extremes=lohi, cumulative=cumulative)
                if t.device != self._device:
                    counts, min_nz = counts.to(self._device), min_nz.to(self._device)
            self._last = (t, lohi, counts, min_nz)
        if slot not in self._dtype or is_half(t.dtype):
            self._dtype[slot] = t.dtype
        group = self._pass_max.get(t.dtype)
        if group is None:
            group = self._pass_max[t.dtype] = ([], [])
        group[0].append(slot)
        group[1].extend(lohi)
        if counts is not None:
            if slot in self._counts:
                self._counts[slot] += counts
                self._min_nz[slot] = torch.minimum(self._min_nz[slot], min_nz)
            else:
                self._counts[slot], self._min_nz[slot] = counts.clone(), min_nz
            self._numel[slot] = self._numel.get(slot, 0) + t.numel()
        return lohi

    def extremes_of(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The (min, max) :meth:`observe` returned for ``t`` if it is the last tensor observed, else None."""
        seen = self._last
        return seen[1] if seen is not None and seen[0] is t else None

    def end_pass(self, *, full: bool = False) -> list[tuple[str, str]]:
        """Fold this pass's extremes into the interval; return the (module, phase) slots that saw inf/NaN.

        This is the one host read per pass: every (min, max) of the pass, stacked (one stack per dtype, read as
        float32; on a GPU joined first, so that a single copy to the host waits on the device).
        """
        self._last = None
        if not self._pass_max:
            return []
        groups, self._pass_max = self._pass_max, {}
        read = _read_float32([torch.stack(values) for _, values in groups.values()])
        absmax, nonfinite = self._absmax, self._nonfinite_passes
        bad: set[int] = set()
        seen: set[int] = set()
        for (slots, _), values in zip(groups.values(), read):
            for i, slot in enumerate(slots):
                lo, hi = values[2 * i], values[2 * i + 1]
                seen.add(slot)
                v = absmax_of(lo, hi)           # a non-finite tensor counts as absmax = inf
                if not math.isfinite(v):
                    bad.add(slot)
                    v = math.inf
                if v > absmax.get(slot, 0.0):
                    absmax[slot] = v
        for s in seen:
            self._observed[s] = self._observed.get(s, 0) + 1
            if full:
                self._full_passes[s] = self._full_passes.get(s, 0) + 1
            if s in bad:
                nonfinite[s] = nonfinite.get(s, 0) + 1
        return [self.names[i] for i in sorted(bad)]

    def drain(self) -> list[dict]:
        """Statistics of the passes ended so far, one dict per observed slot (``stats`` event fields); resets.

        A pass still open (forward done, backward pending) stays queued for the next interval.
        """
        if not self._observed:
            return []
        keys = sorted(self._counts)
        counts = torch.stack([self._counts[k] for k in keys]).tolist() if keys else []
        mins = torch.stack([self._min_nz[k] for k in keys]).tolist() if keys else []
        by_slot = {k: (c, m) for k, c, m in zip(keys, counts, mins)}
        tmax = limits(self.target).max
        out = []
        for slot in sorted(self._observed):
            module, phase = self.names[slot]
            amax = self._absmax.get(slot, 0.0)
            rec: dict = {"module": module, "phase": phase, "absmax": amax,
                         "headroom_bits": _headroom(tmax, amax), "nonfinite_passes": self._nonfinite_passes.get(slot, 0),
                         "passes": self._observed[slot], "counted_passes": self._full_passes.get(slot, 0),
                         "dtype": _dtype_name(self._dtype.get(slot))}
            if slot in by_slot:
                (nonzero, ge_under, ge_tiny, ge_over, ge_inf, ge_nan), mn = by_slot[slot]
                numel = self._numel[slot]
                rec.update(min_nonzero=None if not math.isfinite(mn) else mn, numel=numel,
                           zeros=numel - nonzero, underflow=nonzero - ge_under,
                           subnormal=nonzero - ge_tiny, overflow=ge_over - ge_inf,
                           inf=ge_inf - ge_nan, nan=ge_nan)
            else:
                rec.update(min_nonzero=None, numel=0, zeros=None, underflow=None, subnormal=None,
                           overflow=None, inf=None, nan=None)
            out.append(rec)
        self._reset()
        return out


def _dtype_name(dtype: torch.dtype | None) -> str | None:
    # "float32", as the meta line names dtypes: the report tells a module already in FP32 by it.
    return str(dtype).removeprefix("torch.") if dtype is not None else None


def absmax_of(lo: float, hi: float) -> float:
    """max(-lo, hi) of a tensor's min and max, NaN if either is (as torch.maximum)."""
    return math.nan if lo != lo or hi != hi else max(-lo, hi)


def _headroom(tmax: float, absmax: float) -> float:
    # log2(dtype max / absmax): bits of magnitude left before overflow (negative: already past it).
    if not math.isfinite(absmax):
        return -math.inf
    if absmax <= 0:
        return math.inf
    return math.log2(tmax / absmax)
