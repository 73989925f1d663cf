"""One meta-kernel run per op signature while a meta-device graph propagates.

    memo = MetaMemo()
    out = memo.call(torch.ops.aten.grid_sampler.default, args, kwargs)   # meta tensors in, fresh meta tensors out

On meta tensors an op's output depends only on its inputs' metadata (shape, stride, dtype) and its other
arguments, so an op met again with the same signature gets new empty tensors of the shapes it gave the first time
instead of a second run. That matters where the meta kernel is a Python decomposition: grid_sampler runs ~70
reference ops per call, and RAFT calls it 48 times with a handful of shapes. Fake tensors cache this way
themselves (FakeTensorMode's dispatch cache); plain meta tensors do not.

Only ops that write nothing and return fresh tensors (no aliasing or mutating schema) are memoized; anything
else, and any call whose arguments are not plain values, runs as usual.
"""
from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)


def _functional(op: torch._ops.OpOverload) -> bool:
    schema = op._schema
    return not schema.is_mutable and all(r.alias_info is None for r in schema.returns) and bool(schema.returns)


def _key(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> tuple | None:
    leaves, spec = tree_flatten((args, kwargs))
    parts: list = [op, str(spec)]
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            if not leaf.is_meta or type(leaf) not in (torch.Tensor, torch.nn.Parameter):
                return None
            parts.append((tuple(leaf.shape), leaf.stride(), leaf.dtype, leaf.storage_offset()))
        elif isinstance(leaf, _PLAIN):
            parts.append((type(leaf), leaf))
        else:
            return None
    return tuple(parts)


def _describe(out: Any):
    leaves, spec = tree_flatten(out)
    if not leaves or not all(isinstance(t, torch.Tensor) and t.is_meta for t in leaves):
        return None
    return spec, [(tuple(t.shape), t.stride(), t.dtype) for t in leaves]


class MetaMemo:
    """Memo of meta-kernel outputs by op signature; :meth:`call` runs an op or rebuilds its remembered output."""

    def __init__(self):
        self._seen: dict[tuple, Any] = {}
        self._functional: dict[torch._ops.OpOverload, bool] = {}

    def call(self, op, args: tuple, kwargs: dict):
        if not isinstance(op, torch._ops.OpOverload):
            return op(*args, **kwargs)
        functional = self._functional.get(op)
        if functional is None:
            functional = self._functional[op] = _functional(op)
        key = _key(op, args, kwargs) if functional else None
        if key is None:
            return op(*args, **kwargs)
        seen = self._seen.get(key)
        if seen is not None:
            spec, metas = seen
            return tree_unflatten([torch.empty_strided(shape, stride, dtype=dtype, device="meta")
                                   for shape, stride, dtype in metas], spec)
        out = op(*args, **kwargs)
        described = _describe(out)
        if described is not None:
            self._seen[key] = described
        return out
