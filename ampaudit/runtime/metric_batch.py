"""Divergence metric sums of many (test, reference) tensor pairs, computed together at the end of a check.

    batch = MetricBatch(sample=16384)
    i = batch.add([(real_out, fp32_out)])     # inside a hook: a subtraction and a copy, no reduction
    rows = batch.rows()                       # (n, 5) device tensor: [|d|^2, |b|^2, |a|^2, a.b, max|d|]

A divergence check compares a few dozen module outputs. Reducing each pair on its own (three dot products,
a min and a max, a stack) costs ~15 small kernels per pair, about as much as the FP32 forward's
activations themselves on CPU; :meth:`add` keeps only the difference ``d = a - b`` and a copy of ``b``
(taken before the caller can modify its output in place) and reduces them ``GROUP`` rows at a time: a few
kernels over the stacked (rows, length) samples. Reducing as soon as a group is full (rather than
all rows at the end) keeps at most one group alive: the same few blocks of memory are reused by every
group, where holding every row of a check grew the heap by megabytes that the C allocator handed back
to the system afterwards, and faulted in again on the next check.

Tensors above ``sample`` elements are compared on evenly spaced elements (a fixed stride, :func:`sample`);
a test tensor may be passed already sampled (1-D, with the stride of its
reference), which is how the real outputs recorded during the forward arrive.
"""
from __future__ import annotations

import torch


def sample(t: torch.Tensor, limit: int) -> torch.Tensor:
    """``t`` flattened; above ``limit`` elements, every k-th element (k = ceil(numel / limit)). A view."""
    # One op where possible (a check samples a few dozen tensors, and on CPU each op costs more than
    # the few thousand elements it touches): no detach unless ``t`` is in a graph, and a contiguous
    # tensor is strided in place instead of flattened and then sliced.
    if t.requires_grad:
        t = t.detach()
    n = t.numel()
    if n <= limit:
        return t.reshape(-1)
    k = -(-n // limit)
    if t.is_contiguous():
        return t.as_strided((-(-n // k),), (k,))
    return t.reshape(-1)[::k]


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
            ref = sample(b, self.limit).to(torch.float32, copy=True)
            ds.append(torch.sub(sample(a, self.limit), ref).float())
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
    # Rows of one length: (rows, length) matrices.
    d, b = (torch.stack(ds), torch.stack(bs)) if len(ds) > 1 else (ds[0][None], bs[0][None])
    # (rows, length) matrices, a few kernels per group. |b|^2 is its own product: a NaN of ``d`` must not
    # reach it.
    dd, db, bb = torch.linalg.vecdot(d, d), torch.linalg.vecdot(d, b), torch.linalg.vecdot(b, b)
    mx = torch.maximum(-d.amin(dim=1), d.amax(dim=1))
    # |a|^2 = |d|^2 + 2 d.b + |b|^2 and a.b = d.b + |b|^2, with a = d + b (never read again).
    return torch.stack([dd, bb, dd + 2 * db + bb, db + bb, mx], dim=1)
