"""FP32 islands: merge flagged nodes, and the cheap elementwise and view nodes between them, into convex groups.

    islands = find_islands(gm, flags, root=model)     # [Island(nodes=[...], rules=[...], modules=[...])]

The graph is a networkx DiGraph of data edges. A cheap node (``op_sets.CHEAP``) joins when it lies on a path of
cheap nodes from one flagged node to another: then both flagged nodes and everything between them run in one
fp32 region with one set of casts. Merging is cycle-safe as torch.fx's ``CapabilityBasedPartitioner`` is: two
groups merge only when no path leaves the merged group and comes back into it (the group stays *convex*), so
every island can be made contiguous in program order and the graph of islands stays acyclic.

Nodes whose place in program order matters (in-place writes, random draws: ``flags.is_effectful``) are barriers:
extra edges tie them to every candidate before and after them, so no island spans one and nothing is moved
across one when islands are made contiguous.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import networkx as nx
import torch
import torch.fx as fx

from ampaudit.analysis.amp_prop import AMP_KEY
from ampaudit.graph_meta import module_of
from ampaudit.rewrite.flags import holds_tensors, is_effectful, is_tensor_node, op_of
from ampaudit.rewrite.op_sets import CHEAP


@dataclass
class Island:
    """One fp32 region: its nodes in program order, the flagged ones among them, and why."""

    nodes: list[fx.Node]
    flagged: list[fx.Node]
    rules: list[str] = field(default_factory=list)

    @property
    def modules(self) -> list[str]:
        seen: list[str] = []
        for n in self.flagged:
            m = module_of(n)
            if m not in seen:
                seen.append(m)
        return seen

    @property
    def ops(self) -> list[str]:
        return [op_of(n) or n.name for n in self.nodes]

    def describe(self) -> str:
        where = ", ".join(m or "<top module>" for m in self.modules)
        return f"{where}: {' -> '.join(self.ops)} ({', '.join(self.rules)})"


def is_cheap(node: fx.Node) -> bool:
    """Elementwise or view op on tensors. ``chunk(...)[0]`` is not: its input is a tuple no cast can upcast,
    so the island boundary must sit after it."""
    if node.op not in ("call_function", "call_method"):
        return False
    if is_scalar_node(node):
        return True  # x.shape, x.dtype, size arithmetic: free, and keeping them in avoids false cycles
    if (op_of(node) or "") not in CHEAP:
        return False
    return is_tensor_node(node) and not any(holds_tensors(u) for u in node.all_input_nodes)


def is_scalar_node(node: fx.Node) -> bool:
    """A node computing a Python value (shape, dtype, int) rather than a tensor."""
    return AMP_KEY in node.meta and node.meta[AMP_KEY].value is not None and not is_tensor_node(node) \
        and not holds_tensors(node)


def data_graph(gm: fx.GraphModule) -> nx.DiGraph:
    """Data-dependence DiGraph of the fx graph; every edge goes forward in program order."""
    g = nx.DiGraph()
    for i, n in enumerate(gm.graph.nodes):
        g.add_node(n, index=i)
        for u in n.all_input_nodes:
            g.add_edge(u, n)
    return g


def _between(flagged: set[fx.Node], cheap: set[fx.Node]) -> set[fx.Node]:
    """Cheap nodes reachable from a flagged node through cheap nodes, and reaching one the same way."""
    def reach(step) -> set[fx.Node]:
        seen: set[fx.Node] = set()
        stack = list(flagged)
        while stack:
            for m in step(stack.pop()):
                if m in cheap and m not in seen:
                    seen.add(m)
                    stack.append(m)
        return seen

    return reach(lambda n: n.users) & reach(lambda n: n.all_input_nodes)


class _Groups:
    """Union-find over candidate nodes with a convexity check on every merge."""

    def __init__(self, g: nx.DiGraph, members: set[fx.Node]):
        self.g = g
        self.index = {n: g.nodes[n]["index"] for n in g.nodes}
        self.parent = {n: n for n in members}
        self.sets = {n: {n} for n in members}

    def find(self, n: fx.Node) -> fx.Node:
        while self.parent[n] is not n:
            self.parent[n] = self.parent[self.parent[n]]
            n = self.parent[n]
        return n

    def convex(self, group: set[fx.Node]) -> bool:
        """No path from the group back into it through a node outside it (edges go forward, so stop at its end)."""
        end = max(self.index[n] for n in group)
        stack = [s for n in group for s in self.g.successors(n) if s not in group and self.index[s] < end]
        seen = set(stack)
        while stack:
            n = stack.pop()
            for s in self.g.successors(n):
                if s in group:
                    return False
                if s not in seen and self.index[s] < end:
                    seen.add(s)
                    stack.append(s)
        return True

    def try_merge(self, a: fx.Node, b: fx.Node) -> bool:
        ra, rb = self.find(a), self.find(b)
        if ra is rb:
            return True
        merged = self.sets[ra] | self.sets[rb]
        if not self.convex(merged):
            return False
        self.parent[rb] = ra
        self.sets[ra] = merged
        del self.sets[rb]
        return True


def find_islands(gm: fx.GraphModule, flags: dict[fx.Node, list[str]], *, root: torch.nn.Module | None = None,
                 merge: bool = True) -> list[Island]:
    """Group flagged nodes into fp32 islands (``merge=False``: one island per flagged node, the baseline)."""
    root = root if root is not None else gm
    flagged = set(flags)
    if not flagged:
        return []
    g = data_graph(gm)
    index = {n: g.nodes[n]["index"] for n in g.nodes}
    members = set(flagged)
    if merge:
        cheap = {n for n in gm.graph.nodes if is_cheap(n) and not is_effectful(n, root)}
        members |= _between(flagged, cheap)
    ordered = sorted(members, key=index.__getitem__)
    # Barriers: an effectful node gets an edge from every candidate before it and to every candidate after it.
    for e in (n for n in gm.graph.nodes if n not in members and is_effectful(n, root)):
        for c in ordered:
            if index[c] < index[e]:
                g.add_edge(c, e)
            else:
                g.add_edge(e, c)
    groups = _Groups(g, members)
    if merge:
        # Greedy in program order, like the partitioner: each data edge between candidates tries one merge.
        for n in ordered:
            for u in n.all_input_nodes:
                if u in members:
                    groups.try_merge(u, n)
    islands = []
    for nodes in groups.sets.values():
        nodes_sorted = sorted(nodes, key=index.__getitem__)
        hot = [n for n in nodes_sorted if n in flagged]
        if not hot:
            continue  # cheap nodes that could not join a flagged group: nothing to protect
        nodes_sorted = _detach_tuple_reads(nodes_sorted)
        hot = [n for n in hot if n in nodes_sorted]
        if not hot:
            continue
        if len(hot) < len(nodes_sorted):
            nodes_sorted = _trim(nodes_sorted, set(hot))
        rules: list[str] = []
        for n in hot:
            rules += [r for r in flags[n] if r not in rules]
        islands.append(Island(nodes=nodes_sorted, flagged=hot, rules=rules))
    islands.sort(key=lambda isl: index[isl.nodes[0]])
    return islands


def _detach_tuple_reads(nodes: list[fx.Node]) -> list[fx.Node]:
    """Leave ``t[i]`` of a tuple computed outside the island out of it: the island's input is then the tensor
    ``t[i]``, which can be upcast (a tuple cannot). Such a node only reads from outside, so the island stays convex."""
    members = set(nodes)
    return [n for n in nodes if not any(holds_tensors(u) and u not in members for u in n.all_input_nodes)]


def _trim(nodes: list[fx.Node], hot: set[fx.Node]) -> list[fx.Node]:
    """Drop cheap nodes that no longer sit between two flagged nodes of this island (a merge was refused)."""
    keep = set(nodes)
    changed = True
    while changed:
        changed = False
        for n in list(keep):
            if n in hot:
                continue
            has_in = any(u in keep for u in n.all_input_nodes)
            has_out = any(u in keep for u in n.users)
            if not (has_in and has_out):
                keep.discard(n)
                changed = True
    return [n for n in nodes if n in keep]
