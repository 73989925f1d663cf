"""Source fixers that edit one expression: upcast an operand, pass ``dtype=torch.float32``, build positions in fp32,
compute a hand-written statistic in fp32. Every edit adds ``.float()`` or an fp32 dtype where the FP32 model
already has fp32 tensors, so FP32 results are unchanged bit for bit; under autocast the value is computed (and
kept) in fp32. Where autocast itself would lower the op again (a matmul), the statement goes in an
autocast-disabled block instead (``fixers_block.wrap_statement``).
"""
from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from ampaudit.sourcefix.cst_tools import (FP32_MATCHER, ReplaceNodes, Source, callee_name, cast_to_dtype_of,
                                          fp32_dtype, is_simple, is_upcast, keyword_value, method, receiver, upcast,
                                          with_keyword)
from ampaudit.sourcefix.locate import Spot, is_literal, locate, low_operands
from ampaudit.sourcefix.registry import FixContext, Refusal, keep_fp32_instead, source_fixer


def _instead(ctx: FixContext) -> str:
    return keep_fp32_instead(ctx.finding.module)


def _not_found(ctx: FixContext, what: str) -> Refusal:
    return ctx.refuse(f"no {what} found on line {ctx.line} for {ctx.finding.op}", _instead(ctx))


def _upcast_operands(spot: Spot, indices: list[int]) -> dict:
    return {spot.operands[i]: upcast(spot.operands[i]) for i in indices if not is_upcast(spot.operands[i])}


def _needs_autocast_off(ctx: FixContext, op: str) -> bool:
    """Autocast casts this op's inputs down again ("lower" ops: matmul, linear, conv): upcasting is not enough."""
    return ctx.policy.category(op) == "lower" or bool(ctx.params.get("autocast_off"))


@source_fixer("upcast_operand")
def upcast_operand(ctx: FixContext):
    """A constant the op's dtype cannot hold (a -1e9 mask, a 1e-8 eps): compute the op in fp32 by upcasting the
    tensor the constant meets; an op's eps parameter (given or its default): call the op on fp32 input and cast
    its bounded result back."""
    spots = locate(ctx)
    if not spots:
        return _not_found(ctx, "expression")
    if ctx.finding.details.get("param"):
        return upcast_op(ctx, cast_back=ctx.finding.op in ctx.params.get("cast_back_ops", ()))
    mapping: dict = {}
    for spot in spots:
        low = low_operands(ctx, spot)
        if not low:   # no graph node: upcast every operand that is not the constant itself
            low = [i for i, e in enumerate(spot.operands) if not is_literal(e) and not _is_constant_expr(e)][:1]
        mapping.update(_upcast_operands(spot, low))
    if not mapping:
        return ctx.refuse(f"the tensor operand of {ctx.finding.op} on line {ctx.line} is already fp32", _instead(ctx))
    if _needs_autocast_off(ctx, ctx.finding.op):
        from ampaudit.sourcefix.fixers_block import wrap_statement

        return wrap_statement(ctx, spots[0].expr, mapping, f"{ctx.finding.op} in fp32")
    value = ctx.finding.details.get("value")
    what = f"{value:.3g}" if isinstance(value, float) else "the constant"
    return [ctx.edit(mapping, f"{ctx.finding.op} meets {what} in fp32: upcast {_names(ctx.src, mapping)}")]


def _is_constant_expr(expr: cst.BaseExpression) -> bool:
    """``torch.finfo(torch.float32).min``, ``MASK_VALUE``, ``float('-inf')``: not the tensor operand."""
    if m.matches(expr, m.Attribute(value=m.Call(func=m.Attribute(attr=m.Name("finfo")) | m.Name("finfo")))):
        return True
    if isinstance(expr, cst.Name) and expr.value.isupper():
        return True
    return isinstance(expr, cst.Call) and callee_name(expr) == "float"


def _names(src: Source, mapping: dict) -> str:
    return ", ".join(src.code(k).strip() for k in mapping)


@source_fixer("upcast_op")
def upcast_op(ctx: FixContext, cast_back: bool | None = None):
    """A precision-sensitive op in fp16/bf16: ``dtype=torch.float32`` where the op takes one (softmax, sum,
    cumsum), else its low-precision inputs upcast; the result cast back to the input's dtype when the rule says
    the result is bounded (``cast_back``: softmax, norms), else kept fp32 (an exp or a total may not fit)."""
    spots = locate(ctx)
    if not spots:
        return _not_found(ctx, "call")
    cast_back = ctx.params.get("cast_back", False) if cast_back is None else cast_back
    dtype_ops = set(ctx.params.get("dtype_ops", ()))
    mapping: dict = {}
    described = []
    for spot in spots:
        op = ctx.finding.op
        if op in dtype_ops and isinstance(spot.expr, cst.Call) and spot.style in ("function", "method"):
            current = keyword_value(spot.expr, "dtype")
            if current is not None and m.matches(current, FP32_MATCHER):
                continue
            new = with_keyword(spot.expr, "dtype", fp32_dtype())
            first = spot.operands[0] if spot.operands else None
            if cast_back and first is not None and is_simple(first):
                new = cast_to_dtype_of(new, first)
            mapping[spot.expr] = new
            described.append(f"{op}(..., dtype=torch.float32)" + (f".to({ctx.src.code(first)}.dtype)" if
                                                                   cast_back and first is not None and is_simple(first) else ""))
            continue
        low = low_operands(ctx, spot)
        ups = _upcast_operands(spot, low)
        if not ups:
            continue
        first = spot.operands[low[0]]
        if _needs_autocast_off(ctx, op):
            from ampaudit.sourcefix.fixers_block import wrap_statement

            return wrap_statement(ctx, spot.expr, ups, f"{op} in fp32")
        new = spot.expr.visit(ReplaceNodes(ups))
        if cast_back and is_simple(first):
            new = cast_to_dtype_of(new, first)
            described.append(f"{op} on {_names(ctx.src, ups)} upcast, result cast back to {ctx.src.code(first)}.dtype")
        else:
            described.append(f"{op} on {_names(ctx.src, ups)} upcast, result kept fp32")
        mapping[spot.expr] = new
    if not mapping:
        return ctx.refuse(f"{ctx.finding.op} on line {ctx.line} already gets fp32 inputs", _instead(ctx))
    return [ctx.edit(mapping, "; ".join(described))]




@source_fixer("fp32_accumulate")
def fp32_accumulate(ctx: FixContext):
    """A difference of two partial sums of a cumsum/cumprod stored in fp16/bf16: take the running sum with
    ``dtype=torch.float32`` (the line of the cumulative op, which the finding names with the difference)."""
    ops = set(ctx.params.get("ops", ("cumsum", "cumprod")))
    for name in ctx.finding.fix_nodes:
        node = ctx.nodes.get(name)
        info = node.meta.get("amp") if node is not None else None
        src_loc = getattr(info, "source", None)
        if node is None or info is None or info.op not in ops or src_loc is None:
            continue
        if str(src_loc.file) != str(ctx.finding.location["file"]):
            return ctx.refuse(f"the {info.op} is in another file ({src_loc.file})", _instead(ctx))
        mapping = {}
        for spot in locate(ctx, node=node, line=src_loc.line):
            if isinstance(spot.expr, cst.Call) and spot.style in ("function", "method"):
                current = keyword_value(spot.expr, "dtype")
                if current is None or not m.matches(current, FP32_MATCHER):
                    mapping[spot.expr] = with_keyword(spot.expr, "dtype", fp32_dtype())
        if mapping:
            return [ctx.edit(mapping, f"{info.op}(..., dtype=torch.float32): its partial sums kept in fp32",
                             line=src_loc.line)]
    return _not_found(ctx, "cumulative op")


def _square_bases(src: Source, line: int) -> list[cst.BaseExpression]:
    """The bases of squares on ``line``: ``a * a``, ``a ** 2``, ``a.pow(2)``, ``torch.pow(a, 2)``, ``a.square()``."""
    bases = []
    two = m.Integer("2") | m.Float("2.0")
    for b in src.on_line(line, cst.BinaryOperation):
        if isinstance(b.operator, cst.Multiply) and src.code(b.left).strip() == src.code(b.right).strip():
            bases += [b.left, b.right]
        elif isinstance(b.operator, cst.Power) and m.matches(b.right, two):
            bases.append(b.left)
    for c in src.on_line(line, cst.Call):
        name = callee_name(c)
        recv = receiver(c)
        if name == "pow" and recv is not None and c.args and m.matches(c.args[0].value, two):
            bases.append(recv)
        elif name == "pow" and recv is None and len(c.args) >= 2 and m.matches(c.args[1].value, two):
            bases.append(c.args[0].value)
        elif name == "square":
            bases.append(recv if recv is not None else (c.args[0].value if c.args else None))
    return [b for b in bases if b is not None]


@source_fixer("norm_stat")
def norm_stat(ctx: FixContext):
    """A hand-written variance or RMS: square fp32 values (``x.float().pow(2).mean(-1, keepdim=True)``), so the
    squares cannot overflow; the statistic stays fp32, as Llama's RMSNorm keeps it."""
    bases = [b for b in _square_bases(ctx.src, ctx.line) if not is_upcast(b)]
    if not bases:
        return _not_found(ctx, "square")
    mapping = {b: upcast(b) for b in bases}
    return [ctx.edit(mapping, f"square of {_names(ctx.src, mapping)} computed in fp32")]


_FACTORIES = ("arange", "ones", "zeros", "full", "linspace", "empty", "ones_like", "zeros_like", "full_like")
_LOW_CASTS = ("half", "bfloat16")


@source_fixer("fp32_positions")
def fp32_positions(ctx: FixContext):
    """Integers (positions, counters) held in fp16/bf16 past their exact range: build them in fp32 --
    ``arange(..., dtype=torch.float32)``, ``.float()`` for ``.type_as(x)`` / ``.to(x.dtype)`` -- or, where
    autocast lowers the op that meets them (a matmul of frequencies and positions), run that statement with
    autocast off. Only the casts on the finding's line change; in FP32 they all give float32 already."""
    mapping: dict = {}
    for call in ctx.src.on_line(ctx.line, cst.Call):
        name = callee_name(call)
        recv = receiver(call)
        if name in _FACTORIES:
            dtype = keyword_value(call, "dtype")
            if dtype is not None and not m.matches(dtype, FP32_MATCHER):
                mapping[call] = with_keyword(call, "dtype", fp32_dtype())
        elif recv is not None and (name == "type_as" or name in _LOW_CASTS
                                   or (name == "to" and _is_dtype_cast(call))):
            mapping[call] = method(recv, "float")
    if mapping:
        return [ctx.edit(mapping, "integers built in fp32: " + ", ".join(ctx.src.code(c).strip()[:60]
                                                                         for c in mapping))]
    spots = locate(ctx)
    if spots and _needs_autocast_off(ctx, ctx.finding.op):
        from ampaudit.sourcefix.fixers_block import wrap_statement

        low = low_operands(ctx, spots[0])
        return wrap_statement(ctx, spots[0].expr, _upcast_operands(spots[0], low),
                              f"{ctx.finding.op} of the integers in fp32")
    return ctx.refuse(f"line {ctx.line} casts no integers to a low dtype that a source edit can change",
                      _instead(ctx))


def _is_dtype_cast(call: cst.Call) -> bool:
    """``x.to(y.dtype)``, ``x.to(dtype=...)``, ``x.to(torch.float16)``; not ``x.to(device)``."""
    if not call.args:
        return False
    value = keyword_value(call, "dtype") or call.args[0].value
    if m.matches(value, m.Attribute(attr=m.Name("dtype"))):
        return True
    return m.matches(value, m.Attribute(value=m.Name("torch"), attr=m.Name("float16") | m.Name("half")
                                        | m.Name("bfloat16")))
