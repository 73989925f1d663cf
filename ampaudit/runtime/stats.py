"""Per-module tensor statistics, accumulated on the tensors' device and read once per interval.

    acc = StatsAccumulator(target=torch.float16)
    slot = acc.slot("mlp.fc", "forward")
    acc.observe(slot, tensor, full=True)      # inside a hook: queues device ops, never reads a value
    nonfinite_slots = acc.end_pass()          # once per forward/backward pass: ONE host read
    records = acc.drain()                     # once per interval: list of ``stats`` event fields

Two tiers keep the hot path cheap (measured on CPU: counting costs ~5-8x a max):
- every pass, every tensor: ``absmax`` (abs + amax, two kernels). A NaN/inf makes it non-finite, so the
  same number doubles as the per-module non-finite flag; ``end_pass`` stacks the pass's maxima and reads
  one boolean (the same single sync a GradScaler makes per step).
- on "full" passes (one in ``counts_every``): exact counts of zeros, values that would flush to zero or be
  subnormal in the target dtype, values above its max, inf and NaN, and the smallest nonzero magnitude.

Counting reads one histogram of the tensor's magnitude bits (:mod:`ampaudit.runtime.magnitude_counts`);
thresholds are those of the *target* dtype (the one autocast lowers to), expressed in the tensor's own
dtype: an fp32 residual stream is judged by whether it would fit fp16.
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
    # Measured on CPU: aminmax is the fastest for 16-bit floats, separate amin/amax for fp32 (and both beat
    # abs().amax(), which also allocates a copy).
    if is_half(t.dtype):
        return torch.aminmax(t)
    return t.amin(), t.amax()


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


class StatsAccumulator:
    """Accumulators for (module, phase) slots; see the module docstring for the calling pattern."""

    def __init__(self, target: torch.dtype = torch.float16):
        self.target = target
        self.names: list[tuple[str, str]] = []
        self._index: dict[tuple[str, str], int] = {}
        self._device: torch.device | None = None
        # This pass: dtype -> (slots, minima, maxima). ``_last``: the last tensor seen and its results; a
        # container returning its last child's output sees that same tensor right after the child does.
        self._pass_max: dict[torch.dtype, tuple[list[int], list, list]] = {}
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
        self._absmax: torch.Tensor | None = None
        self._nonfinite_passes: torch.Tensor | None = None
        self._counts: dict[int, torch.Tensor] = {}
        self._min_nz: dict[int, torch.Tensor] = {}
        self._numel: dict[int, int] = {}
        self._observed: dict[int, int] = {}
        self._full_passes: dict[int, int] = {}

    def observe(self, slot: int, t: torch.Tensor, *, full: bool,
                histogram: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Queue statistics of ``t`` (a floating tensor) for ``slot``; reads nothing back. Returns ``t``'s
        (min, max) 0-d device tensors. ``histogram``: ``key_histogram(t)``, if the caller already made it."""
        if self._device is None:
            self._device = t.device
        seen = self._last
        if seen is not None and seen[0] is t:
            # The same tensor again (a container returning its last child's output): reuse its results.
            amax, counts, min_nz = seen[1], seen[2], seen[3]
        else:
            amax = extremes(t)
            counts = min_nz = None
            if full:
                counts, min_nz = full_counts(t, self.target, histogram)
                if t.device != self._device:
                    counts, min_nz = counts.to(self._device), min_nz.to(self._device)
            self._last = (t, amax, counts, min_nz)
        group = self._pass_max.setdefault(t.dtype, ([], [], []))
        group[0].append(slot)
        group[1].append(amax[0])
        group[2].append(amax[1])
        if counts is not None:
            if slot in self._counts:
                self._counts[slot] += counts
                self._min_nz[slot] = torch.minimum(self._min_nz[slot], min_nz)
            else:
                self._counts[slot], self._min_nz[slot] = counts.clone(), min_nz
            self._numel[slot] = self._numel.get(slot, 0) + t.numel()
        return amax

    def end_pass(self, *, full: bool = False) -> list[tuple[str, str]]:
        """Fold this pass's maxima into the interval; return the (module, phase) slots that saw inf/NaN.

        This is the one host read per pass (a single boolean; the slot list is read only when it is true).
        """
        self._last = None
        if not self._pass_max:
            return []
        n = len(self.names)
        dev = self._device
        if self._absmax is None or self._absmax.numel() < n:
            grown = torch.zeros(n, dtype=torch.float32, device=dev)
            bad = torch.zeros(n, dtype=torch.int64, device=dev)
            if self._absmax is not None:
                grown[: self._absmax.numel()] = self._absmax
                bad[: self._nonfinite_passes.numel()] = self._nonfinite_passes
            self._absmax, self._nonfinite_passes = grown, bad
        slot_list: list[int] = []
        parts = []
        for slots_of, mins, maxs in self._pass_max.values():   # one stack per dtype, not a cast per tensor
            slot_list += slots_of
            lo = torch.stack(mins).to(dev, torch.float32)
            hi = torch.stack(maxs).to(dev, torch.float32)
            parts.append(torch.maximum(-lo, hi))                     # NaN in either stays NaN
        vals = torch.cat(parts) if len(parts) > 1 else parts[0]
        slots = torch.tensor(slot_list, device=dev)
        nonfinite = ~torch.isfinite(vals)
        # NaN would poison the max: a non-finite tensor counts as absmax = inf (no headroom left).
        self._absmax.scatter_reduce_(0, slots, vals.nan_to_num(nan=math.inf), "amax")
        per_slot = torch.zeros_like(self._nonfinite_passes).scatter_reduce_(0, slots, nonfinite.long(), "amax")
        self._nonfinite_passes += per_slot
        for s in set(slot_list):
            self._observed[s] = self._observed.get(s, 0) + 1
            if full:
                self._full_passes[s] = self._full_passes.get(s, 0) + 1
        self._pass_max = {}
        if not bool(per_slot.any()):
            return []
        return [self.names[i] for i in per_slot.nonzero().flatten().tolist()]

    def drain(self) -> list[dict]:
        """Statistics of the passes ended so far, one dict per observed slot (``stats`` event fields); resets.

        A pass still open (forward done, backward pending) stays queued for the next interval.
        """
        if self._absmax is None:
            return []
        absmax = self._absmax.tolist()
        bad = self._nonfinite_passes.tolist()
        keys = sorted(self._counts)
        counts = torch.stack([self._counts[k] for k in keys]).tolist() if keys else []
        mins = torch.stack([self._min_nz[k] for k in keys]).tolist() if keys else []
        by_slot = {k: (c, m) for k, c, m in zip(keys, counts, mins)}
        tmax = limits(self.target).max
        out = []
        for slot in sorted(self._observed):
            module, phase = self.names[slot]
            amax = absmax[slot]
            rec: dict = {"module": module, "phase": phase, "absmax": amax,
                         "headroom_bits": _headroom(tmax, amax), "nonfinite_passes": bad[slot],
                         "passes": self._observed[slot], "counted_passes": self._full_passes.get(slot, 0)}
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


def _headroom(tmax: float, absmax: float) -> float:
    # log2(dtype max / absmax): bits of magnitude left before overflow (negative: already past it).
    if not math.isfinite(absmax):
        return -math.inf
    if absmax <= 0:
        return math.inf
    return math.log2(tmax / absmax)
