"""JSON Lines traces: one event per line, each with ``"event"`` and ``"step"``.

Written by ``ampaudit.watch`` and ``ampaudit train --trace``, read by ``ampaudit report``. The writer flushes each
line so a killed run leaves a readable file; the reader tolerates a truncated or corrupt line and says which.

    with TraceWriter("run.jsonl") as tw:
        tw.write("step", step=1, loss=0.7, scale=65536.0, skipped=False, grad_norm=1.2, clipped=False, lr=1e-3,
                 time=0.05)
    events, problems = read_trace("run.jsonl")
    memory = MemoryTrace()                  # a writer that keeps the events as dicts in memory.events

The contract (event kinds, their fields, versions 1-6 and how readers take older traces) is docs/trace.md; the
kinds and fields are :data:`ampaudit.runtime.trace_schema.KINDS`, whose constructor builds every event of a
known kind written here. A kind the schema does not know (a caller's own, on a shared writer) is written as given.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import IO, Any

from ampaudit.errors import TraceError
from ampaudit.runtime.trace_schema import KINDS, TRACE_VERSION, event as make_event

# Written once per module and interval: with a trace file they go there only, not to ``EventLog.events`` too.
BULK_EVENTS = frozenset({"stats", "grad_hist", "precursor"})


def jsonable(value: Any) -> Any:
    """The value with inf/NaN floats as strings, tuples as lists, 0-d tensors as numbers: valid strict JSON."""
    # JSON has no inf/NaN; write them as strings so every line stays valid JSON for other tools.
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if hasattr(value, "item") and callable(value.item):  # 0-d tensors and numpy scalars
        return jsonable(value.item())
    return value


def record(event: str, step: int | None, fields: dict[str, Any]) -> dict:
    """The event dict: a known kind from its schema constructor, any other kind as given."""
    if event in KINDS:
        return make_event(event, step, **fields)
    return {"event": event, "step": step, **fields}


class TraceWriter:
    """Appends events to a JSON Lines file (or any text stream), one flushed line per event."""

    def __init__(self, target: str | os.PathLike | IO[str], *, append: bool = False):
        if hasattr(target, "write"):
            self._fh, self._owns, self.path = target, False, None
        else:
            self.path = Path(target)
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._fh = open(self.path, "a" if append else "w", encoding="utf-8")
            except OSError as exc:
                raise TraceError(f"cannot write trace {self.path}: {exc.strerror}",
                                 hint="choose a writable trace path") from exc
            self._owns = True

    def write(self, event: str, step: int | None = None, **fields: Any) -> None:
        """Write one event; a kind of :data:`~ampaudit.runtime.trace_schema.KINDS` is built (and checked) by its
        constructor: a field it does not define is a ``TypeError``."""
        self.write_record(record(event, step, fields))

    def write_record(self, record: dict) -> None:
        """Write ``record`` as it is (an event already built, or one a test makes malformed on purpose)."""
        self._fh.write(json.dumps(jsonable(record), separators=(",", ":")) + "\n")
        self._fh.flush()

    def close(self) -> None:
        if self._owns and not self._fh.closed:
            self._fh.close()

    def __enter__(self) -> "TraceWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class MemoryTrace(TraceWriter):
    """A trace kept in memory: ``events``, each as reading its line back would give it (inf/NaN as strings,
    tuples as lists, 0-d tensors as numbers: :func:`jsonable`), for a run whose trace is read in the same
    process (``check --calibrate --train-steps``). A shared writer like any other: pass it as ``trace=``.

        trace = MemoryTrace()
        Trainer(model, loss_fn, data, trace=trace).fit(steps=10)
        steps = [e for e in trace.events if e["event"] == "step"]
    """

    def __init__(self) -> None:
        self._fh, self._owns, self.path = None, False, None
        self.events: list[dict] = []

    def write_record(self, record: dict) -> None:
        self.events.append(jsonable(record))

    def close(self) -> None:
        pass


class EventLog:
    """The events of one watched run: kept in ``events`` and written to a trace, if there is one.

    ``trace``: a JSON Lines path (opened and closed here), an open :class:`TraceWriter` (shared with a trainer
    or a callback session, not closed here) or None (events in memory only). With a trace, ``stats``,
    ``grad_hist`` and ``precursor`` events (:data:`BULK_EVENTS`, the bulk of a run) go to the file only.

        log = EventLog("run.jsonl")
        log.emit("nonfinite", step=3, module="attn", ...)
        log.close()
    """

    def __init__(self, trace: str | os.PathLike | TraceWriter | IO[str] | None):
        self.events: list[dict] = []
        if trace is None or isinstance(trace, TraceWriter):
            self.writer, self.owns_writer = trace, False
        else:
            self.writer, self.owns_writer = TraceWriter(trace), True

    @property
    def writes_meta(self) -> bool:
        """Whether this log starts its own trace (a shared writer already has its ``meta`` line)."""
        return self.writer is None or self.owns_writer

    def emit(self, event: str, step: int | None, **fields: Any) -> None:
        self.emit_record(record(event, step, fields))

    def emit_record(self, built: dict) -> None:
        """Keep and write an event already built (:func:`ampaudit.runtime.trace_schema.meta`)."""
        if self.writer is None or built["event"] not in BULK_EVENTS:
            self.events.append(built)
        if self.writer is not None:
            self.writer.write_record(built)

    def close(self) -> None:
        if self.writer is not None and self.owns_writer:
            self.writer.close()


def read_trace(path: str | os.PathLike) -> tuple[list[dict], list[str]]:
    """Return ``(events, problems)``: every parseable event, and one message per line that was not."""
    p = Path(path)
    if not p.is_file():
        raise TraceError(f"trace file not found: {p}", hint="pass a trace that ampaudit.watch or a Trainer wrote")
    events: list[dict] = []
    problems: list[str] = []
    with open(p, encoding="utf-8", errors="replace") as fh:
        lines = fh.read().split("\n")
    last = len(lines) - 1
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            where = "last line truncated" if i == last else "corrupt line"
            problems.append(f"{p.name}:{i + 1}: {where}, skipped")
            continue
        if not isinstance(obj, dict) or "event" not in obj:
            problems.append(f"{p.name}:{i + 1}: not an event object, skipped")
            continue
        events.append(obj)
    return events, problems
