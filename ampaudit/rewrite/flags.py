"""Which graph nodes must compute in fp32: from findings to flagged nodes, writing no meta.

    flags = flag_nodes(audit.capture.gm, audit.report.findings)     # {node: [rule ids]}

A finding with a ``node`` flags that node. A measured finding (``check --calibrate``: range / nonfinite /
divergence) names a module: every node whose module (``MODULE_KEY``) is that module or below it is flagged
(for the top module, only its own ops: "and below" would be the whole model). A constant finding also flags the
ops that carry the constant to the op that would turn its -inf into NaN (the additive mask's add, the softmax),
so the constant never exists in the low dtype.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.fx as fx

from ampaudit.analysis.amp_prop import AMP_KEY
from ampaudit.graph_meta import module_of
from ampaudit.findings import SEVERITY_RANK, Finding
from ampaudit.rewrite.op_sets import INPLACE_OPERATORS, MASK_CARRIERS, MASK_CONSUMERS, RANDOM, RANDOM_MODULES

# How far the constant walk follows a mask before giving up (a mask reaches its softmax in a few ops).
MASK_WALK_LIMIT = 8


def op_of(node: fx.Node) -> str | None:
    info = node.meta.get(AMP_KEY)
    return getattr(info, "op", None)


def raw_name(node: fx.Node) -> str:
    """The target's own name: ``add_`` for ``x.add_(1)``, ``iadd`` for ``x += 1`` (canonical names drop this)."""
    if node.op == "call_method":
        return str(node.target)
    if node.op == "call_function":
        return getattr(node.target, "__name__", str(node.target))
    return node.op


def is_tensor_node(node: fx.Node) -> bool:
    """True when the node's value (fp32 run) is a tensor; unknown shapes count when a dtype was tracked."""
    info = node.meta.get(AMP_KEY)
    if info is None:
        return False
    if isinstance(info.value, torch.Tensor):
        return True
    return info.value is None and isinstance(info.dtype, torch.dtype)


def holds_tensors(node: fx.Node) -> bool:
    """True for tuple/list values of tensors (``chunk``, ``split``, an LSTM's output)."""
    value = getattr(node.meta.get(AMP_KEY), "value", None)
    return isinstance(value, (tuple, list)) and any(isinstance(v, torch.Tensor) for v in value)


def is_inplace(node: fx.Node) -> bool:
    name = raw_name(node)
    if node.op == "call_function" and name in INPLACE_OPERATORS:
        return True
    return node.op in ("call_method", "call_function") and name.endswith("_") and not name.startswith("_")


def is_effectful(node: fx.Node, root: torch.nn.Module) -> bool:
    """Nodes whose place in program order matters beyond data edges: in-place writes, random draws, impure calls."""
    if node.op in ("placeholder", "output", "get_attr"):
        return False
    if node.op == "call_module":
        try:
            return type(root.get_submodule(node.target)).__name__ in RANDOM_MODULES
        except AttributeError:
            return False
    if is_inplace(node) or raw_name(node) in RANDOM or (op_of(node) or "") in RANDOM:
        return True
    try:
        return node.is_impure()
    except Exception:  # an fx version without is_impure for this target
        return False


def _in_module(path: str, module: str) -> bool:
    # The top module ("") flags only its own ops: "and below" would put the whole model in fp32.
    return path == module or (module != "" and path.startswith(module + "."))


def island_findings(findings: Iterable[Finding], min_severity: str = "warning") -> list[Finding]:
    """The findings an island fixes (their rule's autofix kind is "island"), at or above ``min_severity``."""
    floor = SEVERITY_RANK[min_severity]
    return [f for f in findings if f.autofix.get("kind") == "island" and SEVERITY_RANK.get(f.severity, 0) >= floor]


def flag_nodes(gm: fx.GraphModule, findings: Sequence[Finding], *, root: torch.nn.Module | None = None,
               min_severity: str = "warning") -> dict[fx.Node, list[str]]:
    """Map each node that must run in fp32 to the rule ids that put it there (graph order)."""
    root = root if root is not None else gm
    by_name = {n.name: n for n in gm.graph.nodes}
    flags: dict[fx.Node, list[str]] = {}

    def flag(node: fx.Node, rule: str) -> None:
        if node.op not in ("call_module", "call_function", "call_method"):
            return
        if not (is_tensor_node(node) or holds_tensors(node)):
            return
        if is_effectful(node, root):
            return  # an in-place write on an upcast copy would be lost; random ops keep their place
        rules = flags.setdefault(node, [])
        if rule not in rules:
            rules.append(rule)

    for f in island_findings(findings, min_severity):
        if f.node is None:            # a measured finding names a module, not a node
            for n in gm.graph.nodes:
                if _in_module(module_of(n), f.module):
                    flag(n, f.rule)
            continue
        node = by_name.get(f.node)
        if node is None:
            continue
        flag(node, f.rule)
        for name in f.fix_nodes:       # what the hazard really comes from (a cumsum a subtraction reads)
            if name in by_name:
                flag(by_name[name], f.rule)
        if f.family == "constant":
            for n in _mask_path(node):
                flag(n, f.rule)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    return dict(sorted(flags.items(), key=lambda kv: order[kv[0]]))


def _mask_path(start: fx.Node) -> list[fx.Node]:
    """Nodes from ``start`` forward through mask carriers up to and including the first mask consumer.

    Empty when no consumer is reached within MASK_WALK_LIMIT steps: then only the constant's own op is fixed.
    """
    path: list[fx.Node] = []
    seen = {start}
    frontier = [start]
    for _ in range(MASK_WALK_LIMIT):
        nxt = []
        for n in frontier:
            for u in n.users:
                if u in seen or not is_tensor_node(u):
                    continue
                seen.add(u)
                op = op_of(u) or ""
                if op in MASK_CONSUMERS:
                    path.append(u)
                elif op in MASK_CARRIERS:
                    path.append(u)
                    nxt.append(u)
        frontier = nxt
        if not frontier:
            break
    # Keep only carriers that lead to a consumer (a carrier going elsewhere is not part of the mask's path).
    keep = {n for n in path if (op_of(n) or "") in MASK_CONSUMERS}
    changed = True
    while changed:
        changed = False
        for n in path:
            if n not in keep and any(u in keep for u in n.users):
                keep.add(n)
                changed = True
    return [n for n in path if n in keep]
