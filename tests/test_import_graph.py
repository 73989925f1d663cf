"""No import cycle inside report/ nor through the trace contract, deferred (function-local) imports included."""
from __future__ import annotations

from import_graph import cycles, module_graph, package_graph


def test_the_graph_sees_deferred_and_relative_imports():
    g = module_graph()
    # trace_summary reads each kind's rows inside collect(): a function-local import.
    assert "ampaudit.report.trace_fp8" in g["ampaudit.report.trace_summary"]
    assert "ampaudit.runtime.trace" in g["ampaudit.report.trace_summary"]
    # a planted loop is found
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert package_graph({"ampaudit.x.a": {"ampaudit.y.b"}, "ampaudit.y.b": set()}) == \
        {"ampaudit.x": {"ampaudit.y"}, "ampaudit.y": set()}


def test_no_cycle_inside_report():
    found = [c for c in cycles(module_graph()) if any(m.startswith("ampaudit.report") for m in c)]
    assert found == []


def test_the_trace_contract_imports_no_reader_or_writer():
    g = module_graph()
    for module in (m for m in g if m.startswith("ampaudit.runtime.trace")):
        assert not any(c for c in cycles(g) if module in c), module
        assert all(e == "ampaudit.errors" or e.startswith("ampaudit.runtime.trace") for e in g[module]), g[module]
