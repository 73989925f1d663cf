"""Integer-valued tensors (positions, step counts, token counters) held in fp16/bf16 past the integers the dtype
represents exactly: 2 ** (mantissa bits + 1), 2048 for fp16 and 256 for bf16 (from ``torch.finfo``).

    values = fold_integers(ctx, rule.params)   # {node: float64 tensor of the exact values it holds}
    exact_limit(torch.bfloat16)        # 256

Nothing is guessed: a tensor is folded from ``arange`` (its arguments, the ints the graph computed from shapes
included, and the length of its fake output) or from a constant tensor / buffer whose data are integers, then through
the carriers, casts and integer arithmetic the rule lists (AMP404 in rules/constants.toml), each op run again on the
folded values in float64. A finding needs a folded value the target dtype really rounds (4001 is 4000 in fp16), at
the first node that holds it in that dtype: created there (``arange(n, dtype=x.dtype)``), cast there
(``.type_as(x)``, ``.half()``), or taken as a number by an op that computes in it (``pos * freq`` with ``freq``
half, a matmul under autocast).
"""
from __future__ import annotations

import math
from typing import Any, Iterator

import torch
import torch.fx as fx
from torch.utils._pytree import tree_map

from ampaudit.analysis.amp_prop import AMP_KEY
from ampaudit.capture.opaque import user_function
from ampaudit.dtypes import exact_int_limit, name_of
from ampaudit.policy import settings
from ampaudit.rules.registry import OPS, Hit, MatchContext, matcher

FIELDS = {"value", "exact", "example", "rounded", "error", "compute_dtype", "how"}
PARAMS = {"sources": OPS, "carriers": OPS, "casts": OPS, "arithmetic": OPS, "uses_values": OPS, "max_elements": int}
# Keyword arguments that say where or how a tensor lives, not what values it holds: dropped when folding.
_PLACEMENT = ("dtype", "device", "layout", "pin_memory", "requires_grad", "memory_format", "non_blocking", "copy")


def exact_limit(dtype: torch.dtype) -> int:
    """The largest N such that every integer in [0, N] is exact in ``dtype``."""
    return exact_int_limit(dtype)


class _NoFold(Exception):
    """An argument has no folded or static value: the node holds values the audit cannot know."""


def _static(arg: Any, values: dict, shape_only: bool):
    """The real value of one argument: a folded tensor, an int the graph computed, or (for ops that read only a
    shape) zeros of the argument's shape."""
    if not isinstance(arg, fx.Node):
        return arg
    if arg in values:
        return values[arg]
    info = arg.meta.get(AMP_KEY)
    value = getattr(info, "value", None)
    if isinstance(value, torch.Tensor):
        if shape_only and info.shape is not None:
            return torch.zeros(info.shape, dtype=torch.float64)
        raise _NoFold
    if value is None:
        raise _NoFold
    return value  # ints, torch.Size, dtypes: what a shape computation gave


def _run(node: fx.Node, values: dict, shape_only: bool) -> torch.Tensor:
    if node.op not in ("call_function", "call_method") or user_function(node.target):
        raise _NoFold  # a module's forward, or the user's own function, is not re-run on folded values
    args = tree_map(lambda a: _static(a, values, shape_only), node.args)
    kwargs = {k: tree_map(lambda a: _static(a, values, shape_only), v) for k, v in node.kwargs.items()
              if k not in _PLACEMENT}
    if node.op == "call_method":
        return getattr(args[0], str(node.target))(*args[1:], **kwargs)
    return node.target(*args, **kwargs)


def _arange(node: fx.Node, values: dict) -> torch.Tensor:
    nums = [_static(a, values, False) for a in node.args]
    for key in ("start", "end", "step"):
        if key in node.kwargs:
            nums.append(_static(node.kwargs[key], values, False))
    if not all(isinstance(n, (int, float)) and not isinstance(n, bool) for n in nums):
        raise _NoFold
    return torch.arange(*nums, dtype=torch.float64)


def _constant(ctx: MatchContext, node: fx.Node, limit: int) -> torch.Tensor | None:
    """The data of a constant tensor or buffer (never a parameter: learned values are not counters)."""
    obj: Any = ctx.gm
    for part in str(node.target).split("."):
        obj = getattr(obj, part, None)
    if not isinstance(obj, torch.Tensor) or isinstance(obj, torch.nn.Parameter) or obj.is_meta:
        return None
    if type(obj) is not torch.Tensor or obj.numel() == 0 or obj.numel() > limit or obj.is_complex():
        return None  # fake, subclassed or empty tensors have no data to read here
    data = obj.detach().to("cpu", torch.float64)
    return data if _integers(data) else None


def _integers(v: torch.Tensor) -> bool:
    # inf == inf.round(): a mask of -inf (Longformer's torch.full_like(x, -inf)) is no counter, and is exact in fp16.
    return bool(torch.all(torch.isfinite(v) & (v == v.round())))


def fold_integers(ctx: MatchContext, cfg: dict) -> dict[fx.Node, torch.Tensor]:
    """Every node whose values are integers the audit can compute exactly, with those values (float64); ``cfg``:
    the rule's op lists (sources, carriers, casts, arithmetic) and max_elements."""
    carriers, casts, arith = set(cfg["carriers"]), set(cfg["casts"]), set(cfg["arithmetic"])
    sources = set(cfg["sources"])
    limit = int(cfg["max_elements"])
    values: dict[fx.Node, torch.Tensor] = {}
    for node in ctx.gm.graph.nodes:
        info = node.meta.get(AMP_KEY)
        if info is None or info.shape is None or math.prod(info.shape) > limit:
            continue
        try:
            if node.op == "get_attr":
                out = _constant(ctx, node, limit)
            elif info.op == "arange":
                out = _arange(node, values)
            elif info.op in sources:
                out = _run(node, values, shape_only=True)
            elif info.op in casts and node.args and node.args[0] in values:
                out = values[node.args[0]]
            elif info.op in carriers or info.op in arith:
                if not any(isinstance(a, fx.Node) and a in values for a in node.all_input_nodes):
                    continue
                out = _run(node, values, shape_only=info.op in carriers)
            else:
                continue
        except Exception:  # noqa: BLE001 - an op that does not fold ends the fold; the audit goes on
            continue
        if not isinstance(out, torch.Tensor) or out.is_complex() or tuple(out.shape) != tuple(info.shape):
            continue
        out = out.to(torch.float64)
        if _integers(out):
            values[node] = out
    return values


def _rounding(v: torch.Tensor, dtype: torch.dtype) -> tuple[float, float, float] | None:
    """(value, its rounding, the largest error) for the value the dtype rounds worst; None when all are exact."""
    r = v.to(dtype).to(torch.float64)
    err = (v - r).abs()
    worst = float(err.max()) if err.numel() else 0.0
    if worst == 0.0:
        return None
    i = int(err.flatten().argmax())
    return float(v.flatten()[i]), float(r.flatten()[i]), worst


def _divides(user: fx.Node, held: fx.Node) -> bool:
    """True when ``user`` takes ``held`` only as the divisor of a division."""
    if AMP_KEY not in user.meta or user.meta[AMP_KEY].op != "div" or len(user.args) < 2:
        return False
    return user.args[1] is held and user.args[0] is not held



@matcher("integer_values", fields=FIELDS, params=PARAMS, variants={"divisor"}, required=set(PARAMS))
def integer_values(ctx: MatchContext, rule) -> Iterator[Hit]:
    """Folded integers rounded by the dtype they are held in (judged where an op takes them, reported where they
    became low), or by an op that takes them as numbers and computes in a low dtype."""
    cfg = rule.params
    uses = set(cfg["uses_values"])
    values = fold_integers(ctx, cfg)
    low = {n for n in values if ctx.is_low(n.meta[AMP_KEY].dtype)}
    origin: dict[fx.Node, fx.Node] = {}                                  # held low -> where it became low
    taken: dict[fx.Node, list[tuple[fx.Node, fx.Node]]] = {}            # origin -> (held node, the op taking it)
    for node in ctx.gm.graph.nodes:
        if node in low:
            ups = [a for a in node.all_input_nodes if a in low]
            origin[node] = origin[ups[0]] if ups else node
            continue  # a view or cast of low integers holds them; it does not take them
        for arg in node.all_input_nodes:
            if arg in low:
                taken.setdefault(origin[arg], []).append((arg, node))
        info = node.meta.get(AMP_KEY)
        if info is None or node in values or info.op not in uses or not ctx.is_low(info.compute_dtype):
            continue
        for arg in node.all_input_nodes:
            found = _rounding(values[arg], info.compute_dtype) if arg in values and arg not in low else None
            if found is not None:
                how = f"taken by {info.op} in {name_of(info.compute_dtype)}"
                yield _hit(node, values[arg], info.compute_dtype, found, how, _divides(node, arg))
                break
    for start, pairs in taken.items():
        # Only the values an op really takes count: arange(4000, dtype=x.dtype)[:16] hands on 0..15, all exact.
        rounded = [(held, user, found) for held, user in pairs
                   if (found := _rounding(values[held], held.meta[AMP_KEY].dtype)) is not None]
        if not rounded:
            continue
        held, _user, found = max(rounded, key=lambda t: t[2][2])
        info = start.meta[AMP_KEY]
        how = (f"created in {name_of(info.dtype)}" if info.op == "arange" else
               f"cast to {name_of(info.dtype)}" if info.op in cfg["casts"] else
               f"computed in {name_of(info.dtype)} by {info.op}")
        divisor = all(_divides(user, h) for h, user, _ in rounded)
        yield _hit(start, values[held], held.meta[AMP_KEY].dtype, found, how, divisor)


def _hit(node: fx.Node, v: torch.Tensor, dtype: torch.dtype, found: tuple, how: str, divisor: bool) -> Hit:
    example, rounded, error = found
    return Hit(node, {"value": float(v.abs().max()), "exact": exact_limit(dtype), "example": example,
                      "rounded": rounded, "error": error, "compute_dtype": name_of(dtype), "how": how},
               variant="divisor" if divisor else None)
