"""The trace's schema: every event kind ampaudit writes, its fields, and the one constructor of its events.

What each kind and field means is docs/trace.md, the versioned contract; a test checks that document lists the
same kinds, versions and fields as :data:`KINDS`. Writers get their events from here (``TraceWriter.write`` and
``EventLog.emit`` build every known kind with :func:`event`), and so do the report's tests, so a writer that
drifts from the schema fails its own tests and a schema change reaches the readers' tests.

    from ampaudit.runtime.trace_schema import event, meta
    event("checkpoint", 100, path="ckpt/last.pt")     # {"event": "checkpoint", "step": 100, "path": "ckpt/last.pt"}
    meta("watch", dtype="float16", device="cuda", model="Net", every=50)
    event("step", 3, loss=0.7)                         # TypeError: step event lacks scale, skipped, ...

A field is required (every event of the kind carries it, possibly null) or optional (some writers or some
events leave it out). An unknown field, a missing required one or an unknown kind is a ``TypeError``, as a
dataclass's constructor gives: it is a bug of the writer, not of the run. Readers take any event and any
field, known or not (``ampaudit.report.trace_summary``).

Adding a kind: one :class:`EventKind` line in :data:`KINDS` (name, the version that adds it, required and
optional fields), its section in docs/trace.md, and, when it is the first of a new version, that version in
:data:`TRACE_VERSION`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# The newest version ampaudit writes and reads (it reads every older one too); a newer trace is read as far as it is known.
TRACE_VERSION = 7
# Every event has these two keys besides its fields: its kind and the training step (null when none).
ENVELOPE = ("event", "step")


@dataclass(frozen=True)
class EventKind:
    """One kind of event: ``since`` the trace version that adds it; ``open`` allows keys beyond the fields (the
    ``meta`` line carries the caller's own description of the run)."""

    name: str
    since: int
    required: tuple[str, ...]
    optional: tuple[str, ...] = ()
    open: bool = False

    @property
    def fields(self) -> tuple[str, ...]:
        return self.required + self.optional

    def __call__(self, step: int | None = None, /, **fields: Any) -> dict[str, Any]:
        """The event dict (``event``, ``step``, then the fields in the caller's order); see :func:`event`."""
        missing = [f for f in self.required if f not in fields]
        unknown = [] if self.open else [f for f in fields if f not in self.required and f not in self.optional]
        if missing or unknown:
            parts = ([f"lacks {', '.join(missing)}"] if missing else []) + \
                ([f"has no field {', '.join(unknown)}"] if unknown else [])
            raise TypeError(f"{self.name} event {' and '.join(parts)} (the schema: ampaudit/runtime/trace_schema.py, "
                            "docs/trace.md)")
        return {"event": self.name, "step": step, **fields}


_META_WATCH = ("every", "divergence_every", "stats_every", "precursors_every", "grad_divergence_every",
               "local_divergence_every", "composite_divergence_every")
_META_CALLBACK = ("integration", "precision", "max_grad_norm", "gradient_accumulation_steps")
_META_TRAINER = ("opt_level", "accum", "world_size", "scaler", "fsdp", "compile", "clip", "lr_policy", "warnings",
                 "checkpoint_activations", "target", "argv")

KINDS: dict[str, EventKind] = {k.name: k for k in (
    EventKind("meta", 1, ("version", "source", "dtype", "device", "model"),
              _META_WATCH + _META_CALLBACK + _META_TRAINER, open=True),
    EventKind("step", 1, ("loss", "scale", "skipped", "grad_norm", "clipped", "lr", "time")),
    EventKind("stats", 1, ("module", "phase", "absmax", "headroom_bits", "nonfinite_passes", "passes",
                           "counted_passes", "min_nonzero", "numel", "zeros", "underflow", "subnormal", "overflow",
                           "inf", "nan"), ("dtype",)),
    EventKind("nonfinite", 1, ("phase", "module", "op", "source", "kind", "cause", "dtype"),
              ("message", "low_precision", "fp32_too", "scaled_only")),
    EventKind("divergence", 1, ("module", "scope", "rel_l2", "cosine", "max_abs", "sqnr_db"),
              ("call", "param", "input_rel_l2", "output_rel_l2", "fp32_moved")),
    EventKind("skip", 1, ("scale", "params", "modules"), ("scope",)),
    EventKind("checkpoint", 1, ("path",)),
    EventKind("halt", 1, ("reason", "diagnosis")),
    EventKind("fp8", 1, ("module",), ("input", "weight", "grad_output")),
    EventKind("fp8_budget", 1, ("module", "role", "flushed_share", "max_flushed_share", "fallback")),
    EventKind("grad_hist", 2, ("module", "phase", "lo", "counts", "zeros", "nonfinite", "numel", "passes", "scale")),
    EventKind("eval", 2, ("dtype", "batches", "samples", "loss", "metrics", "time")),
    EventKind("preflight", 2, ("checks",)),
    EventKind("swamping", 3, ("tensor", "module", "kind", "dtype", "share_rounded", "realized_ratio", "elements",
                              "numel", "update_rel", "half_ulp_rel", "why", "fix"), ("source",)),
    EventKind("decision", 3, ("module", "op", "source", "kind", "decisions", "flipped", "share_flipped", "used",
                              "calls")),
    EventKind("precursor", 3, ("signal", "module", "value", "threshold", "max_step"),
              ("crossed_step", "passes", "absmax", "median", "min_abs", "producer")),
    EventKind("recipe_stats", 4, ("module", "recipe", "gemms", "sqnr_db", "input"), ("grad_output",)),
    EventKind("fallback", 4, ("module", "from", "to", "reason", "value", "limit", "why")),
    EventKind("state_overflow", 5, ("tensor", "module", "kind", "dtype", "elements", "numel", "fp32_absmax",
                                    "limit", "why", "fix"), ("source",)),
)}


def event(kind: str, step: int | None = None, /, **fields: Any) -> dict[str, Any]:
    """The ``kind`` event of ``step`` with ``fields``, checked against :data:`KINDS` (``TypeError`` if it does
    not fit). Values are kept as given; :func:`ampaudit.runtime.trace.jsonable` makes them JSON on write."""
    try:
        spec = KINDS[kind]
    except KeyError:
        raise TypeError(f"unknown trace event kind {kind!r}: add it to KINDS in ampaudit/runtime/trace_schema.py "
                        "and to docs/trace.md") from None
    return spec(step, **fields)


def meta(source: str, /, *, dtype: str, device: str, model: str, step: int | None = None,
         **description: Any) -> dict[str, Any]:
    """The ``meta`` line, the first of a trace: this version, the writer (``source``: watch | train | a callback's
    framework), the run's dtype name, device and model class, and ``description`` (the writer's settings and any
    keys of the caller's own). ``version`` and ``source`` are the contract's: a description cannot replace them."""
    description = {k: v for k, v in description.items() if k not in ("version", "source")}
    return event("meta", step, version=TRACE_VERSION, source=source, dtype=dtype, device=device, model=model,
                 **description)


__all__ = ["ENVELOPE", "KINDS", "TRACE_VERSION", "EventKind", "event", "meta"]
