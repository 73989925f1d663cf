"""Precision-sensitive ops (softmax, exp/log/pow, reductions, norms, losses) that would compute in reduced precision.

Severity follows the policy and the kernel: an op the target's autocast leaves in fp16/bf16 gets the rule's
severity when its result can really overflow or lose its input's precision there, and the rule's ``accumulates``
variant (info) when the kernel accumulates in fp32 and only the stored result is low (rules/policy/kernels.toml);
a sum of fewer than the rule's ``min_depth`` terms (its ``depth_ops``) is the ``short`` variant, and a norm of the
rule's ``half_params_ops`` whose own parameters are half the ``half_params`` variant;
an op autocast upcasts to fp32 gets ``upcast_severity`` (info: safe, at the cost of a cast), or nothing when that
is "off".
"""
from __future__ import annotations

import math
from typing import Iterator

import torch.fx as fx
from torch import nn

from ampaudit.analysis.amp_prop import AMP_KEY
from ampaudit.dtypes import name_of
from ampaudit.policy import kernel_hazard
from ampaudit.rules.registry import OPS, Hit, MatchContext, matcher

FIELDS = {"compute_dtype", "depth", "policy_note", "overflow_note", "per_term"}
PARAMS = {"ops": OPS, "upcast_severity": ("info", "warning", "error", "off"), "depth_ops": OPS, "min_depth": int,
          "half_params_ops": OPS}


def _dim_arg(node: fx.Node):
    if "dim" in node.kwargs:
        return node.kwargs["dim"]
    # softmax(x, dim), sum(x, dim), cumsum(x, dim): dim is the second positional argument when given.
    if len(node.args) > 1 and isinstance(node.args[1], (int, tuple, list)):
        return node.args[1]
    return None


def reduction_depth(ctx: MatchContext, node: fx.Node) -> int | None:
    """How many elements each output of a reduction (or norm) combines, from the input shape."""
    info = node.meta[AMP_KEY]
    shape = info.input_shapes[0] if info.input_shapes else None
    if shape is None:
        return None
    numel = math.prod(shape) if shape else 1
    if node.op == "call_module":
        m = ctx.owner(node)
        if isinstance(m, nn.LayerNorm) or hasattr(m, "normalized_shape"):
            return math.prod(m.normalized_shape)
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            return numel // shape[1] if len(shape) > 1 else numel
        if isinstance(m, nn.GroupNorm):
            return numel // (shape[0] * m.num_groups) if shape else None
        if isinstance(m, (nn.Softmax, nn.LogSoftmax)) and m.dim is not None:
            return shape[m.dim]
        return shape[-1] if shape else 1
    if info.op == "layer_norm" and len(node.args) > 1 and isinstance(node.args[1], (list, tuple)):
        return math.prod(node.args[1])
    if info.op == "group_norm" and len(node.args) > 1 and isinstance(node.args[1], int) and shape:
        return numel // (shape[0] * node.args[1])
    if info.op in ("batch_norm", "instance_norm") and len(shape) > 1:
        return numel // shape[1]
    dim = _dim_arg(node)
    if dim is None:
        if info.op in ("softmax", "log_softmax", "cumsum", "cumprod"):
            return shape[-1] if shape else 1
        return numel
    dims = dim if isinstance(dim, (tuple, list)) else (dim,)
    try:
        return math.prod(shape[d] for d in dims) if shape else 1
    except (IndexError, TypeError):
        return None


def _overflow_note(ctx: MatchContext, node: fx.Node) -> str:
    info = node.meta[AMP_KEY]
    big = ctx.policy.limits.max
    if info.op == "exp":
        return f"; exp overflows for inputs above {math.log(big):.3g}"
    if info.op == "pow" and len(node.args) > 1 and isinstance(node.args[1], (int, float)) and node.args[1] > 1:
        return f"; x**{node.args[1]:g} overflows for |x| above {big ** (1.0 / node.args[1]):.3g}"
    return ""


@matcher("reduced_precision_op", fields=FIELDS, params=PARAMS, nullable={"depth", "per_term"},
         variants={"accumulates", "short", "half_params", "upcast"}, required={"ops"})
def reduced_precision_op(ctx: MatchContext, rule) -> Iterator[Hit]:
    """Listed ops whose arithmetic the target leaves in fp16/bf16, named by what the kernel then really risks
    (rules/policy/kernels.toml): the rule's own severity for a range or conditioning hazard, its variants
    ``accumulates`` (the kernel accumulates in fp32; only the stored result is low), ``short`` (a sum over too
    few terms to pass the dtype's max from ordinary values), ``half_params`` (a norm whose parameters and
    statistics are themselves half) and ``upcast`` (autocast runs it in fp32)."""
    ops = set(rule.param("ops", []))
    upcast_sev = rule.param("upcast_severity", "info")
    for node in ctx.nodes():
        info = node.meta[AMP_KEY]
        if info.op not in ops:
            continue
        low_inputs = any(ctx.is_low(d) for d in info.input_dtypes if d is not None)
        depth = reduction_depth(ctx, node)
        details = {"compute_dtype": name_of(info.compute_dtype), "depth": depth,
                   "overflow_note": _overflow_note(ctx, node), "policy_note": "",
                   "per_term": f"{ctx.policy.limits.max / depth:.3g}" if depth else None}
        if ctx.is_low(info.compute_dtype):
            if info.category is None and ctx.policy.device == "cpu" and ctx.policy.table and _upcast_on_cuda(info.op):
                details["policy_note"] = " (CPU autocast leaves it there; CUDA autocast would upcast it)"
            yield Hit(node, details, variant=_variant(ctx, rule, node, info, depth))
        elif info.category in ("fp32", "fp32_output") and low_inputs and upcast_sev != "off":
            details["policy_note"] = f" ({ctx.policy.device.upper()} autocast upcasts it from {name_of(ctx.policy.low)}: safe, one cast)"
            yield Hit(node, details, severity=upcast_sev, variant="upcast")


def _variant(ctx: MatchContext, rule, node: fx.Node, info, depth: int | None) -> str | None:
    if info.op in rule.param("half_params_ops", ()) and _half_params(ctx, node):
        return "half_params"
    hazard = kernel_hazard(info.op, info.compute_dtype)
    if hazard == "storage" or (info.op == "exp" and _shifted_by_its_max(node)):
        return "accumulates"
    if hazard == "range" and info.op in rule.param("depth_ops", ()) and depth is not None \
            and depth < rule.param("min_depth", 0):
        return "short"
    return None


def _op_of(node) -> str | None:
    info = node.meta.get(AMP_KEY) if isinstance(node, fx.Node) else None
    return info.op if info is not None else None


def _shifted_by_its_max(node: fx.Node) -> bool:
    """``exp(x - x.amax(dim))`` (or ``x.max(dim).values``, ``x.max()``): the softmax shift, an input at most 0,
    so the result is at most 1 and cannot overflow."""
    arg = node.args[0] if node.args else None
    if _op_of(arg) != "sub" or len(arg.args) < 2:
        return False
    x, top = arg.args[0], arg.args[1]
    if _op_of(top) == "getitem" and len(top.args) > 1 and top.args[1] == 0:
        top = top.args[0]                           # max(x, dim) gives (values, indices)
    return _op_of(top) in ("amax", "max") and bool(top.args) and top.args[0] is x


def _half_params(ctx: MatchContext, node: fx.Node) -> bool:
    """True when the module running ``node`` holds its own weights or statistics in a 16-bit float."""
    owner = ctx.owner(node)
    if owner is None:
        return False
    own = [*owner.parameters(recurse=False), *owner.buffers(recurse=False)]
    return any(t.is_floating_point() and ctx.is_low(t.dtype) for t in own)


def _upcast_on_cuda(op: str) -> bool:
    from ampaudit.policy import Policy

    return Policy.load("cuda", "float16").category(op) in ("fp32", "fp32_output")



@matcher("banned_op", fields=set())
def banned_op(ctx: MatchContext, rule) -> Iterator[Hit]:
    for node in ctx.nodes():
        info = node.meta[AMP_KEY]
        if info.category == "banned":
            yield Hit(node, {})


@matcher("mixed_dtypes_raise", fields={"dtypes", "error", "promote_note"})
def mixed_dtypes_raise(ctx: MatchContext, rule) -> Iterator[Hit]:
    """Ops whose kernel raises on the mixed dtypes the target's autocast hands it (AmpProp ran it to see)."""
    from ampaudit.policy import Policy

    for node in ctx.nodes():
        info = node.meta[AMP_KEY]
        if not info.raises:
            continue
        note = ""
        if ctx.policy.device == "cpu" and ctx.policy.table and \
                Policy.load("cuda", "float16").category(info.op) == "promote":
            note = "; CUDA autocast would promote them to one dtype, CPU autocast does not"
        yield Hit(node, {"dtypes": " and ".join(name_of(d) for d in info.raises_dtypes), "error": info.raises,
                         "promote_note": note})
