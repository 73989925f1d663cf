"""The multiply-accumulates of each GEMM node, from the propagated shapes: how much a misaligned GEMM weighs.

    share = gemm_share(gm, root, node)      # this node's share of the graph's GEMM work, 0.0 .. 1.0
    macs = gemm_macs(node, root)            # forward multiply-accumulates (None: not a GEMM, or shapes unknown)

Forward work only: dgrad and wgrad have the same M*N*K as the forward, so shares are the same for training.
Reads ``node.meta["amp"]`` (shapes) and the module that owns the node; writes nothing.
"""
from __future__ import annotations

import math
import weakref

import torch.fx as fx
from torch import nn

from ampaudit.analysis.amp_prop import AMP_KEY
from ampaudit.graph_meta import owner

_TOTALS: "weakref.WeakKeyDictionary[fx.GraphModule, float]" = weakref.WeakKeyDictionary()
_MATMULS = ("matmul", "bmm", "mm", "baddbmm", "addmm", "addbmm")


def gemm_macs(node: fx.Node, root: nn.Module) -> float | None:
    """Forward multiply-accumulates of ``node`` if it is a GEMM-bearing op with known shapes, else None."""
    info = node.meta.get(AMP_KEY)
    if info is None or info.shape is None:
        return None
    op, ins = info.op, [s for s in info.input_shapes if s is not None]
    out = info.shape
    m = owner(node, root)
    if isinstance(m, nn.Linear) and op in ("linear", *_MATMULS):
        return math.prod(out[:-1]) * m.in_features * m.out_features
    if op == "linear" and len(ins) >= 2 and len(ins[1]) == 2:
        return math.prod(ins[0][:-1]) * ins[1][0] * ins[1][1]
    if op.startswith(("conv", "convolution")) and ins:
        if isinstance(m, nn.modules.conv._ConvNd):
            per_out = (m.in_channels // m.groups) * math.prod(m.kernel_size)
        elif len(ins) >= 2 and len(ins[1]) >= 3:
            per_out = math.prod(ins[1][1:])
        else:
            return None
        return math.prod(out) * per_out
    if op == "scaled_dot_product_attention" and len(ins) >= 3:
        q, k, v = ins[:3]
        return math.prod(q[:-1]) * k[-2] * (q[-1] + v[-1])
    if op in _MATMULS:
        pair = ins[1:3] if op in ("baddbmm", "addmm", "addbmm") else ins[:2]
        if len(pair) == 2 and len(pair[0]) >= 1 and len(pair[1]) >= 1:
            k = pair[0][-1]
            return math.prod(out) * k
    if op == "einsum" and len(ins) == 2 and node.args and isinstance(node.args[0], str):
        eq = node.args[0].replace(" ", "")
        if "->" in eq and "." not in eq:
            terms = eq.split("->")[0].split(",")
            sizes = {c: d for t, s in zip(terms, ins) if len(t) == len(s) for c, d in zip(t, s)}
            return float(math.prod(sizes.values()))
    if isinstance(m, nn.RNNBase) and ins:
        gates = {"LSTM": 4, "GRU": 3}.get(type(m).__name__, 1)
        steps = math.prod(ins[0][:-1])
        return steps * gates * m.hidden_size * (m.input_size + m.hidden_size) * m.num_layers
    return None


def total_macs(gm: fx.GraphModule, root: nn.Module) -> float:
    """All GEMM work of the graph (cached per graph)."""
    total = _TOTALS.get(gm)
    if total is None:
        total = _TOTALS[gm] = sum(gemm_macs(n, root) or 0.0 for n in gm.graph.nodes
                                  if n.op in ("call_module", "call_function", "call_method"))
    return total


def gemm_share(gm: fx.GraphModule, root: nn.Module, node: fx.Node) -> float | None:
    """``node``'s share of the graph's GEMM work, or None when it is unknown."""
    macs = gemm_macs(node, root)
    total = total_macs(gm, root)
    return macs / total if macs is not None and total > 0 else None
