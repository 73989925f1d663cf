"""Layers: the ground floor (ampaudit's top-level helper modules), the rules and the runtime import nothing from
the layers above them (report, train, integrations, cli), read from the AST, function-local imports included."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

import ampaudit

ROOT = Path(ampaudit.__file__).parent
UPPER = ("report", "train", "integrations", "cli")
# Top-level modules that are entry points, not ground floor: they sit above every package.
ENTRY_POINTS = {"__init__.py", "__main__.py", "api.py", "docs_gen.py", "pytest_plugin.py", "testing.py"}
GROUND = sorted(p.name for p in ROOT.glob("*.py") if p.name not in ENTRY_POINTS)


def imported(source: str, package: str) -> set[str]:
    """Every ampaudit module ``source`` (a module of ``package``) imports, at module level or in a function."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            out.add(base)
            out |= {f"{base}.{a.name}" for a in node.names}
    return {m for m in out if m == "ampaudit" or m.startswith("ampaudit.")}


def upward(path: Path) -> list[str]:
    package = ".".join(("ampaudit",) + path.relative_to(ROOT).parent.parts)
    return sorted(m for m in imported(path.read_text(), package) if m.split(".")[1:2] and m.split(".")[1] in UPPER)


def _files(where: str) -> list[Path]:
    return sorted((ROOT / where).rglob("*.py")) if where != "." else [ROOT / name for name in GROUND]


@pytest.mark.parametrize("layer", [".", "rules", "runtime"])
def test_lower_layers_import_nothing_from_above(layer):
    bad = {str(p.relative_to(ROOT)): upward(p) for p in _files(layer) if upward(p)}
    assert bad == {}


def test_the_check_sees_function_local_and_relative_imports():
    source = ("import torch\nfrom ampaudit.dtypes import name_of\n"
              "def f():\n    from ampaudit.report import groups\n\n"
              "class C:\n    def g(self):\n        from ..train import batchnorm\n        import ampaudit.cli.app\n")
    found = imported(source, "ampaudit.runtime")
    assert {"ampaudit.report.groups", "ampaudit.train.batchnorm", "ampaudit.cli.app", "ampaudit.dtypes"} <= found
    assert "torch" not in found
