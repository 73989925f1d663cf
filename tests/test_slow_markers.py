"""`pytest -m "not slow"` stays fast: a test that starts a process (torchrun, the CLI, a Python, a browser) is
marked slow. Starting Python with torch costs seconds on a small machine, whatever the test does after."""
from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
SPAWNS = {"torchrun", "_torchrun", "run", "Popen", "check_output", "check_call"}


def _spawns(node: ast.AST, helpers: set[str]) -> bool:
    for call in (n for n in ast.walk(node) if isinstance(n, ast.Call)):
        f = call.func
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "subprocess" \
                and f.attr in SPAWNS:
            return True
        if isinstance(f, ast.Name) and (f.id in ("torchrun", "_torchrun") or f.id in helpers):
            return True
    return False


def _slow(fn: ast.FunctionDef, module_marked: bool) -> bool:
    return module_marked or any("slow" in ast.unparse(d) for d in fn.decorator_list)


def unmarked_spawners() -> list[str]:
    found = []
    for path in sorted(TESTS.glob("test_*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        module_marked = any(isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in n.targets)
                            and "slow" in ast.unparse(n.value) for n in tree.body)
        functions = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
        # helpers of the file that start a process (one level: a helper calling torchrun, subprocess.run, ...)
        helpers = {fn.name for fn in functions if not fn.name.startswith("test") and _spawns(fn, set())}
        for fn in functions:
            if fn.name.startswith("test") and _spawns(fn, helpers) and not _slow(fn, module_marked):
                found.append(f"{path.name}::{fn.name}")
    return found


def test_the_scan_finds_a_process_start():
    tree = ast.parse("def test_x():\n    subprocess.run(['python'])\n")
    assert _spawns(tree, set()) and not _spawns(ast.parse("def f():\n    run(1)\n"), set())


def test_every_test_that_starts_a_process_is_marked_slow():
    assert unmarked_spawners() == []
