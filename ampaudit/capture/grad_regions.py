"""Regions of an exported graph that run under ``torch.no_grad()`` (or ``enable_grad``), spliced back inline.

    count = inline_grad_regions(gm)     # how many ``wrap_with_set_grad_enabled`` calls were replaced by their ops

torch.export (strict=False, the training IR) keeps a ``with torch.no_grad():`` block of the forward as one call
of the higher-order op ``wrap_with_set_grad_enabled(False, submodule, *inputs)``: a sparse-attention indexer's
scores and top-k (DeepSeek-V3.2, GLM-DSA), a model's own statistics. As one call the audit sees none of its ops,
and its body, rerun as a whole on the audit's fake tensors, asserts the dtypes the export baked in; where that
fails, every op downstream loses its shape too. Whether autograd records a region changes no dtype autocast
gives its ops, so the body's nodes (the region's own ``nn_module_stack`` and source lines kept) take the call's
place; the export checks they carry are erased with the graph's own.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx


def _hop():
    return getattr(torch.ops.higher_order, "wrap_with_set_grad_enabled", None)


def _body(gm: fx.GraphModule, node: fx.Node) -> fx.GraphModule | None:
    """The region's submodule, its own regions inlined first; None where its body reads attributes of its own."""
    ref = node.args[1] if len(node.args) > 1 else None
    if not isinstance(ref, fx.Node) or ref.op != "get_attr":
        return None
    body = getattr(gm, str(ref.target), None)
    if not isinstance(body, fx.GraphModule):
        return None
    inline_grad_regions(body)
    if any(n.op == "get_attr" for n in body.graph.nodes):
        return None
    return body


def _splice(gm: fx.GraphModule, node: fx.Node, body: fx.GraphModule) -> bool:
    placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
    inputs = list(node.args[2:])
    if len(placeholders) != len(inputs) or node.kwargs:
        return False
    users = list(node.users)
    if any(u.op != "call_function" or u.target is not operator.getitem for u in users):
        return False
    with gm.graph.inserting_before(node):
        out = gm.graph.graph_copy(body.graph, dict(zip(placeholders, inputs)))
    outs = out if isinstance(out, (tuple, list)) else (out,)
    for user in users:
        user.replace_all_uses_with(outs[user.args[1]])
        gm.graph.erase_node(user)
    ref = node.args[1]
    gm.graph.erase_node(node)
    if not ref.users:
        gm.graph.erase_node(ref)
    return True


def inline_grad_regions(gm: fx.GraphModule) -> int:
    """Replace each ``wrap_with_set_grad_enabled`` call in ``gm`` by its body's ops; how many were replaced."""
    hop = _hop()
    if hop is None:   # pragma: no cover - a torch without the op keeps such regions inline already
        return 0
    count = 0
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is hop:
            body = _body(gm, node)
            if body is not None and _splice(gm, node, body):
                count += 1
    if count:
        gm.graph.lint()
        gm.recompile()
    return count
