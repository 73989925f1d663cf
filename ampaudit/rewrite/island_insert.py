"""The FP32-island rewrite: make each island contiguous, run it with autocast disabled on upcast inputs.

    changed, added = insert_islands(gm, islands, devices=("cpu",))
    gm.graph.lint(); gm.recompile()        # done by the pass

Each island becomes, inline in the same graph (so parameter and buffer names do not change)::

    _enter_autocast = torch.amp.autocast_mode._enter_autocast('cpu', None, False, None)
    float_1 = scores.float()                # every floating input computed outside the island
    ...island ops...                         # run in fp32
    _exit_autocast = torch.amp.autocast_mode._exit_autocast(_enter_autocast)

Island outputs stay fp32; they are not cast back. A value an island computes in fp32 may not fit the low
dtype (a running sum past 65504, a -3.4e38 mask): casting it back would bring the overflow back. The ops that
make autocast worth having (matmul, linear, conv) are on autocast's lower list and cast their fp32 inputs
themselves, so a cast back would only duplicate theirs; other consumers follow type promotion and stay fp32,
as CUDA autocast's own fp32 ops (softmax, layer_norm) leave them. In FP32, ``x.float()`` returns ``x`` itself
and autocast is already off, so the rewritten model computes exactly what it did, op for op.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.amp.autocast_mode import _enter_autocast, _exit_autocast

from ampaudit.analysis.amp_prop import AMP_KEY
from ampaudit.graph_meta import MODULE_KEY
from ampaudit.rewrite.island_partition import Island, is_scalar_node

ISLAND_KEY = "ampaudit_island"      # node.meta key: index of the island a node belongs to


@dataclass
class IslandChange:
    """What one island added: where, which ops, how many casts, and which findings it answers."""

    index: int
    modules: list[str]
    ops: list[str]
    rules: list[str]
    casts: int

    def describe(self) -> str:
        where = ", ".join(m or "<top module>" for m in self.modules)
        ops = self.ops if len(self.ops) <= 8 else self.ops[:3] + [f"... {len(self.ops) - 6} more ..."] + self.ops[-3:]
        return f"island {self.index}: {where}: {' -> '.join(ops)}; {self.casts} cast(s) [{', '.join(self.rules)}]"


def needs_upcast(node: fx.Node, island_of: dict[fx.Node, int]) -> bool:
    """True when ``node``'s value may reach the island in a low dtype under autocast.

    Parameters, buffers and inputs keep their dtype under autocast; values computed by another island are fp32;
    float64 stays float64. Everything else that is a floating tensor gets ``.float()`` (a no-op on fp32 tensors).
    """
    if node.op in ("placeholder", "get_attr") or node in island_of:
        return False
    info = node.meta.get(AMP_KEY)
    if info is None:
        return False
    value = info.value
    if isinstance(value, torch.Tensor):
        return value.dtype.is_floating_point and value.dtype != torch.float64
    return value is None and isinstance(info.dtype, torch.dtype) and info.dtype.is_floating_point \
        and info.dtype != torch.float64


def _reads_dtype(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is getattr and len(node.args) == 2 and node.args[1] == "dtype"


def _make_contiguous(graph: fx.Graph, members: set[fx.Node], blocks: dict[fx.Node, int]) -> None:
    """Reorder the nodes spanning ``members`` so they are adjacent; islands already placed move as one unit.

    Nodes in the span that feed the island move before it, the others after it; relative order is otherwise
    kept. The island is convex, so no node both feeds it and depends on it.
    """
    order = list(graph.nodes)
    pos = {n: i for i, n in enumerate(order)}
    first, last = min(pos[m] for m in members), max(pos[m] for m in members)
    span = order[first:last + 1]
    # Units: an already-contiguous island is one unit; any other node is its own.
    units: list[list[fx.Node]] = []
    for n in span:
        b = blocks.get(n)
        if n not in members and b is not None and units and units[-1][0] not in members \
                and blocks.get(units[-1][0]) == b:
            units[-1].append(n)
        else:
            units.append([n])
    feeds: set[fx.Node] = set()
    before: list[fx.Node] = []
    after: list[fx.Node] = []
    island: list[fx.Node] = []
    for unit in reversed(units):
        if unit[0] in members:
            island.append(unit[0])
        elif any(u in members or u in feeds for n in unit for u in n.users):
            feeds.update(unit)
            before.extend(reversed(unit))
        else:
            after.extend(reversed(unit))
    new = list(reversed(before)) + list(reversed(island)) + list(reversed(after))
    anchor = span[0].prev
    for n in new:
        anchor.append(n)
        anchor = n


def insert_islands(gm: fx.GraphModule, islands: list[Island], *,
                   devices: tuple[str, ...] = ("cpu",)) -> tuple[bool, list[IslandChange]]:
    """Rewrite ``gm`` in place: each island runs with autocast disabled on ``devices``, on upcast inputs."""
    if not islands:
        return False, []
    graph = gm.graph
    island_of = {n: i for i, isl in enumerate(islands) for n in isl.nodes}
    blocks: dict[fx.Node, int] = {}
    # Place islands in dependency order so an earlier-placed island is never split by a later reorder.
    for i in _dependency_order(graph, islands, island_of):
        members = set(islands[i].nodes)
        _make_contiguous(graph, members, blocks)
        for n in members:
            blocks[n] = i
    changes: list[IslandChange] = []
    for i, isl in enumerate(islands):
        nodes = [n for n in graph.nodes if island_of.get(n) == i]
        first, last = nodes[0], nodes[-1]
        module = isl.modules[0] if isl.modules else ""
        casts: dict[fx.Node, fx.Node] = {}
        with graph.inserting_before(first):
            modes = [graph.call_function(_enter_autocast, (d, None, False, None)) for d in devices]
            # Inputs of tensor ops get upcast; so does the tensor behind x.dtype, or x.to(x.dtype) would
            # downcast inside the island. x.shape / x.device read the original (no cast just for that).
            for n in nodes:
                if is_scalar_node(n) and not _reads_dtype(n):
                    continue
                for u in n.all_input_nodes:
                    if u not in casts and island_of.get(u) != i and needs_upcast(u, island_of):
                        casts[u] = graph.call_method("float", (u,))
        for m in list(modes) + list(casts.values()):
            m.meta[MODULE_KEY] = module
            m.meta[ISLAND_KEY] = i
        for n in nodes:
            n.meta[ISLAND_KEY] = i
            for u, c in casts.items():
                n.replace_input_with(u, c)
        anchor = last
        for mode in reversed(modes):
            with graph.inserting_after(anchor):
                anchor = graph.call_function(_exit_autocast, (mode,))
                anchor.meta[MODULE_KEY] = module
                anchor.meta[ISLAND_KEY] = i
        changes.append(IslandChange(index=i + 1, modules=isl.modules, ops=isl.ops, rules=isl.rules,
                                    casts=len(casts)))
    graph.lint()
    gm.recompile()
    return True, changes


def _dependency_order(graph: fx.Graph, islands: list[Island], island_of: dict[fx.Node, int]) -> list[int]:
    """Island indices in topological order of the island graph (acyclic: every island is convex)."""
    import networkx as nx

    g = nx.DiGraph()
    g.add_nodes_from(range(len(islands)))
    # Reachability between islands through any nodes: walk forward from each island's outputs.
    for i, isl in enumerate(islands):
        seen: set[fx.Node] = set()
        stack = [u for n in isl.nodes for u in n.users if island_of.get(u) != i]
        while stack:
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            j = island_of.get(n)
            if j is not None and j != i:
                g.add_edge(i, j)
            stack.extend(n.users)
    pos = {n: k for k, n in enumerate(graph.nodes)}
    return list(nx.lexicographical_topological_sort(g, key=lambda i: pos[islands[i].nodes[0]]))
