"""Differences of running sums: a cumsum (or cumprod) stored in fp16/bf16, two parts of which are subtracted.

    c = x.cumsum(1)                      # each partial sum rounded once to 8 (bf16) / 11 (fp16) bits
    box = c[:, w:] - c[:, :-w]           # a window sum: the difference of two partial sums of size ~ the total

Each stored partial sum S_t is off by up to eps/2 * |S_t|, so a window sum S_{t+w} - S_t is off by up to
eps * |S_t|: for terms of one sign (the window sum about w/depth of the total) that is eps * depth / window of the
window sum. The kernel accumulates in fp32 (rules/policy/kernels.toml); only the stored partial sums are low, so
the node's output dtype decides (CUDA autocast gives cumsum an fp32 output).

A warning needs the bound to be proven: the window from the slices, and terms of one sign from the op that makes
them (the rule's ``nonnegative`` ops, AMP206 in rules/sensitive_ops.toml); otherwise the finding is an info that says what
the bound would be.
"""
from __future__ import annotations

from typing import Iterator

import torch
import torch.fx as fx

from ampaudit.analysis.amp_prop import AMP_KEY
from ampaudit.dtypes import limits, name_of
from ampaudit.policy import settings
from ampaudit.rules.registry import OPS, Hit, MatchContext, matcher

FIELDS = {"compute_dtype", "depth", "window", "error_note", "cumulative"}
_SUBTRACT = ("sub", "rsub")


def _norm_dim(dim, ndim: int) -> int | None:
    if not isinstance(dim, int) or ndim == 0:
        return None
    return dim % ndim


def _cum_dim(node: fx.Node, ndim: int) -> int | None:
    dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)
    return _norm_dim(dim, ndim)


def _slice_start(start, size: int | None) -> int | None:
    if start is None:
        return 0
    if not isinstance(start, int) or size is None:
        return None
    return max(0, min(size, start + size if start < 0 else start))


def _shift(node: fx.Node, dim: int) -> tuple[fx.Node, int | None] | None:
    """(the input node that carries the partial sums, the offset along ``dim`` this op adds: output index i holds
    input index i + offset), or None when ``node`` is not a carrier of them. Offset None: unknown."""
    info = node.meta[AMP_KEY]
    src = node.args[0] if node.args else None
    if info.op == "cat":
        parts = list(node.args[0]) if node.args else []
        cat_dim = _norm_dim(node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else 0), len(info.shape or ()))
        return (parts, cat_dim) if parts else None  # resolved by the caller: which part leads to the cumsum
    if not isinstance(src, fx.Node) or AMP_KEY not in src.meta:
        return None
    shape = src.meta[AMP_KEY].shape
    ndim = len(shape) if shape is not None else None
    if info.op in ("getitem", "slice", "narrow"):
        if info.op == "getitem":
            idx = node.args[1]
            idx = idx if isinstance(idx, tuple) else (idx,)
            if not all(isinstance(i, slice) for i in idx):
                return src, None  # ints, None or Ellipsis move the dims: offset unknown
            if len(idx) <= dim:
                return src, 0
            s = idx[dim]
            if s.step not in (None, 1):
                return src, None
            return src, _slice_start(s.start, shape[dim] if shape else None)
        d = _norm_dim(node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0), ndim or 0)
        start = node.args[2] if len(node.args) > 2 else node.kwargs.get("start")
        if d != dim:
            return src, 0
        return src, _slice_start(start, shape[dim] if shape else None)
    if info.op in ("constant_pad_nd", "pad"):
        pads = node.args[1] if len(node.args) > 1 else node.kwargs.get("pad")
        if not isinstance(pads, (list, tuple)) or ndim is None:
            return src, None
        pair = ndim - 1 - dim  # pads run from the last dim backwards, (left, right) each
        left = pads[2 * pair] if 2 * pair < len(pads) else 0
        return src, -left if isinstance(left, int) else None
    same = ("contiguous", "clone", "to", "float", "double", "half", "bfloat16", "type_as", "detach", "alias")
    return src, 0 if info.op in same else None


def _trace(node, cums: dict, carriers: set[str], depth: int = 0) -> tuple[fx.Node, int | None] | None:
    """(the low-precision cumulative node ``node`` reads partial sums of, offset along its dim), or None."""
    if not isinstance(node, fx.Node) or AMP_KEY not in node.meta or depth > 16:
        return None
    if node in cums:
        return node, 0
    if node.meta[AMP_KEY].op not in carriers:
        return None
    for cum, dim in cums.items():
        step = _shift(node, dim)
        if step is None:
            continue
        src, off = step
        if isinstance(src, list):  # cat: one part holds the partial sums, the parts before it shift them
            before = 0
            for part in src:
                found = _trace(part, cums, carriers, depth + 1)
                if found is not None and found[0] is cum:
                    offset = None if off != dim or found[1] is None or before is None else found[1] - before
                    return cum, offset
                pshape = part.meta[AMP_KEY].shape if isinstance(part, fx.Node) and AMP_KEY in part.meta else None
                before = before + pshape[dim] if before is not None and pshape and len(pshape) > dim else None
            continue
        found = _trace(src, cums, carriers, depth + 1)
        if found is not None and found[0] is cum:
            return cum, (found[1] + off if found[1] is not None and off is not None else None)
    return None


def _nonnegative(node, ops: set[str], depth: int = 0) -> bool:
    """True when the op that makes ``node`` provably gives no negative value."""
    if not isinstance(node, fx.Node) or AMP_KEY not in node.meta or depth > 8:
        return False
    info = node.meta[AMP_KEY]
    if info.op in ops or (node.op == "call_module" and info.op in ops):
        return True
    if info.op == "pow" and len(node.args) > 1 and isinstance(node.args[1], int) and node.args[1] % 2 == 0:
        return True
    if info.op == "mul" and len(node.args) == 2 and node.args[0] is node.args[1]:
        return True
    if info.op in ("add", "mul", "div", "clamp", "clamp_min", "getitem", "view", "reshape", "to", "float", "expand",
                   "unsqueeze", "contiguous", "slice"):
        tensors = [a for a in node.args if isinstance(a, fx.Node)]
        scalars = [a for a in node.args[1:] if isinstance(a, (int, float)) and not isinstance(a, bool)]
        if info.op in ("clamp", "clamp_min"):
            low = node.args[1] if len(node.args) > 1 else node.kwargs.get("min")
            return isinstance(low, (int, float)) and low >= 0
        if info.op in ("getitem", "view", "reshape", "to", "float", "expand", "unsqueeze", "contiguous", "slice"):
            return _nonnegative(node.args[0], ops, depth + 1)
        return bool(tensors) and all(s >= 0 for s in scalars) and \
            all(_nonnegative(t, ops, depth + 1) for t in tensors)
    return False


@matcher("running_sum_difference", fields=FIELDS, nullable={"window"}, variants={"small", "unproven"},
         params={"ops": OPS, "carriers": OPS, "nonnegative": OPS, "warning_error": float},
         required={"ops", "carriers", "nonnegative", "warning_error"})
def running_sum_difference(ctx: MatchContext, rule) -> Iterator[Hit]:
    """Subtractions of two parts of one low-precision cumsum (rule param ``ops``: the cumulative ops)."""
    cfg = rule.params
    carriers, nonneg = set(cfg["carriers"]), set(cfg["nonnegative"])
    cums: dict[fx.Node, int] = {}
    for node in ctx.nodes():
        info = node.meta[AMP_KEY]
        if info.op in rule.param("ops", []) and ctx.is_low(info.dtype) and info.shape:
            dim = _cum_dim(node, len(info.shape))
            if dim is not None:
                cums[node] = dim
    if not cums:
        return
    for node in ctx.nodes():
        info = node.meta[AMP_KEY]
        if info.op not in _SUBTRACT or len(node.args) < 2:
            continue
        a, b = _trace(node.args[0], cums, carriers), _trace(node.args[1], cums, carriers)
        if a is None or b is None or a[0] is not b[0]:
            continue
        cum = a[0]
        window = abs(a[1] - b[1]) if a[1] is not None and b[1] is not None else None
        if window == 0:
            continue  # the same partial sums: not a window
        yield _hit(node, cum, cums[cum], window, _nonnegative(cum.args[0], nonneg), float(cfg["warning_error"]))


def _hit(node: fx.Node, cum: fx.Node, dim: int, window: int | None, one_sign: bool, threshold: float) -> Hit:
    cinfo = cum.meta[AMP_KEY]
    depth = cinfo.shape[dim]
    eps = limits(cinfo.dtype).eps
    details = {"compute_dtype": name_of(cinfo.dtype), "depth": depth,
               "window": window, "cumulative": cinfo.op}
    if window is None:
        details["error_note"] = (f"; for terms of one sign a window of w is off by up to {eps * depth:.3g} / w of "
                                 f"its value")
        return Hit(node, details, variant="unproven", also=(cum,))
    bound = eps * depth / window
    details["error_note"] = f"; for terms of one sign each window sum is off by up to {bound:.0%} of its value"
    if not one_sign:
        return Hit(node, details, variant="unproven", also=(cum,))
    # The fix is the cumsum's: its partial sums must be stored in fp32 before they are subtracted.
    return Hit(node, details, variant=None if bound >= threshold else "small", also=(cum,))
