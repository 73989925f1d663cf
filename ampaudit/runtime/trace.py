"""JSON Lines traces: one event per line, each with ``"event"`` and ``"step"``.

Written by ``ampaudit.watch`` and ``ampaudit train --trace``, read by ``ampaudit report``. The writer flushes each
line so a killed run leaves a readable file; the reader tolerates a truncated or corrupt line and says which.

    with TraceWriter("run.jsonl") as tw:
        tw.write("step", step=1, loss=0.7, scale=65536.0, skipped=False)
    events, problems = read_trace("run.jsonl")

Event kinds (version 1): ``meta`` (first line: version, tool, dtype, device, ...), ``step`` (loss, scale, skipped,
grad_norm, clipped, lr, time), ``stats`` (module, phase, absmax, min_nonzero, inf, nan, zeros, subnormal,
headroom_bits), ``nonfinite`` (phase forward|backward, module, op, source), ``divergence`` (module, metrics vs
FP32), ``skip`` (step skipped by the loss scaler: modules/params with non-finite grads), ``checkpoint``, ``halt``,
and for torchao Float8Linear layers (``ampaudit.runtime.fp8_stats``) ``fp8`` (module; input, weight, grad_output:
amax, scale, flushed_share, clipped_share) and ``fp8_budget`` (module, role, flushed_share, max_flushed_share,
fallback). Version 2 adds ``grad_hist`` (module, phase backward, lo, counts, zeros, nonfinite, numel, passes,
scale: ``counts[i]`` gradient values with ``floor(log2|g|) == lo + i`` as measured, at loss scale ``scale``, None
when unknown; see :mod:`ampaudit.runtime.grad_hist`), ``eval`` (the trainer's evaluation,
:mod:`ampaudit.train.evaluate`: dtype, batches, samples, time, ``loss`` and ``metrics: {name: ...}``, each
``{"autocast", "fp32", "gap", "noise"}``: gap = autocast - fp32, noise = the standard error of the FP32 value over
the eval batches or null), ``preflight`` (the trainer's checks: ``checks: [{name, status, message, hint}]``) and,
in the trainer's ``meta``, ``lr_policy`` (warmup_steps, scale, base_batch, micro_batch, effective_batch, factor),
``fsdp`` and ``compile``. A version-1 trace is a version-2 trace without them, so readers take both; a reader of
version 1 skips the new kinds as unknown. New kinds are additive: a reader skips kinds it does not know.

Version 3 adds ``swamping`` (:mod:`ampaudit.runtime.swamping`): on a step the statistics sample, one event per
tensor stored in fp16/bf16/fp8 without an FP32 master whose in-place updates (optimizer step, an EMA / momentum
teacher, a buffer the forward updates, bf16 optimizer state) rounded away: ``tensor`` (its name: a parameter,
buffer, or ``<param>.<state key>``), ``module``, ``kind`` (param | buffer | optimizer_state), ``dtype``,
``share_rounded`` (of the elements whose FP32 update was nonzero, the share whose stored value did not move),
``realized_ratio`` (norm of the stored delta / norm of the FP32 delta over the step), ``elements`` (elements FP32
would have moved), ``numel``, ``update_rel`` (median |FP32 update| / |value|, null when unknown), ``half_ulp_rel``
(half an ulp of the dtype, relative), ``why`` and ``fix`` (words). Written only past the ``[swamping]`` lines of
rules/policy/settings.toml.

Version 3 also adds ``decision``, written with the ``divergence`` events of a
check (:mod:`ampaudit.runtime.decision_record`): one per decision site (an argmax/argmin/max(dim)/topk/sort, a
comparison, a round/floor, a bucketize or multinomial on floating values) with module (whose own forward runs the
op), op (aten name, e.g. "topk"), source ("file:line"), kind (index | topk | sort | compare | round | bucket |
sample), decisions (how many were compared: rows for index and topk, elements otherwise, at most 65536 per call of
the elementwise kinds), flipped (how many differ from the FP32 run's, FP32 ties left out), share_flipped, used
(whether the forward reads the result) and calls.

Version 3 also adds ``precursor`` (instability precursors, written by the
watch on its sampled passes, one event per signal, module and interval, like ``stats``;
:mod:`ampaudit.runtime.precursors`): ``signal`` (``attn_logit``: the largest pre-softmax attention logit of the
module whose own code calls softmax or scaled_dot_product_attention; ``output_logit``: the max |logit| of the
model's output, module ""; ``output_lse``: its mean log-sum-exp; ``massive_activation``: the module's |output| max
over its median |x|, with ``absmax``, ``median`` and ``min_abs``; ``value`` None when the median is 0), ``module``,
``value`` (the interval's largest), ``threshold`` (the warning line of rules/policy/precursors.toml when written),
and for the logit signals ``max_step`` (the sampled step the value was seen at), ``crossed_step`` (the first sampled
step at or past ``threshold``, None if none) and ``passes``.

Version 3 also adds ``divergence`` events of scope ``local`` for composite modules and the root (no new field): a
module's own error at every depth, a composite's measured with the submodules it calls computed in FP32 (see
:mod:`ampaudit.runtime.divergence`), on the checks ``composite_divergence_every`` picks. A version-2 trace holds
``local`` events for leaf modules only, with the same meaning; the report judges both the same way
(:mod:`ampaudit.runtime.attribution`), so in a version-2 trace no composite can be named. Besides these, a version-2 trace
is a version-3 trace without the three new kinds.

Version 4 adds, for the layers a plan converted to a low-precision recipe (``ampaudit train --plan``; any recipe
of rules/policy/recipes.toml), ``recipe_stats`` (:mod:`ampaudit.runtime.recipe_stats`, on step 1 and each multiple
of the statistics interval): module, recipe (the layer's current choice), gemms (its GEMMs kept otherwise, e.g.
``{"grad_weight": "bfloat16"}``), ``sqnr_db`` (its output against FP32 of the same layer on the same input, null
when exact), and ``input`` and ``grad_output`` each ``{amax, flushed_share, amax_growth}`` (the share of nonzero
values the recipe's own cast makes 0; amax over the layer's first sampled amax in its current recipe), ``grad_output`` absent when no
gradient reached it; and, with ``--fallback``, ``fallback`` (:mod:`ampaudit.runtime.fallback`): module, from, to
(recipes.toml's ``safer`` of ``from``), reason (sqnr | input_flushed | grad_output_flushed | input_amax_growth |
grad_output_amax_growth), value, limit and why (words); the layer trains in ``to`` from the next step. Under
``--fallback`` an ``fp8_budget`` event's ``fallback`` is false: the ``fallback`` event says what happened. A
version-3 trace is a version-4 trace without the two new kinds.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import IO, Any

from ampaudit.errors import TraceError

# Also the newest version ampaudit report reads (it reads 1 and 2 too); a newer trace is read as far as it is known.
TRACE_VERSION = 4
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
        record = {"event": event, "step": step, **fields}
        self._fh.write(json.dumps(jsonable(record), separators=(",", ":")) + "\n")
        self._fh.flush()

    def close(self) -> None:
        if self._owns and not self._fh.closed:
            self._fh.close()

    def __enter__(self) -> "TraceWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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
        record = {"event": event, "step": step, **fields}
        if self.writer is None or event not in BULK_EVENTS:
            self.events.append(record)
        if self.writer is not None:
            self.writer.write(event, step=step, **fields)

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
