"""Notes for the report from code deep inside an audit: what was skipped or approximated, and why.

    with collect() as notes:
        cal = calibrate(model, batches, policy)     # somewhere inside: note("...")
    report.notes.extend(notes)                      # each distinct note once, in order

A statistic that fails on one tensor, or an op the CUDA simulation has to emulate, must not end the audit, but the
report has to say what it lacks. ``note`` outside any ``collect`` block does nothing: a library call (a
``compare_to_fp32`` in a training loop) has no report to write to.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

_ACTIVE: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("ampaudit_notes", default=None)


def note(message: str) -> None:
    """Add ``message`` to the innermost :func:`collect` block's notes (once; nothing outside a block)."""
    notes = _ACTIVE.get()
    if notes is not None and message not in notes:
        notes.append(message)


@contextlib.contextmanager
def collect() -> Iterator[list[str]]:
    """Collect the :func:`note` calls made inside the block into the list it yields (an enclosing block gets
    them too)."""
    notes: list[str] = []
    token = _ACTIVE.set(notes)
    try:
        yield notes
    finally:
        _ACTIVE.reset(token)
        for message in notes:
            note(message)
