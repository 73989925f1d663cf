"""Divergence metrics: sums over (test, reference) tensor pairs, batched, and the metrics made from them.

    sums = metric_sums([(low, fp32)])         # one pair (or several, summed): [|d|^2, |b|^2, |a|^2, a.b, max|d|]
    finish_metrics(sums.tolist())             # {"rel_l2": ..., "cosine": ..., "max_abs": ..., "sqnr_db": ...}

    batch = MetricBatch(sample=16384)
    i = batch.add([(real_out, fp32_out)])     # inside a hook: a subtraction and a copy, no reduction
    rows = batch.rows()                       # (n, 5) device tensor: [|d|^2, |b|^2, |a|^2, a.b, max|d|]

A divergence check compares a few dozen module outputs. Reducing each pair on its own (three dot products,
a min and a max, a stack) costs ~15 small kernels per pair, about as much as the FP32 forward's
activations themselves on CPU; :meth:`add` keeps only the difference ``d = a - b`` and a copy of ``b``
(taken before the caller can modify its output in place) and reduces rows of one sample length
``GROUP`` at a time, as soon as a group is full: one batched product and a few kernels per group, and a
check holds at most one group of differences per length.

Tensors above ``sample`` elements are compared on evenly spaced elements (a fixed stride, :func:`sample`);
a test tensor may be passed already sampled (1-D, with the stride of its reference), which is how the
real outputs recorded during the forward arrive.
"""
from __future__ import annotations

import math

import torch


def _stride(n: int, limit: int) -> tuple[int, int]:
    """(length, step) of the evenly spaced sample of ``n`` elements: step = ceil(n / limit), 1 up to ``limit``."""
    k = max(1, -(-n // limit))
    return -(-n // k), k


def sample(t: torch.Tensor, limit: int) -> torch.Tensor:
    """``t`` flattened; above ``limit`` elements, every k-th element (k = ceil(numel / limit)). A view."""
    # One op where possible (a check samples a few dozen tensors, and on CPU each op costs more than
    # the few thousand elements it touches): no detach unless ``t`` is in a graph, and a contiguous
    # tensor is strided in place instead of flattened and then sliced.
    if t.requires_grad:
        t = t.detach()
    length, k = _stride(t.numel(), limit)
    if k == 1:
        return t.reshape(-1)
    if t.is_contiguous():
        return t.as_strided((length,), (k,))
    return t.reshape(-1)[::k]


def sample_copy(t: torch.Tensor, limit: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A copy of :func:`sample` ``(t, limit)`` (converted to ``dtype`` if given), outside any autograd graph.

    One op for a contiguous tensor (a strided copy), where a view, a detach and a clone would be three.
    """
    with torch.no_grad():
        if t.is_contiguous():
            length, k = _stride(t.numel(), limit)
            out = torch.as_strided_copy(t, (length,), (k,))
        else:
            out = sample(t, limit).clone()
    return out if dtype is None or out.dtype == dtype else out.to(dtype)


# Module outputs larger than this are compared on evenly spaced elements (a fixed stride): the metrics of
# a check then cost a few passes over at most this many elements per module instead of over every
# activation, which on CPU costs as much as the shadow forward itself. rel_l2, cosine and SQNR are
# estimated without bias; max_abs is the maximum over the sampled elements.
METRIC_SAMPLE = 16384


def _sums(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    b = sample(b, METRIC_SAMPLE).float()
    d = torch.sub(sample(a, METRIC_SAMPLE), b)      # promotes a low-precision ``a`` without a copy of it
    dd, bb, db = d.dot(d), b.dot(b), d.dot(b)
    # a = d + b: a.b = d.b + |b|^2 and |a|^2 = |d|^2 + 2 d.b + |b|^2, so ``a`` is read once. Separate
    # amin/amax beat aminmax and abs().amax() on CPU.
    return torch.stack([dd, bb, dd + 2 * db + bb, db + bb, torch.maximum(-d.amin(), d.amax())])


def batched_sums(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """(n, 5) device tensor of :func:`metric_sums` rows for many small pairs (parameter gradients) at once:
    a few ops over the concatenation instead of a few ops per pair."""
    lengths = torch.tensor([b.numel() for _, b in pairs], device=pairs[0][1].device)
    b = torch.cat([r.detach().reshape(-1).float() for _, r in pairs])
    d = torch.cat([t.detach().reshape(-1).float() for t, _ in pairs]) - b
    seg = torch.stack([d * d, b * b, d * b])
    dd, bb, db = (torch.segment_reduce(row, "sum", lengths=lengths) for row in seg)
    mx = torch.segment_reduce(d.abs(), "max", lengths=lengths)
    return torch.stack([dd, bb, dd + 2 * db + bb, db + bb, mx], dim=1)


def metric_sums(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor | None:
    """Device tensor [|d|^2, |b|^2, |a|^2, a.b, max|d|] over (test a, reference b) pairs; None if no pair."""
    return _sum_rows([(a, b) for a, b in pairs if a.shape == b.shape])


def _sum_rows(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor | None:
    # ``a`` is the test tensor or its sample; shapes were checked by the caller.
    rows = [_sums(a, b) for a, b in pairs if b.numel()]
    if len(rows) <= 1:
        return rows[0] if rows else None
    s = torch.stack(rows)
    return torch.cat([s[:, :4].sum(0), s[:, 4].amax().reshape(1)])


def finish_metrics(sums: list[float]) -> dict[str, float]:
    """rel_l2, cosine, max_abs, sqnr_db from :func:`metric_sums` values read back to the host."""
    dd, bb, aa, ab, mx = sums
    if dd == 0:
        return {"rel_l2": 0.0, "cosine": 1.0, "max_abs": mx, "sqnr_db": math.inf}
    rel = math.sqrt(dd / bb) if bb > 0 else math.inf
    cos = ab / math.sqrt(aa * bb) if aa > 0 and bb > 0 else 0.0
    sqnr = 10 * math.log10(bb / dd) if bb > 0 and math.isfinite(dd) else -math.inf
    return {"rel_l2": rel, "cosine": cos, "max_abs": mx, "sqnr_db": sqnr}


class MetricBatch:
    """Pairs added during one check; see the module docstring for the calling pattern."""

    def __init__(self, sample: int):
        self.limit = sample
        # Rows waiting for their group to fill, by (sample length, device): rows of one length stack
        # without padding (padding costs two ops per row).
        self._pending: dict[tuple[int, torch.device], tuple[list[int], list, list]] = {}
        self._done: list[tuple[list[int], torch.Tensor]] = []    # (row indices, their (k, 5) sums)
        self._rows = 0

    def __len__(self) -> int:
        return self._rows

    def add(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> int | None:
        """Queue one row summing over ``pairs`` (test, reference); its index in :meth:`rows`, or None when
        every reference is empty. Shapes must already match (or the test be the reference's sample)."""
        ds, bs = [], []
        for a, b in pairs:
            if not b.numel():
                continue
            # A copy: the reference may be modified in place by the code that produced it.
            ref = sample_copy(b, self.limit, torch.float32)
            if a.dim() != 1 or a.numel() != ref.numel():      # not already sampled (see the docstring)
                a = sample(a, self.limit)
            ds.append(torch.sub(a, ref))
            bs.append(ref)
        if not ds:
            return None
        d = ds[0] if len(ds) == 1 else torch.cat(ds)
        b = bs[0] if len(bs) == 1 else torch.cat(bs)
        key = (d.numel(), d.device)
        index, self._rows = self._rows, self._rows + 1
        group = self._pending.setdefault(key, ([], [], []))
        group[0].append(index)
        group[1].append(d)
        group[2].append(b)
        if len(group[0]) == GROUP:
            self._flush(key)
        return index

    def _flush(self, key: tuple[int, torch.device]) -> None:
        indices, ds, bs = self._pending.pop(key)
        self._done.append((indices, _reduce(ds, bs)))

    def rows(self) -> torch.Tensor | None:
        """(n, 5) device tensor, one row per :meth:`add`; None if nothing was added. Clears the batch."""
        for key in list(self._pending):
            self._flush(key)
        done, self._done, self._rows = self._done, [], 0
        if not done:
            return None
        device = done[0][1].device
        order = [i for indices, _ in done for i in indices]
        sums = torch.cat([r.to(device) for _, r in done]) if len(done) > 1 else done[0][1]
        if order == sorted(order):
            return sums
        out = torch.empty_like(sums)
        out[torch.tensor(order, device=device)] = sums
        return out


GROUP = 8


def _reduce(ds: list[torch.Tensor], bs: list[torch.Tensor]) -> torch.Tensor:
    # Rows of one length. m: (rows, [d, b], length); one batched product gives every |d|^2, d.b and |b|^2
    # (a NaN of ``d`` does not reach |b|^2: each entry reads its own two rows only).
    rows, length = len(ds), ds[0].numel()
    m = torch.stack([t for pair in zip(ds, bs) for t in pair]).view(rows, 2, length)
    dd, db, _, bb = torch.bmm(m, m.transpose(1, 2)).view(rows, 4).unbind(1)
    mx = m[:, 0].abs().amax(dim=1)      # max |d|, NaN stays NaN (vector_norm(inf) and aminmax(dim) are
                                        # ~15x slower on CPU)
    # |a|^2 = |d|^2 + 2 d.b + |b|^2 and a.b = d.b + |b|^2, with a = d + b (never read again).
    ab = db + bb
    return torch.stack([dd, bb, dd + db + ab, ab, mx], dim=1)
