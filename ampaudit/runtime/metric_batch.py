"""Divergence metric sums of many (test, reference) tensor pairs, computed together at the end of a check.

    batch = MetricBatch(sample=16384)
    i = batch.add([(real_out, fp32_out)])     # inside a hook: a subtraction and a copy, no reduction
    rows = batch.rows()                       # (n, 5) device tensor: [|d|^2, |b|^2, |a|^2, a.b, max|d|]

A divergence check compares a few dozen module outputs. Reducing each pair on its own (three dot products,
a min and a max, a stack) costs ~15 small kernels per pair, about as much as the FP32 forward's
activations themselves on CPU; :meth:`add` keeps only the difference ``d = a - b`` and a copy of ``b``
(taken before the caller can modify its output in place) and reduces them ``GROUP`` rows at a time: a few
kernels over the zero-padded (rows, 2, length) stack. Reducing as soon as a group is full (rather than
all rows at the end) keeps at most one group alive: the same few blocks of memory are reused by every
group, where holding every row of a check grew the heap by megabytes that the C allocator handed back
to the system afterwards, and faulted in again on the next check.

Tensors above ``sample`` elements are compared on evenly spaced elements (a fixed stride), as
``divergence._sample`` does; a test tensor may be passed already sampled (1-D, with the stride of its
reference), which is how the real outputs recorded during the forward arrive.
"""
from __future__ import annotations

import torch
from torch.nn.utils.rnn import pad_sequence


def sample(t: torch.Tensor, limit: int) -> torch.Tensor:
    """``t`` flattened; above ``limit`` elements, every k-th element (k = ceil(numel / limit)). A view."""
    flat = t.detach().reshape(-1)
    n = flat.numel()
    return flat if n <= limit else flat[:: -(-n // limit)]


class MetricBatch:
    """Pairs added during one check; see the module docstring for the calling pattern."""

    def __init__(self, sample: int):
        self.limit = sample
        self._d: list[torch.Tensor] = []
        self._b: list[torch.Tensor] = []
        self._done: list[torch.Tensor] = []     # (GROUP, 5) results of the groups reduced so far
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
        self._d.append(ds[0] if len(ds) == 1 else torch.cat(ds))
        self._b.append(bs[0] if len(bs) == 1 else torch.cat(bs))
        self._rows += 1
        if len(self._d) == GROUP:
            self._flush()
        return self._rows - 1

    def _flush(self) -> None:
        if self._d:
            device = self._done[0].device if self._done else self._d[0].device
            self._done.append(_reduce([(d.to(device), b.to(device)) for d, b in zip(self._d, self._b)]))
            self._d, self._b = [], []

    def rows(self) -> torch.Tensor | None:
        """(n, 5) device tensor, one row per :meth:`add`; None if nothing was added. Clears the batch."""
        self._flush()
        done, self._done, self._rows = self._done, [], 0
        if not done:
            return None
        return done[0] if len(done) == 1 else torch.cat(done)


GROUP = 8


def _reduce(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    m = pad_sequence([t for pair in pairs for t in pair], batch_first=True)   # zero padding adds nothing
    m = m.reshape(len(pairs), 2, m.shape[-1])                                   # (n, [d, b], L)
    d, b = m[:, 0], m[:, 1]
    # Batched dot products and reductions, no temporaries of the stack's size. |b|^2 is its own product:
    # a NaN of ``d`` must not reach it.
    dd, db = torch.bmm(d.unsqueeze(1), m.transpose(1, 2)).squeeze(1).unbind(1)
    bb = torch.linalg.vecdot(b, b)
    mx = torch.maximum(-d.amin(dim=1), d.amax(dim=1))
    # |a|^2 = |d|^2 + 2 d.b + |b|^2 and a.b = d.b + |b|^2, with a = d + b (never read again).
    return torch.stack([dd, bb, dd + 2 * db + bb, db + bb, mx], dim=1)
