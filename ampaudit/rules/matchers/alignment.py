"""Tensor Core alignment: GEMM dims of Linear, Conv, Embedding, matmul/bmm/SDPA and RNNs off the policy's multiple.

GEMM naming follows NVIDIA's guide: for y = x W^T with W [out, in], forward M=out N=tokens K=in, dgrad M=in N=tokens
K=out, wgrad M=in N=out K=tokens.
"""
from __future__ import annotations

import math
from typing import Iterator

import torch.fx as fx
from torch import nn

from ampaudit.analysis.amp_prop import AMP_KEY
from ampaudit.analysis.gemm_cost import gemm_share
from ampaudit.policy import round_up
from ampaudit.rules.registry import Hit, MatchContext, matcher

FIELDS = {"kind", "shape", "dim", "value", "multiple", "padded", "gemms", "share"}
# min_share: a GEMM under this share of the model's GEMM work is the rule's "small" variant.
PARAMS = {"min_share": float}

_LINEAR_OPS = ("linear", "addmm", "mm", "matmul")
_LINEAR_GEMMS = {"in_features": "forward K, dgrad M, wgrad M", "out_features": "forward M, dgrad K, wgrad N"}


def _runs_low(ctx: MatchContext, node: fx.Node) -> bool:
    return ctx.is_low(node.meta[AMP_KEY].compute_dtype)


def _hits(node: fx.Node, kind: str, shape: str, dims: list[tuple[str, int, str]], multiple: int,
          ctx: MatchContext | None = None, rule=None) -> Iterator[Hit]:
    """One hit per dim off the multiple. With ``ctx`` and a rule ``min_share``, the hit is the rule's ``small``
    variant (info) when this GEMM is under that share of the model's GEMM work: cuBLAS and cuDNN still use
    Tensor Cores for it (padding or a less efficient tile), and what that costs is a share of a small share."""
    off = [(dim, value, gemms) for dim, value, gemms in dims if value > 1 and value % multiple]
    if not off:
        return           # aligned: no need to weigh the GEMM (most nodes of most models)
    share = gemm_share(ctx.gm, ctx.root, node) if ctx is not None else None
    small = share is not None and rule is not None and share < float(rule.param("min_share", 0.0))
    for dim, value, gemms in off:
        yield Hit(node, {"kind": kind, "shape": shape, "dim": dim, "value": value, "multiple": multiple,
                         "padded": round_up(value, multiple), "gemms": gemms,
                         "share": f"{share:.1%}" if share is not None else None},
                  variant="small" if small else None)


@matcher("linear_dims", fields=FIELDS, params=PARAMS, variants={"small"}, nullable={"share"})
def linear_dims(ctx: MatchContext, rule) -> Iterator[Hit]:
    for node in ctx.nodes():
        info = node.meta[AMP_KEY]
        if info.op not in _LINEAR_OPS or not _runs_low(ctx, node):
            continue
        m = ctx.owner(node)
        if isinstance(m, nn.Linear):  # nn.Linear, whether captured as a module, aten.linear or t + addmm
            fin, fout = m.in_features, m.out_features
        elif info.op != "linear":
            continue
        else:  # F.linear(x, weight): weight is the second input
            wshape = _shape(node.args[1] if len(node.args) > 1 else node.kwargs.get("weight"))
            if not wshape or len(wshape) != 2:
                continue
            fout, fin = wshape
        if fin is None or fout is None:
            continue
        yield from _hits(node, "Linear", f"{fin}->{fout}",
                         [("in_features", fin, _LINEAR_GEMMS["in_features"]),
                          ("out_features", fout, _LINEAR_GEMMS["out_features"])], ctx.policy.alignment, ctx, rule)


@matcher("conv_channels", fields=FIELDS, params=PARAMS, variants={"small", "image_input"}, nullable={"share"})
def conv_channels(ctx: MatchContext, rule) -> Iterator[Hit]:
    for node in ctx.nodes():
        info = node.meta[AMP_KEY]
        if not info.op.startswith(("conv", "convolution")) or not _runs_low(ctx, node):
            continue
        m = ctx.owner(node)
        if isinstance(m, nn.modules.conv._ConvNd):
            kind, groups, cin, cout, kernel = (type(m).__name__, m.groups, m.in_channels, m.out_channels,
                                               tuple(m.kernel_size))
        else:  # F.conv2d(x, weight, bias, stride, padding, dilation, groups): read the weight's shape
            w = node.args[1] if len(node.args) > 1 else node.kwargs.get("weight")
            wshape = _shape(w)
            if not wshape or len(wshape) < 3 or info.op.startswith("conv_transpose"):
                continue
            gpos = 8 if info.op == "convolution" else 6  # aten.convolution has transposed/output_padding first
            groups = node.args[gpos] if len(node.args) > gpos else node.kwargs.get("groups", 1)
            kind, cout, cin, kernel = info.op, wshape[0], wshape[1] * groups, tuple(wshape[2:])
        if groups > 1 and groups == cin:
            continue  # depthwise: not a GEMM, alignment does not apply
        k = "x".join(map(str, kernel))
        for hit in _hits(node, kind, f"{cin}->{cout} k{k}",
                         [("in_channels", cin // groups, "implicit-GEMM K"),
                          ("out_channels", cout // groups, "implicit-GEMM M")], ctx.policy.alignment, ctx, rule):
            if hit.details["dim"] == "in_channels" and _reads_model_input(node):
                hit.variant = "image_input"     # 3 RGB channels: what every vision model starts from
            yield hit


def _reads_model_input(node: fx.Node) -> bool:
    """True when the op's input is a forward argument (through views and casts only): the image itself."""
    x = node.args[0] if node.args else None
    for _ in range(4):
        if not isinstance(x, fx.Node):
            return False
        if x.op == "placeholder":
            return True
        if x.op not in ("call_method", "call_function") or not x.args:
            return False
        x = x.args[0]
    return False


def _shape(value) -> tuple | None:
    return getattr(value.meta.get(AMP_KEY), "shape", None) if isinstance(value, fx.Node) else None


def _is_lookup(node: fx.Node) -> bool:
    return node.meta[AMP_KEY].op in ("embedding", "embedding_bag", "_embedding_bag")


def _owned(ctx: MatchContext, keep, types: tuple[type, ...]) -> Iterator[tuple[fx.Node, nn.Module]]:
    """(node, the module that owns it) for the nodes ``keep`` accepts whose owner is one of ``types``."""
    for node in ctx.nodes():
        if keep(node):
            m = ctx.owner(node)
            if isinstance(m, types):
                yield node, m


@matcher("embedding_dims", fields=FIELDS, nullable={"share"})
def embedding_dims(ctx: MatchContext, rule) -> Iterator[Hit]:
    for node, m in _owned(ctx, _is_lookup, (nn.Embedding, nn.EmbeddingBag)):
        yield from _hits(node, type(m).__name__, f"{m.num_embeddings}x{m.embedding_dim}",
                         [("num_embeddings", m.num_embeddings, "output-projection N (vocabulary)"),
                          ("embedding_dim", m.embedding_dim, "K of the GEMMs that read it")], ctx.policy.alignment)


def _last2(shape) -> tuple[int, int] | None:
    if shape is None or len(shape) < 2:
        return None
    return shape[-2], shape[-1]


_MATMUL_OPS = ("matmul", "bmm", "mm", "baddbmm", "addmm", "addbmm", "scaled_dot_product_attention", "einsum")


def _einsum_hits(ctx: MatchContext, node: fx.Node, rule) -> Iterator[Hit]:
    """einsum("bik,bkj->bij", a, b): K is the contracted index, M and N the free indices of each operand."""
    info = node.meta[AMP_KEY]
    eq = node.args[0] if node.args and isinstance(node.args[0], str) else None
    if eq is None or "->" not in eq or "." in eq:
        return
    lhs, out = eq.replace(" ", "").split("->")
    terms = lhs.split(",")
    shapes = [s for s in info.input_shapes if s is not None]
    if len(terms) != 2 or len(shapes) != 2 or any(len(t) != len(s) for t, s in zip(terms, shapes)):
        return
    size = {c: d for t, s in zip(terms, shapes) for c, d in zip(t, s)}
    a, b = terms
    roles = [("K", c) for c in a if c in b and c not in out] + [("M", c) for c in a if c not in b and c in out] \
        + [("N", c) for c in b if c not in a and c in out]
    dims = [(f"{role} ({c})", size[c], role) for role, c in roles]
    yield from _hits(node, "einsum", f"'{eq}' {tuple(shapes[0])}, {tuple(shapes[1])}", dims, ctx.policy.alignment,
                     ctx, rule)


@matcher("matmul_dims", fields=FIELDS, params=PARAMS, variants={"small"}, nullable={"share"})
def matmul_dims(ctx: MatchContext, rule) -> Iterator[Hit]:
    for node in ctx.nodes():
        info = node.meta[AMP_KEY]
        if info.op not in _MATMUL_OPS or not _runs_low(ctx, node) or isinstance(ctx.owner(node), nn.Linear):
            continue  # a Linear's own GEMM is reported once, by linear_dims
        if info.op == "einsum":
            yield from _einsum_hits(ctx, node, rule)
            continue
        shapes = info.input_shapes
        if info.op in ("baddbmm", "addmm", "addbmm"):
            shapes = shapes[1:]
        if len(shapes) < 2:
            continue
        a, b = _last2(shapes[0]), _last2(shapes[1])
        if a is None or b is None:
            continue
        if info.op == "scaled_dot_product_attention":
            (lq, e), (s, _) = a, b
            dims = [("head_dim", e, "QK^T K, PV N"), ("query length", lq, "QK^T M"), ("key length", s, "QK^T N, PV K")]
            kind = "scaled_dot_product_attention"
        else:
            (m_, k), (_, n_) = a, b
            dims = [("M", m_, "M"), ("K", k, "K"), ("N", n_, "N")]
            kind = info.op
        shape = f"{tuple(shapes[0])} @ {tuple(shapes[1])}"
        yield from _hits(node, kind, shape, dims, ctx.policy.alignment, ctx, rule)


@matcher("rnn_dims", fields=FIELDS, params=PARAMS, variants={"small"}, nullable={"share"})
def rnn_dims(ctx: MatchContext, rule) -> Iterator[Hit]:
    for node, m in _owned(ctx, lambda node: _runs_low(ctx, node), (nn.RNNBase, nn.RNNCellBase)):
        yield from _hits(node, type(m).__name__, f"input {m.input_size}, hidden {m.hidden_size}",
                         [("input_size", m.input_size, "input GEMM K"),
                          ("hidden_size", m.hidden_size, "recurrent GEMM K and gate M")], ctx.policy.alignment,
                         ctx, rule)


@matcher("gemm_tokens", fields=FIELDS, nullable={"share"})
def gemm_tokens(ctx: MatchContext, rule) -> Iterator[Hit]:
    """The rows fed to Linear GEMMs, once per distinct value: it is a property of the batch, not of a layer."""
    seen: set[int] = set()
    for node in ctx.nodes():
        info = node.meta[AMP_KEY]
        if info.op not in _LINEAR_OPS or not _runs_low(ctx, node) or not isinstance(ctx.owner(node), nn.Linear):
            continue
        shape = info.input_shapes[0] if info.input_shapes else None
        if not shape or len(shape) < 2:
            continue
        rows = math.prod(shape[:-1])
        if rows in seen:
            continue
        seen.add(rows)
        for hit in _hits(node, "Linear", "x".join(map(str, shape[:-1])), [("N", rows, "forward N, wgrad K")],
                         ctx.policy.alignment):
            yield hit
