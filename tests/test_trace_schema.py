"""The trace schema (ampaudit/runtime/trace_schema.py): its constructor, docs/trace.md, its writers and readers."""
from __future__ import annotations

import ast
import io
import json
import re
from pathlib import Path

import pytest

from ampaudit.report.trace_summary import collect
from ampaudit.runtime.trace import TRACE_VERSION as WRITTEN_VERSION
from ampaudit.runtime.trace import TraceWriter
from ampaudit.runtime.trace_schema import KINDS, TRACE_VERSION, event, meta
from trace_events import ev

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "trace.md"


def _documented() -> dict[str, tuple[int, dict[str, str]]]:
    """kind -> (version, {field: "required" | "optional"}) from the sections of docs/trace.md."""
    found: dict[str, tuple[int, dict[str, str]]] = {}
    kind = None
    for line in DOC.read_text(encoding="utf-8").splitlines():
        head = re.match(r"### `(\w+)` \(version (\d+)\)$", line)
        if head:
            kind = head[1]
            found[kind] = (int(head[2]), {})
            continue
        row = re.match(r"\| `(\w+)` \| (required|optional) \|", line)
        if row and kind is not None:
            found[kind][1][row[1]] = row[2]
        elif line.startswith("## "):
            kind = None
    return found


def test_the_document_lists_every_kind_version_and_field_of_the_schema():
    doc = _documented()
    assert sorted(doc) == sorted(KINDS)
    for name, spec in KINDS.items():
        version, fields = doc[name]
        assert version == spec.since, name
        assert fields == {**{f: "required" for f in spec.required}, **{f: "optional" for f in spec.optional}}, name
    assert f"# The trace format (version {TRACE_VERSION})" in DOC.read_text(encoding="utf-8")
    # A version adds kinds or only fields (version 6: optional fields of stats and nonfinite); the document says which.
    assert max(k.since for k in KINDS.values()) <= TRACE_VERSION == WRITTEN_VERSION
    assert f"**Version {TRACE_VERSION}** adds" in DOC.read_text(encoding="utf-8")


def test_readme_and_the_trace_module_point_to_the_document():
    assert "docs/trace.md" in (ROOT / "README.md").read_text(encoding="utf-8")
    assert "docs/trace.md" in (ROOT / "ampaudit" / "runtime" / "trace.py").read_text(encoding="utf-8")


def test_the_constructor_refuses_what_the_schema_does_not_define():
    fields = dict(loss=0.5, scale=None, skipped=False, grad_norm=None, clipped=False, lr=1e-3, time=0.1)
    assert event("step", 3, **fields) == {"event": "step", "step": 3, **fields}
    with pytest.raises(TypeError, match="step event has no field gnorm"):
        event("step", 3, **fields, gnorm=1.0)
    with pytest.raises(TypeError, match="step event lacks lr, time"):
        event("step", 3, loss=0.5, scale=None, skipped=False, grad_norm=None, clipped=False)
    with pytest.raises(TypeError, match="unknown trace event kind 'stpe'"):
        event("stpe", 3)
    # fields may be named like the constructor's own parameters
    assert event("nonfinite", 1, **{**{f: None for f in KINDS["nonfinite"].required}, "kind": "inf"})["kind"] == "inf"


def test_one_meta_constructor_keeps_the_contracts_keys():
    line = meta("train", dtype="float16", device="cuda", model="Net", version=1, source="mine", argv=["x"])
    assert (line["version"], line["source"], line["argv"]) == (TRACE_VERSION, "train", ["x"])   # caller's keys kept
    with pytest.raises(TypeError):
        meta("watch", dtype="float16", device="cuda")          # no model


def test_the_writer_builds_known_kinds_and_writes_others_as_given():
    buf = io.StringIO()
    tw = TraceWriter(buf)
    tw.write("checkpoint", 4, path="c.pt")
    tw.write("note", None, text="a kind of the caller's own")
    with pytest.raises(TypeError, match="checkpoint event lacks path and has no field file"):
        tw.write("checkpoint", 5, file="c.pt")
    lines = [json.loads(x) for x in buf.getvalue().splitlines()]
    assert lines == [{"event": "checkpoint", "step": 4, "path": "c.pt"},
                     {"event": "note", "step": None, "text": "a kind of the caller's own"}]


def test_the_memory_trace_keeps_what_the_file_would_read_back():
    import torch

    from ampaudit.runtime.trace import MemoryTrace

    buf, memory = io.StringIO(), MemoryTrace()
    for tw in (TraceWriter(buf), memory):
        tw.write("checkpoint", 4, path="c.pt")
        tw.write("note", 2, loss=float("inf"), worst=(float("nan"), -float("inf"), -0.0), scale=torch.tensor(2.5),
                 per={1: [0.1, (2, 3)]}, flag=True, none=None)
    read_back = [json.loads(x) for x in buf.getvalue().splitlines()]
    assert memory.events == read_back
    assert memory.events[1]["loss"] == "inf" and memory.events[1]["per"] == {"1": [0.1, [2, 3]]}
    memory.close()
    memory.write("note", 3)      # closing a memory trace loses nothing and keeps it open
    assert len(memory.events) == 3


def _written_kinds() -> dict[str, list[str]]:
    """kind -> places in ampaudit/ that write it: ``x.write("kind", ...)``, ``x.emit``/``_emit`` and ``event("kind",
    ...)`` calls with a literal kind and keyword fields."""
    found: dict[str, list[str]] = {}
    for path in (ROOT / "ampaudit").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Call) or not node.args or not node.keywords:
                continue
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            first = node.args[0]
            if name in ("write", "emit", "_emit", "event", "make_event") and isinstance(first, ast.Constant) \
                    and isinstance(first.value, str):
                found.setdefault(first.value, []).append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_every_kind_ampaudit_writes_is_in_the_schema():
    written = _written_kinds()
    assert {"step", "stats", "skip", "fp8", "halt", "eval"} <= set(written)      # the scan sees the writers
    assert {k: v for k, v in written.items() if k not in KINDS} == {}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_the_report_reads_every_kind(kind):
    data = collect([ev("meta", version=TRACE_VERSION, dtype="float16"), ev(kind, 1)])
    assert data.unknown == {}
