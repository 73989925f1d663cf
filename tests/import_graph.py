"""The import graph of ampaudit's modules, read from their source (no import runs), and its cycles.

Every ``import``/``from ... import`` counts, function-local (deferred) ones included: a deferred import that
closes a loop still ties the modules together. Imports under ``if TYPE_CHECKING:`` never run and are left out.

    python tests/import_graph.py            # the module cycles, then the cycles between packages
    graph = module_graph(); cycles(graph)   # [["ampaudit.a", "ampaudit.b"], ...]: one list per strongly connected set
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "ampaudit"


def _module_names(root: Path) -> dict[str, Path]:
    names = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _type_checking_only(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, module: str, is_package: bool) -> list[str]:
    """The dotted names ``tree`` imports (``from a import b`` gives ``a.b`` and ``a``: the caller keeps what is a
    module)."""
    found: list[str] = []
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _type_checking_only(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".") if is_package else module.split(".")[:-1]
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            found.append(base)
            found += [f"{base}.{a.name}" for a in node.names]
        stack.extend(ast.iter_child_nodes(node))
    return found


def module_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """module -> the ampaudit modules it imports (the nearest known module of each imported name)."""
    names = _module_names(root)
    graph: dict[str, set[str]] = {}
    for module, path in names.items():
        edges = set()
        for name in _imports(ast.parse(path.read_text(encoding="utf-8")), module, path.name == "__init__.py"):
            while name and name not in names:
                name = name.rpartition(".")[0]
            if name and name != module:
                edges.add(name)
        graph[module] = edges
    # `from ampaudit.pkg import mod` names both the package and the module: the module is what it loads.
    for module, edges in graph.items():
        graph[module] = {e for e in edges if not any(o.startswith(e + ".") for o in edges) or e == "ampaudit"}
    return graph


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The graph between ampaudit's subpackages (``ampaudit.report``, ...; a top-level module is its own node)."""
    def package(module: str) -> str:
        return ".".join(module.split(".")[:2])

    out: dict[str, set[str]] = {}
    for module, edges in graph.items():
        out.setdefault(package(module), set()).update(package(e) for e in edges if package(e) != package(module))
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected sets of more than one node (Tarjan), each sorted; the list sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph)))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


if __name__ == "__main__":
    g = module_graph()
    for title, found in (("module cycles", cycles(g)), ("package cycles", cycles(package_graph(g)))):
        print(f"{title}: {len(found)}")
        for group in found:
            print("  " + " <-> ".join(group))
