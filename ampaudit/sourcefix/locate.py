"""Find the expression a finding is about on its source line, and which of its operands are low-precision tensors.

    spots = locate(ctx)                # [Spot(expr=<Call F.softmax(...)>, operands=[scores, -1], style="function")]
    low = low_operands(ctx, spot)      # the operands the audit saw as fp16/bf16 tensors under the target autocast

The audit's graph node says which op ran and what dtype each argument had (``node.meta["amp"]``); the line holds
the code. A node maps to a call by its callee's name (``F.softmax``, ``x.masked_fill``, ``self.bn``) or to an
operator (``x ** 3`` is ``pow``); fx arguments line up with the call's positional arguments, a method's receiver
first. Without a node (a measured finding, a capture that lost it), the finding's op name is matched instead.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import libcst as cst
import torch
import torch.fx as fx

from ampaudit.analysis.amp_prop import AMP_KEY
from ampaudit.dtypes import is_low
from ampaudit.sourcefix.cst_tools import BINARY_OPS, receiver

# Names an op goes by in source besides its own (the fx/aten name is the left one).
ALIASES = {"truediv": ("div",), "type_as": ("type_as",), "index_add_": ("index_add_", "index_add"),
           "scatter_add": ("scatter_add", "scatter_add_"), "linalg_vector_norm": ("vector_norm", "norm"),
           "multi_head_attention": ("multi_head_attention_forward",),
           # torch.export decomposes F.normalize, cosine_similarity and pairwise_distance: their default eps
           # meets the aten clamp_min (AMP402), and the line holds the call that ran it.
           "clamp_min": ("clamp_min", "clamp", "normalize", "cosine_similarity", "pairwise_distance")}


@dataclass
class Spot:
    """One expression on the line: a call or an operator, and its operands in the graph node's argument order."""

    expr: cst.BaseExpression
    operands: list[cst.BaseExpression]
    style: str                # "function" (torch.op / F.op), "method" (x.op), "module" (self.layer), "operator"


def op_names(node: fx.Node | None, fallback: str) -> tuple[str, str]:
    """(style hint, source name) of the op a node runs: ("module", "bn1"), ("method", "masked_fill"),
    ("operator", "mul"), ("function", "softmax")."""
    if node is None:
        return ("operator" if fallback in BINARY_OPS else "any"), fallback
    if node.op == "call_module":
        return "module", str(node.target).split(".")[-1]
    if node.op == "call_method":   # fx records ``a @ b`` on proxies as the method matmul
        return ("any" if str(node.target) in BINARY_OPS else "method"), str(node.target)
    target = node.target
    if getattr(operator, getattr(target, "__name__", ""), None) is target:
        return "operator", target.__name__
    opname = getattr(target, "_opname", None) or getattr(target, "__name__", "") or fallback
    return "any", opname          # aten.mul: an operator or torch.mul in the source


def _spots_for(src, line: int, style: str, name: str) -> list[Spot]:
    spots: list[Spot] = []
    if style in ("operator", "any") and name in BINARY_OPS:
        spots += [Spot(b, [b.left, b.right], "operator") for b in src.binops_on(line, name)]
        if spots:
            return spots
    names = {name, name.rstrip("_"), name + "_", *ALIASES.get(name, ())}
    for call in src.calls_on(line, *names):
        if style == "module":
            if isinstance(call.func, cst.Attribute):
                spots.append(Spot(call, [a.value for a in call.args if a.keyword is None], "module"))
            continue
        recv = receiver(call)
        positional = [a.value for a in call.args if a.keyword is None and not a.star]
        if recv is not None:
            spots.append(Spot(call, [recv, *positional], "method"))
        else:
            spots.append(Spot(call, positional, "function"))
    return spots


def locate(ctx, node: fx.Node | None = None, line: int | None = None) -> list[Spot]:
    """The expressions on the finding's line (or ``line``) that ran the finding's op (or ``node``'s)."""
    node = node if node is not None else ctx.node
    line = line or ctx.line
    style, name = op_names(node, ctx.finding.op)
    spots = _spots_for(ctx.src, line, style, name)
    if not spots and name != ctx.finding.op and node is ctx.node:
        spots = _spots_for(ctx.src, line, "any", ctx.finding.op)
    return spots


def _is_low(value) -> bool:
    if not isinstance(value, fx.Node):
        return False
    info = value.meta.get(AMP_KEY)
    dt = getattr(info, "dtype", None)
    return is_low(dt)


def _is_float_tensor(value) -> bool:
    if not isinstance(value, fx.Node):
        return False
    dt = getattr(value.meta.get(AMP_KEY), "dtype", None)
    return isinstance(dt, torch.dtype) and dt.is_floating_point


def low_operands(ctx, spot: Spot, node: fx.Node | None = None, *, floating: bool = False) -> list[int]:
    """Indices into ``spot.operands`` of the tensors the graph node got in fp16/bf16 (any floating dtype with
    ``floating``). Without a node: the first operand, when it is not a literal."""
    node = node if node is not None else ctx.node
    test = _is_float_tensor if floating else _is_low
    if node is not None and node.args:
        out = [i for i, a in enumerate(node.args) if i < len(spot.operands) and test(a)]
        if out or any(isinstance(a, fx.Node) for a in node.args):
            return out
    if spot.operands and not is_literal(spot.operands[0]):
        return [0]
    return []


def is_literal(expr: cst.BaseExpression) -> bool:
    if isinstance(expr, (cst.Integer, cst.Float, cst.SimpleString, cst.Imaginary)):
        return True
    if isinstance(expr, cst.UnaryOperation):
        return is_literal(expr.expression)
    return isinstance(expr, cst.Name) and expr.value in ("True", "False", "None")
