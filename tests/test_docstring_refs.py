"""Every function, class and module a docstring of ampaudit names in a role (:func:`name`, :class:`~pkg.mod.Name`,
:mod:`pkg.mod`) exists: a qualified name in the module it names, a bare one somewhere in the package."""
from __future__ import annotations

import ast
import re
from pathlib import Path

from conftest import ROOT

PACKAGE = ROOT / "ampaudit"
ROLE = re.compile(r":(func|class|mod|meth|attr|data|exc):`(?:[^`<]*<)?~?([\w.]+)>?`")


def _module_file(dotted: str) -> Path | None:
    path = ROOT.joinpath(*dotted.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _defined(tree: ast.AST) -> set[str]:
    """Names a module defines: functions, classes, assigned names and attributes (``self.x = ...``), and the keys
    of a lazy export table (the package's ``{"watch": "ampaudit.runtime.watch"}``)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            names.update(k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.alias):
            names.add((node.asname or node.name).split(".")[0])
    return names


def _missing() -> list[str]:
    texts = {p: p.read_text() for p in PACKAGE.rglob("*.py")}
    defined = {p: _defined(ast.parse(text)) for p, text in texts.items()}
    everywhere = set().union(*defined.values())
    missing = []
    for path, text in texts.items():
        for role, target in ROLE.findall(text):
            parts = target.split(".")
            if parts[0] != "ampaudit":
                ok = role == "mod" or parts[-1] in everywhere or parts[0] in ("torch", "typing")
            elif role == "mod":
                ok = _module_file(target) is not None
            else:
                cut = next((i for i in range(len(parts), 0, -1) if _module_file(".".join(parts[:i]))), 0)
                module = _module_file(".".join(parts[:cut])) if cut else None
                ok = module is not None and (cut == len(parts) or parts[-1] in defined[module])
            if not ok:
                missing.append(f"{path.relative_to(ROOT)}: :{role}:`{target}`")
    return missing


def test_every_name_a_docstring_refers_to_exists():
    assert _missing() == []
