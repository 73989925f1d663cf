"""The package's structure: no import cycle between modules or between packages, deferred (function-local)
imports included, and no module or function past the style's size (400 lines a module, 80 a function)."""
from __future__ import annotations

import ast
import functools

from import_graph import PACKAGE, cycles, module_graph, package_graph

MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 80


graph = functools.lru_cache(maxsize=None)(module_graph)


def test_the_graph_sees_deferred_and_relative_imports():
    g = graph()
    # trace_summary reads each kind's rows inside collect(): a function-local import.
    assert "ampaudit.report.trace_fp8" in g["ampaudit.report.trace_summary"]
    assert "ampaudit.runtime.trace" in g["ampaudit.report.trace_summary"]
    # a planted loop is found
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert package_graph({"ampaudit.x.a": {"ampaudit.y.b"}, "ampaudit.y.b": set()}) == \
        {"ampaudit.x": {"ampaudit.y"}, "ampaudit.y": set()}
    # a top-level module is a package of its own: api.py -> rules/ and rules/ -> api.py is a cycle
    assert cycles(package_graph({"ampaudit.api": {"ampaudit.rules.engine"}, "ampaudit.rules.engine": {"ampaudit.api"}})) \
        == [["ampaudit.api", "ampaudit.rules"]]


def test_no_module_cycle_anywhere():
    assert cycles(graph()) == []


def test_no_package_cycle():
    """Between ampaudit's packages, a top-level module (api.py, quiet.py) counting as a package of its own."""
    assert cycles(package_graph(graph())) == []


def test_the_trace_contract_imports_no_reader_or_writer():
    g = graph()
    for module in (m for m in g if m.startswith("ampaudit.runtime.trace")):
        assert all(e == "ampaudit.errors" or e.startswith("ampaudit.runtime.trace") for e in g[module]), g[module]


def _sizes() -> tuple[dict[str, int], dict[str, int]]:
    """``(module path -> lines, "path:function" -> lines)`` of every module of ampaudit (tests are not in it);
    a function's lines run from its ``def`` to its last line, nested functions and methods counted too."""
    modules, functions = {}, {}
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        name = str(path.relative_to(PACKAGE.parent))
        modules[name] = len(text.splitlines())
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                functions[f"{name}:{node.lineno} {node.name}"] = node.end_lineno - node.lineno + 1
    return modules, functions


def test_the_size_census_sees_every_module_and_function():
    modules, functions = _sizes()
    assert "ampaudit/api.py" in modules and "ampaudit/runtime/trace.py" in modules
    assert all(not m.startswith("tests/") for m in modules)
    assert any(f.endswith(" plan_edits") and f.startswith("ampaudit/sourcefix/driver.py:") for f in functions)
    assert any(f.endswith(" line") and f.startswith("ampaudit/train/preflight_check.py:") for f in functions)  # a method


def test_no_function_over_80_lines():
    _, functions = _sizes()
    assert {f: n for f, n in functions.items() if n > MAX_FUNCTION_LINES} == {}


def test_no_module_over_400_lines():
    modules, _ = _sizes()
    assert {m: n for m, n in modules.items() if n > MAX_MODULE_LINES} == {}

