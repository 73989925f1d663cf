"""Decisions flipped by precision: how the choice a decision op made under autocast is compared with FP32's.

    kind = decision_kinds()["topk"]                        # "topk" (rules/policy/decisions.toml)
    low = decision_of("topk", "topk", bound_low, out_low)  # the indices the autocast run chose
    flipped, total = flips("topk", "topk", bound_ref, out_ref, low)   # 0-d count tensor, decisions compared

A *decision op* picks among alternatives: argmax/argmin and the indices of max(dim)/min(dim) (``index``), topk,
sort (argsort dispatches to it), comparisons gt/lt/ge/le/eq/ne (``compare``), round/floor/ceil/trunc
(``round``), bucketize/searchsorted (``bucket``), multinomial (``sample``). It is one only on floating inputs:
an op on integer tensors is exact in every dtype and is never recorded.

``bound`` is the op's arguments by schema name (:func:`bind`), ``out`` its output; the comparison runs in the
FP32 run, on the FP32 inputs, against the decision the autocast run made (``low``). What counts as a flip, per
kind (the unit of ``total`` in brackets):

- ``index`` [one per row]: the two runs chose different indices whose FP32 values differ. Ties in FP32 (equal
  maxima: either index is right) are not flips.
- ``topk`` [one per row]: the chosen *sets* differ: the FP32 values at the autocast run's k indices, sorted, are
  not the FP32 values at FP32's (order within the set, and swaps between equal FP32 values, do not count).
- ``sort`` [one per element]: the element at a rank has another FP32 value than FP32's element there (a rank
  change; equal values swapping places is not one).
- ``compare`` [one per element]: the booleans differ, except for gt/lt/ge/le where the FP32 operands are equal
  (a value exactly on the threshold); for eq/ne equality is the decision itself, so every difference counts.
- ``round``, ``bucket``, ``sample`` [one per element]: the results differ (NaN equals NaN).

The elementwise kinds (compare, round, bucket, sample) are compared on an evenly spaced sample of at most
:data:`SAMPLE` elements per call (:func:`sampled`): ``total`` counts the sample, and the share estimates the
tensor's.

Near-ties are flips: a decision changes exactly when the low-precision error of its inputs exceeds the FP32
margin between the alternatives, so a tolerance at the dtype's resolution would hide the fault itself (measured on
tests/planted/moe_router_bf16.py: counting alternatives within one bf16 unit roundoff of each other as ties leaves
1 of its 28 flipped tokens). What separates a fault from the few near-ties of any run is the share
(:func:`flagged`, ``[decisions]`` in rules/policy/settings.toml) and whether the forward uses the decision.

Shapes that differ between the runs (data-dependent output sizes) are not compared: :func:`flips` returns None.
"""
from __future__ import annotations

import math
from functools import lru_cache
from typing import Any

import torch

ORDERING = frozenset({"gt", "lt", "ge", "le"})
# Kinds with one decision per element: at most SAMPLE of them, evenly spaced, are kept and compared (a mask over a
# large activation would otherwise be copied whole on every check).
ELEMENTWISE = frozenset({"compare", "round", "bucket", "sample"})
SAMPLE = 1 << 16


@lru_cache(maxsize=None)
def decision_table() -> dict[str, dict]:
    """``{kind: {"ops": [...], "what": "..."}}`` from rules/policy/decisions.toml."""
    from ampaudit.policy import read_toml, rules_dir

    return read_toml(rules_dir() / "policy" / "decisions.toml")["kinds"]


@lru_cache(maxsize=None)
def decision_kinds() -> dict[str, str]:
    """aten op name (overload packet, without ``aten.``) -> decision kind."""
    return {op: kind for kind, row in decision_table().items() for op in row["ops"]}


def decision_limits() -> tuple[float, int]:
    """``(min_share, min_flipped)`` from rules/policy/settings.toml ``[decisions]``."""
    from ampaudit.policy import settings

    cfg = settings()["decisions"]
    return float(cfg["min_share"]), int(cfg["min_flipped"])


def flagged(row: dict, limits: tuple[float, int] | None = None) -> bool:
    """Whether a decision row (calibration's, or a trace's ``decision`` event) is a fault: the forward uses the
    result, and the share flipped reaches ``min_share`` with at least ``min_flipped`` flips."""
    share, least = limits or decision_limits()
    return bool(row.get("used")) and (row.get("flipped") or 0) >= least and (row.get("share_flipped") or 0) >= share


def what(kind: str) -> str:
    """What one flipped decision of ``kind`` means ("rows pick another top-k set")."""
    return decision_table().get(kind, {}).get("what", "decisions change")


def bind(func: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The arguments of aten op ``func`` by schema name, defaults filled in."""
    bound: dict[str, Any] = {}
    positional = iter(args)
    for arg in func._schema.arguments:
        value = next(positional, bound) if not arg.kwarg_only else bound     # ``bound``: no value given
        if value is not bound:
            bound[arg.name] = value
        elif arg.name in kwargs:
            bound[arg.name] = kwargs[arg.name]
        elif arg.has_default_value():
            bound[arg.name] = arg.default_value
    return bound


def _floating(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point()


def decision_of(kind: str, name: str, bound: dict, out: Any) -> torch.Tensor | None:
    """The decision op ``name``'s choice in ``out`` (indices, booleans, rounded values), or None when this call
    makes no decision: integer inputs, ``max()`` without a dim (a value, not a choice), an empty result."""
    if kind == "compare":
        other = bound.get("other")
        if not (_floating(bound.get("self")) or _floating(other)):
            return None
        choice = out
    elif kind == "bucket":
        values = bound.get("self")
        choice = out if _floating(values) else None
    else:
        if not _floating(bound.get("self")):
            return None
        if kind in ("topk", "sort") or (kind == "index" and isinstance(out, (tuple, list))):
            choice = out[1]
        elif kind == "index":
            choice = out if name in ("argmax", "argmin") else None
        else:
            choice = out
    if not isinstance(choice, torch.Tensor) or not choice.numel():
        return None
    return choice


def sampled(t: torch.Tensor, limit: int = SAMPLE) -> torch.Tensor:
    """``t`` flattened, or every n-th element of it when it has more than ``limit`` (the same ones for any tensor
    of that shape). n is coprime to the last dimension, so the sample visits every column (channel) in turn
    instead of the same few in each row."""
    flat = t.reshape(-1)
    step = -(-flat.numel() // limit)
    if step <= 1:
        return flat
    last = t.shape[-1] if t.dim() else 1
    while math.gcd(step, last) != 1:
        step += 1
    return flat[::step]


def kept(kind: str, choice: torch.Tensor) -> torch.Tensor:
    """What the autocast run keeps of a decision until the FP32 run: a copy, of at most :data:`SAMPLE` elements
    for the elementwise kinds."""
    return (sampled(choice) if kind in ELEMENTWISE else choice).detach().clone()


def _same(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    # Elementwise equality with NaN equal to NaN: a NaN in both runs is the same outcome.
    eq = a == b
    if a.is_floating_point() or b.is_floating_point():
        eq |= torch.isnan(a) & torch.isnan(b)
    return eq


def _dim(bound: dict, ndim: int) -> int:
    d = bound.get("dim", -1)
    d = -1 if d is None else int(d)
    return d % ndim if ndim else 0


def _index_flips(bound: dict, ref_idx: torch.Tensor, low: torch.Tensor) -> torch.Tensor | None:
    values = bound["self"].float()
    if values.dim() == 0:
        return torch.zeros((), dtype=torch.bool).expand(ref_idx.shape) if low.shape == ref_idx.shape else None
    if bound.get("dim") is None:                      # argmax() of the flattened tensor
        values, dim = values.reshape(-1), 0
        li, ri = low.reshape(1), ref_idx.reshape(1)
    else:
        dim = _dim(bound, values.dim())
        li, ri = (low, ref_idx) if bound.get("keepdim") else (low.unsqueeze(dim), ref_idx.unsqueeze(dim))
    if li.shape != ri.shape:
        return None
    li = li.to(device=values.device, dtype=torch.long)
    ri = ri.to(device=values.device, dtype=torch.long)
    return (li != ri) & ~_same(values.gather(dim, li), values.gather(dim, ri))


def _topk_flips(bound: dict, ref_idx: torch.Tensor, low: torch.Tensor) -> torch.Tensor | None:
    values = bound["self"].float()
    if low.shape != ref_idx.shape or values.dim() == 0:
        return None
    dim = _dim(bound, values.dim())
    picked = values.gather(dim, low.to(device=values.device, dtype=torch.long)).sort(dim).values
    wanted = values.gather(dim, ref_idx.to(device=values.device, dtype=torch.long)).sort(dim).values
    return (~_same(picked, wanted)).any(dim)


def _sort_flips(bound: dict, ref_idx: torch.Tensor, low: torch.Tensor) -> torch.Tensor | None:
    values = bound["self"].float()
    if low.shape != ref_idx.shape or values.dim() == 0:
        return None
    dim = _dim(bound, values.dim())
    ranked = values.gather(dim, low.to(device=values.device, dtype=torch.long))
    wanted = values.gather(dim, ref_idx.to(device=values.device, dtype=torch.long))
    return ~_same(ranked, wanted)


def _compare_flips(name: str, bound: dict, ref: torch.Tensor, low: torch.Tensor) -> torch.Tensor | None:
    picked = sampled(ref)
    if low.shape != picked.shape:
        return None
    flipped = low.to(ref.device) != picked
    if name in ORDERING:
        a, b = bound["self"], bound["other"]
        on_threshold = torch.eq(a, b) if isinstance(a, torch.Tensor) else torch.eq(b, a)
        flipped &= ~sampled(on_threshold.expand(ref.shape))
    return flipped


def flips(kind: str, name: str, bound: dict, out: Any, low: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """``(flipped, total)`` of one call: the FP32 run's arguments ``bound`` and output ``out`` against the
    autocast run's decision ``low`` (:func:`kept` of :func:`decision_of`'s). ``flipped`` is a 0-d int64 tensor (not read
    here: the caller reads all counts at once); None when the two runs' shapes differ."""
    ref = decision_of(kind, name, bound, out)
    if ref is None:
        return None
    if kind == "index":
        mask = _index_flips(bound, ref, low)
    elif kind == "topk":
        mask = _topk_flips(bound, ref, low)
    elif kind == "sort":
        mask = _sort_flips(bound, ref, low)
    elif kind == "compare":
        mask = _compare_flips(name, bound, ref, low)
    else:
        ref = sampled(ref)
        mask = ~_same(low.to(device=ref.device, dtype=ref.dtype), ref) if low.shape == ref.shape else None
    if mask is None:
        return None
    return mask.sum(), mask.numel()
