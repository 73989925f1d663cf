"""Histograms of log2|gradient| per module: what loss scaling has to lift into the low dtype's range.

    hist = GradHistograms(scaler=scaler)          # scaler: a GradScaler, or None (scale from note_scale)
    hist.observe([slot], grad, step)              # inside a gradient hook: device ops only, nothing read
    hist.end_pass(step)                           # after the backward: reads the scaler's scale once
    hist.note_scale(65536.0, step)                # or: the loop says which loss scale that step carried
    records = hist.drain(names)                   # once per interval: ``grad_hist`` event fields

Bins are integer exponents, ``floor(log2|x|)`` from :data:`LO` to :data:`HI`, plus zeros and inf/NaN apart. A
16-bit gradient's magnitude bits (the sign cleared) index a 32768-entry count (one ``bincount``, about twice an
``amax``, measured on CPU); an fp32 gradient is counted by its top 16 bits, which hold its exponent and the lead
of its mantissa (so bf16's bins; fp32 values below 2^-133, bf16's smallest subnormal, count as zeros). Each exponent
bin is a run of consecutive keys, so a cumulative count folds the 32768 counts into bins on the device. Those 32768 counts are
:func:`ampaudit.runtime.magnitude_counts.key_histogram`, from which the statistics' exact counts of the same
gradient are read too: the watch makes it once per gradient.

``counts`` are the gradients as they flowed: with a loss scaler, scaled. The event carries the ``scale`` they
were measured at (None: unknown), so a reader shifts them by ``-log2(scale)`` to see the gradients a run without
scaling would have had (:mod:`ampaudit.report.grad_hist`). Passes of one interval that ran at other scales are
shifted to the latest one here (by the nearest whole power of two).
"""
from __future__ import annotations

import math
from typing import Any

import torch

from ampaudit.runtime.magnitude_counts import cumulative_counts, key_histogram

LO = -133          # floor(log2) of bf16's smallest subnormal: the lowest bin a 16-bit magnitude resolves
HI = 127           # floor(log2) of fp32's largest finite value
NBINS = HI - LO + 1
ZERO, NONFINITE = NBINS, NBINS + 1      # the two extra columns of a folded count

_VIEW = {torch.float16: torch.float16, torch.bfloat16: torch.bfloat16, torch.float32: torch.bfloat16}
_FOLD: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _fold_table(view: torch.dtype, device: torch.device) -> torch.Tensor:
    """For each 15-bit magnitude pattern of ``view`` (fp16 or bf16): its column (exponent bin, ZERO, NONFINITE)."""
    key = (view, device)
    if key not in _FOLD:
        values = torch.arange(1 << 15, dtype=torch.int16).view(view).double()
        _, exp = torch.frexp(values)
        col = (exp.long() - 1 - LO).clamp(0, NBINS - 1)          # frexp: x = m * 2^e with 0.5 <= m < 1
        col = torch.where(values == 0, ZERO, col)
        col = torch.where(torch.isfinite(values), col, NONFINITE)
        _FOLD[key] = col.to(device)
    return _FOLD[key]


_ENDS: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _fold_ends(view: torch.dtype, device: torch.device) -> torch.Tensor:
    """(NBINS + 2,) long: 0, then per exponent bin and NONFINITE the last key (>= 1) of that column, so that
    consecutive differences of the keys' cumulative count at these are the columns' counts (key 0, the zeros,
    apart). Keys 1.. are in magnitude order, so each column is one run of keys."""
    key = (view, device)
    if key not in _ENDS:
        col = _fold_table(view, torch.device("cpu"))[1:]
        # The runs are in column order: bins ascending, then NONFINITE (ZERO only at key 0).
        assert bool((col[1:] >= col[:-1]).all()) and not bool((col == ZERO).any())
        upto = torch.arange(NBINS).tolist() + [NONFINITE]
        ends = [0] + [int((col <= c).sum()) for c in upto]
        _ENDS[key] = torch.tensor(ends, dtype=torch.long, device=device)
    return _ENDS[key]


def log2_counts(t: torch.Tensor, histogram: torch.Tensor | None = None,
                cumulative: torch.Tensor | None = None) -> torch.Tensor:
    """(NBINS + 2,) int64 device tensor: how many of ``t``'s values fall in each exponent bin, then zeros and
    inf/NaN. Queues device work only. ``histogram``: ``key_histogram(t)``, if already made (the statistics of
    the same gradient count the same keys), and ``cumulative`` its ``cumsum(0)``, if made too."""
    raw = histogram if histogram is not None else key_histogram(t)
    view = _VIEW.get(t.dtype, torch.bfloat16)        # other floats are keyed as float32: bf16's patterns
    # Each column is a run of keys: differences of the cumulative count at the runs' ends (a scatter of 32768
    # counts into 263 columns, index_add_, costs ~30x more on CPU).
    cum = cumulative_counts(raw, histogram, cumulative)
    runs = cum.index_select(0, _fold_ends(view, t.device)).diff()
    return torch.cat([runs[:NBINS], raw[:1], runs[NBINS:]])


def _shifted(counts: list[int], shift: int) -> list[int]:
    """Exponent-bin counts moved ``shift`` bins up (clamped at the ends); zero and non-finite columns stay."""
    if shift == 0:
        return counts
    out = [0] * NBINS + counts[NBINS:]
    for i, n in enumerate(counts[:NBINS]):
        if n:
            out[min(max(i + shift, 0), NBINS - 1)] += n
    return out


def _scale_of(scaler: Any) -> float | None:
    if scaler is None:
        return None
    if hasattr(scaler, "is_enabled") and not scaler.is_enabled():
        return 1.0
    scale = scaler.get_scale()
    return float(scale) if scale else None


class GradHistograms:
    """Per-slot exponent histograms of gradients, grouped by the step of the pass that produced them."""

    def __init__(self, scaler: Any = None):
        self.scaler = scaler
        self._groups: dict[int | None, dict[int, torch.Tensor]] = {}   # step -> slot -> counts
        self._numel: dict[tuple[int | None, int], int] = {}
        self._passes: dict[int, int] = {}
        self._scales: dict[int | None, float] = {}
        self._latest_scale: tuple[int, float] | None = None      # (step, scale) noted last, kept across drains
        self._last: tuple | None = None                          # (tensor, counts): one hook serving two slots

    def observe(self, slots: list[int], t: torch.Tensor, step: int | None,
                histogram: torch.Tensor | None = None, cumulative: torch.Tensor | None = None) -> None:
        """Count ``t`` (a floating gradient) for each of ``slots``, in the group of ``step``. ``histogram``:
        ``key_histogram(t)``, if already made, and ``cumulative`` its ``cumsum(0)``."""
        seen = self._last
        if seen is not None and seen[0] is t:
            counts = seen[1]
        else:
            counts = log2_counts(t, histogram, cumulative)
            self._last = (t, counts)
        group = self._groups.setdefault(step, {})
        for slot in slots:
            group[slot] = group[slot] + counts if slot in group else counts
            self._numel[(step, slot)] = self._numel.get((step, slot), 0) + t.numel()
            self._passes[slot] = self._passes.get(slot, 0) + 1

    def end_pass(self, step: int | None) -> None:
        """A pass of ``step`` ended (its backward is done, the optimizer has not stepped): read the scaler's scale
        for it, if there is a scaler and the pass was counted."""
        self._last = None
        if step in self._groups and step not in self._scales:
            scale = _scale_of(self.scaler)
            if scale is not None:
                self.note_scale(scale, step)

    def note_scale(self, scale: float | None, step: int | None) -> None:
        """The loss scale the backward passes of ``step`` carried (a pass counted later than any noted scale
        takes the latest one)."""
        if scale is None or not math.isfinite(scale) or scale <= 0:
            return
        self._scales[step] = float(scale)
        if self._latest_scale is None or step is None or step >= self._latest_scale[0]:
            self._latest_scale = (step if step is not None else -1, float(scale))

    def _scale_for(self, step: int | None) -> float | None:
        if step in self._scales:
            return self._scales[step]
        return self._latest_scale[1] if self._latest_scale is not None else None

    def drain(self, names: list[tuple[str, str]]) -> list[dict]:
        """``grad_hist`` event fields, one dict per slot counted since the last drain (one host read); resets.
        ``names``: the (module, phase) of each slot."""
        self._last = None
        if not self._groups:
            return []
        steps = sorted(self._groups, key=lambda s: -math.inf if s is None else s)
        keys = [(step, slot) for step in steps for slot in self._groups[step]]
        table = torch.stack([self._groups[step][slot] for step, slot in keys]).tolist()
        last_step = steps[-1]
        scale = self._scale_for(last_step)
        merged: dict[int, list[int]] = {}
        numel: dict[int, int] = {}
        for (step, slot), counts in zip(keys, table):
            here = self._scale_for(step)
            # Passes at another scale are moved to the interval's last one: a whole power of two apart for a
            # dynamic scaler (it halves and doubles).
            shift = round(math.log2(scale / here)) if scale and here else 0
            counts = _shifted(counts, shift)
            acc = merged.get(slot)
            merged[slot] = counts if acc is None else [a + b for a, b in zip(acc, counts)]
            numel[slot] = numel.get(slot, 0) + self._numel[(step, slot)]
        out = []
        for slot in sorted(merged):
            counts = merged[slot]
            module, phase = names[slot]
            bins = counts[:NBINS]
            used = [i for i, n in enumerate(bins) if n]
            lo = used[0] if used else 0
            hi = used[-1] + 1 if used else 0
            out.append({"step": last_step, "module": module, "phase": phase, "lo": LO + lo,
                        "counts": bins[lo:hi], "zeros": counts[ZERO], "nonfinite": counts[NONFINITE],
                        "numel": numel[slot], "passes": self._passes.get(slot, 0), "scale": scale})
        self._groups, self._numel, self._passes, self._scales = {}, {}, {}, {}
        return out
