"""Normalization hazards the op tables cannot see: hand-written variance/RMS, norm buffers beyond the dtype, and
BatchNorm over small per-rank micro-batches (when check is told the batch)."""
from __future__ import annotations

from typing import Iterator

import torch
import torch.fx as fx
from torch import nn

from ampaudit.analysis.amp_prop import AMP_KEY
from ampaudit.graph_meta import module_of
from ampaudit.policy import kernel_hazard
from ampaudit.rules.registry import Hit, MatchContext, matcher

def _is_square(node) -> bool:
    if not isinstance(node, fx.Node) or AMP_KEY not in node.meta:
        return False
    op = node.meta[AMP_KEY].op
    if op == "pow":
        return len(node.args) > 1 and node.args[1] == 2
    if op == "square":
        return True
    return op == "mul" and len(node.args) == 2 and node.args[0] is node.args[1]


@matcher("handwritten_norm", fields={"kind", "compute_dtype"}, variants={"accumulates"})
def handwritten_norm(ctx: MatchContext, rule) -> Iterator[Hit]:
    for node in ctx.nodes():
        info = node.meta[AMP_KEY]
        if info.op not in ("mean", "sum") or not node.args or not _is_square(node.args[0]):
            continue
        square = node.args[0]
        sq_in = square.args[0]
        centered = isinstance(sq_in, fx.Node) and sq_in.meta.get(AMP_KEY) is not None and sq_in.meta[AMP_KEY].op == "sub"
        sq_dtype = square.meta[AMP_KEY].compute_dtype
        low = [d for d in (sq_dtype, info.compute_dtype) if ctx.is_low(d)]
        if low:
            # Squares that overflow are the hazard; the mean itself is accumulated in fp32 by the kernel.
            overflows = ctx.is_low(sq_dtype) and kernel_hazard("pow", sq_dtype) == "range"
            yield Hit(square, {"kind": "variance" if centered else "RMS", "compute_dtype": str(low[0]).replace("torch.", "")},
                      variant=None if overflows else "accumulates")


@matcher("norm_buffers", fields={"buffer", "value", "dtype", "max"})
def norm_buffers(ctx: MatchContext, rule) -> Iterator[Hit]:
    limit = ctx.policy.limits.max
    where: dict[str, fx.Node] = {}
    for n in ctx.gm.graph.nodes:  # the first node each module's own code ran, for a source line
        key = str(n.target) if n.op == "call_module" else module_of(n, None)
        if key is not None:
            where.setdefault(key, n)

    for name, m in ctx.root.named_modules():
        if not isinstance(m, (nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm)):
            continue
        for bname in ("running_var", "running_mean"):
            buf = getattr(m, bname, None)
            if not isinstance(buf, torch.Tensor) or buf.is_meta or buf.numel() == 0:
                continue  # a meta model has no values to read; the audit never needs them
            value = float(buf.detach().abs().max())
            if value > limit:
                node = where.get(name)
                path = module_of(node, name) if node is not None else name
                yield Hit(node, {"buffer": f"{path or type(m).__name__}.{bname}", "value": value,
                                 "dtype": str(ctx.policy.low).replace("torch.", ""), "max": limit},
                          module=path, op="batch_norm")


@matcher("small_batch_norm", fields={"batch", "min_batch"})
def small_batch_norm(ctx: MatchContext, rule) -> Iterator[Hit]:
    """BatchNorm (not SyncBatchNorm) in a model told to train with per-rank micro-batches below the threshold."""
    if ctx.batch is None:
        return
    from ampaudit.batch_norms import min_micro_batch, per_rank_batchnorms  # the trainer warns from the same test

    limit = min_micro_batch()
    if ctx.batch >= limit:
        return
    where: dict[str, fx.Node] = {str(n.target): n for n in ctx.gm.graph.nodes if n.op == "call_module"}
    for name in per_rank_batchnorms(ctx.root):
        yield Hit(where.get(name), {"batch": ctx.batch, "min_batch": limit}, module=name, op="batch_norm")
