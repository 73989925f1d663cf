"""What a divergence check read: its pending rows turned into ``divergence`` event fields, and the FP32 reference
ranges per module (:class:`~ampaudit.runtime.divergence.DivergenceProbe`'s results).

    fields = read_events(pending, batch)     # pending: [(tag, sums)], sums a MetricBatch row index, a device
                                             # row of its own, or plain numbers; one host read for all
    ranges = module_ranges(rows, torch.float16)   # rows: [(module, counts[6], amax)]
    counts, amax, last = range_of(outputs, torch.float16, last)   # one module's row (last: the previous call's)

A pending row tagged ``{ROUNDING_OF: key}`` is a rounding measure of the local row just before it: its rel_l2
goes into that row's event as ``key`` (``input_rel_l2``, ``output_rel_l2``).
"""
from __future__ import annotations

import math
from typing import Any

import torch

from ampaudit.dtypes import limits
from ampaudit.runtime.fp32 import ieee_fp32
from ampaudit.runtime.metric_batch import MetricBatch, finish_metrics
from ampaudit.runtime.stats import full_counts

ROUNDING_OF = "_rounding_of"   # tag of a pending row that is a rounding measure of the local row before it


class Sampled:
    """A copy of the elements of a real output that the metrics read, and the output's full shape."""

    __slots__ = ("shape", "values")

    def __init__(self, shape: torch.Size, values: torch.Tensor):
        self.shape, self.values = shape, values


def sampled_pairs(reals: list[Sampled], refs: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(real sample, FP32 reference) pairs of the outputs whose shapes agree: a sample is taken with the stride
    of the full tensor, so it lines up with the reference's."""
    return [(r.values, b) for r, b in zip(reals, refs) if r.shape == b.shape]


def range_of(refs: list[torch.Tensor], dtype: torch.dtype, last: tuple | None) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """(counts, absmax, memo) of a module's FP32 outputs ``refs`` against ``dtype``; ``last`` is the memo of the
    module recorded just before. A container returns its last child's output and a wrapper its inner module's:
    the same tensors, unwritten since (version counters), reuse that module's statistics."""
    if (last is not None and len(last[0]) == len(refs)
            and all(a is b and a._version == v for a, b, v in zip(refs, last[0], last[1]))):
        return last[2], last[3], last
    counts = torch.stack([full_counts(r.detach(), dtype)[0] for r in refs]).sum(0)
    amax = torch.stack([r.detach().abs().amax().float() for r in refs]).amax()
    return counts, amax, (refs, [r._version for r in refs], counts, amax)


def read_events(pending: list[tuple[dict, Any]], batch: MetricBatch) -> list[dict]:
    """Fields of one ``divergence`` event per pending (tag, sums) row of a check; one host read for all. Clears
    ``pending`` (and ``batch``, through its rows)."""
    if not pending:
        return []
    with ieee_fp32():                # the sums are batched products: no TF32 there either
        batched = batch.rows()
    # Rows of the batch first, then the rows computed on their own (parameter gradients); plain
    # numbers (modules that cannot add error) need no read.
    own = [s for _, s in pending if isinstance(s, torch.Tensor)]
    parts = [batched] if batched is not None else []
    if own:
        parts.append(torch.stack([r.to(own[0].device) for r in own]))
    values = torch.cat([p.to(parts[0].device) for p in parts]).tolist() if parts else []
    n, at = len(batched) if batched is not None else 0, iter(range(len(own)))
    picked = [values[s] if isinstance(s, int) else values[n + next(at)] if isinstance(s, torch.Tensor)
              else list(s) for _, s in pending]
    out: list[dict] = []
    for (tag, _), v in zip(pending, picked):
        if ROUNDING_OF in tag:      # a rounding measure of the local row just before it
            out[-1][tag[ROUNDING_OF]] = finish_metrics(v)["rel_l2"]
        else:
            out.append({**tag, **finish_metrics(v)})
    pending.clear()
    return out


def module_ranges(ranges: list[tuple[str, torch.Tensor, torch.Tensor]], dtype: torch.dtype) -> dict[str, dict]:
    """FP32 reference magnitudes per module, judged against ``dtype``: from (module, counts, amax) rows of
    :func:`~ampaudit.runtime.magnitude_counts.full_counts` sums."""
    tmax = limits(dtype).max
    result: dict[str, dict] = {}
    for name, counts, amax in ranges:
        nonzero, ge_under, ge_tiny, ge_over, _, _ = counts.tolist()
        a = float(amax)
        r = result.setdefault(name, {"absmax": 0.0, "nonzero": 0, "below_tiny": 0, "flush": 0,
                                     "overflow": 0})
        r["absmax"] = max(r["absmax"], a)
        r["nonzero"] += nonzero
        r["below_tiny"] += nonzero - ge_tiny
        r["flush"] += nonzero - ge_under
        r["overflow"] += ge_over
    for r in result.values():
        a = r["absmax"]
        r["headroom_bits"] = (math.log2(tmax / a) if a > 0 and math.isfinite(a)
                              else (math.inf if a == 0 else -math.inf))
        n = max(r.pop("nonzero"), 1)
        r["underflow_share"] = r.pop("below_tiny") / n
        r["flush_share"] = r.pop("flush") / n
    return result
