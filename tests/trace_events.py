"""Trace events for tests, built by the trace schema's constructor (ampaudit.runtime.trace_schema.event).

A field the schema does not define fails the test that builds it, so a writer that changes its events (and with
them the schema) reaches the report's tests too. Required fields a test leaves out are null, as a writer records
what it did not measure.

    from trace_events import ev
    events = [ev("meta", version=2, dtype="float16"), ev("step", 1, loss=1.0, scale=1024.0, skipped=False)]
    tw.write_record(ev("stats", 10, module="fc", phase="forward", absmax=4.0))
"""
from __future__ import annotations

from typing import Any

from ampaudit.runtime.trace_schema import KINDS, TRACE_VERSION, event


def ev(kind: str, step: int | None = None, /, **fields: Any) -> dict[str, Any]:
    """The ``kind`` event with ``fields`` and every other required field null (``meta``: this version and
    source "watch" unless given)."""
    base = {f: None for f in KINDS[kind].required}
    if kind == "meta":
        base.update(version=TRACE_VERSION, source="watch")
    return event(kind, step, **{**base, **fields})


def steps(losses: list[float], **fields: Any) -> list[dict[str, Any]]:
    """``step`` events 1, 2, ... with these losses (and ``fields`` on each)."""
    return [ev("step", i, **{"loss": x, "scale": None, "skipped": False, **fields}) for i, x in enumerate(losses, 1)]
