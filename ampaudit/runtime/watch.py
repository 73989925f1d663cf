"""``ampaudit.watch``: where fp16/bf16 hurts, in any training loop.

    with ampaudit.watch(model, trace="run.jsonl", every=50, divergence_every=500) as w:
        for step, (x, y) in enumerate(loader):
            w.set_step(step)                       # optional: else each forward is a step
            with torch.autocast("cuda", dtype=torch.float16):
                loss = loss_fn(model(x), y)
            scaler.scale(loss).backward()
            ...

``w = ampaudit.watch(...)`` / ``w.close()`` works too; ``close`` removes every hook. DDP/DataParallel
models are unwrapped for naming. Events go to the JSON Lines trace (``ampaudit.runtime.trace``) and to
``w.events``: ``stats`` per module and phase every ``every`` steps, ``grad_hist`` (log2|gradient| per module,
:mod:`ampaudit.runtime.grad_hist`) with them, ``nonfinite`` where inf/NaN first appears, ``divergence`` every
``divergence_every`` steps with ``decision`` (decision ops against FP32: :mod:`ampaudit.runtime.decision_record`),
``skip`` from :meth:`Watch.on_skipped_step`, ``precursor`` (instability precursors, one pass in 8:
attention and output logits, massive activations; :mod:`ampaudit.runtime.precursors`) with the statistics,
and, for a model holding low-precision state (``model.half()``), ``swamping`` and ``state_overflow`` on the
sampled steps (:mod:`ampaudit.runtime.swamping`: in-place updates that round away, and state beyond its range,
a BatchNorm running_var past fp16's 65504).
Pass ``scaler=scaler`` (or call
:meth:`Watch.set_loss_scale`) so the histograms know the loss scale in the gradients.

A :class:`Watch` is made of its parts: the hook methods run in each pass (:class:`~ampaudit.runtime.pass_hooks.
PassHooks`, with one :class:`~ampaudit.runtime.pass_hooks.PassState` per pass), the statistics accumulator
(:class:`~ampaudit.runtime.stats.StatsAccumulator`), the divergence schedule
(:class:`~ampaudit.runtime.schedule.DivergenceSchedule`), the event log (:class:`~ampaudit.runtime.trace.EventLog`)
and the hook handles. ``watch`` is the class itself, so its signature is written once.

What each hook costs and why (the non-finite flag on every pass, sampled statistics, replays under the
op-level locator, the divergence schedule), with measured numbers: docs/watch.md.
Inputs must not be modified in place between forward and backward (they are kept by reference).
"""
from __future__ import annotations

import os
from typing import IO, Any

import torch
import torch.nn as nn

from ampaudit.dtypes import name_of
from ampaudit.errors import UsageError
from ampaudit.runtime.grad_hist import GradHistograms
from ampaudit.runtime.grads import is_sharded, nonfinite_grads
from ampaudit.runtime.module_stack import module_names
from ampaudit.wrappers import unwrap
from ampaudit.runtime.pass_hooks import NonFiniteError, PassHooks, PassState
from ampaudit.runtime.decision_record import DecisionCheck
from ampaudit.runtime.precursors import PrecursorMeter
from ampaudit.runtime.schedule import DivergenceSchedule, check_every
from ampaudit.runtime.stats import StatsAccumulator
from ampaudit.runtime.trace import EventLog, TraceWriter
from ampaudit.runtime.trace_schema import meta as trace_meta

__all__ = ["NonFiniteError", "Watch", "watch"]


def _refuse_bad_options(model: Any, dtype: Any, max_replays: Any, **every_options: Any) -> None:
    """Raise :class:`UsageError` for a watch() argument it cannot run with (``every_options``: the ``*every``
    and ``max_events`` counts by name)."""
    if not isinstance(model, nn.Module):
        raise UsageError(f"watch() needs an nn.Module, got {type(model).__name__}",
                         hint="pass the model (or its DDP wrapper) you train")
    for name, value in every_options.items():
        check_every(name, value, optional=name not in ("every", "stats_every", "precursors_every", "max_events"))
    if isinstance(max_replays, bool) or not isinstance(max_replays, int) or max_replays < 0:
        raise UsageError(f"watch(): max_replays must be an integer >= 0, got {max_replays!r}",
                         hint="0 turns the locator replays off")
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise UsageError(f"watch(): dtype must be torch.float16, torch.bfloat16 or torch.float32, got {dtype}",
                         hint="pass the dtype autocast lowers to")


class Watch(PassHooks):
    """Runtime hooks on ``model`` (plain, DDP or DataParallel); use as a context manager or call :meth:`close`.

    ``trace``: JSON Lines path, an open ``TraceWriter`` (shared with a trainer; no ``meta`` line is written),
    or None (events only in ``Watch.events``). ``every``: steps per ``stats`` interval. ``divergence_every``:
    steps between FP32 shadow comparisons (None: off; needs autocast and FP32 weights). ``dtype``: the low
    precision the statistics are judged against (headroom, subnormals). ``stats_every``: per-module
    statistics on one pass in this many (1: every pass); the non-finite flag is checked on every pass.
    ``precursors_every``: the instability precursors (below) on one pass in this many, and on every sampled pass.
    ``locate_first``: replay the first pass under the op-level locator (finds infs that never leave their
    module). ``max_replays``: locator replays in all (the first, then one per interval with inf/NaN);
    ``max_events``: origins reported per replay (forward first; later ones are mostly echoes).
    ``raise_on_nonfinite``: raise :class:`NonFiniteError` (from the forward or ``backward()`` call) once the
    origin has been written to the trace. ``grad_hist``: on the pass that takes the exact counts (the first
    sampled pass of each interval) also count each module's output gradient by ``floor(log2|g|)`` (a ``grad_hist``
    event per module and interval). ``scaler``: the ``torch.amp.GradScaler`` of the loop, read once per such pass
    for the loss scale those gradients carry; without one, :meth:`set_loss_scale` says it (else it is unknown).
    ``precursors``: on the passes ``precursors_every`` picks also record the largest attention logit per module
    (softmax and scaled_dot_product_attention calls), the output logits' max and log-sum-exp, and on the counting
    pass each module's |output| max over its median (``precursor`` events per signal, module and interval).
    ``swamping``: on the first step and one per ``every``, from that step's first forward to the next step's,
    re-run in FP32 each in-place write into low-precision parameters and buffers (``swamping`` and
    ``state_overflow`` events); nothing is entered for a model without low-precision state.

    Every divergence check compares each module's output to FP32 (scope ``global``). The two costlier
    scopes run on some checks only, counted in divergence checks (not steps), starting with the first
    check, which therefore has all three: ``grad_divergence_every`` (default 8: checks 0, 8, 16, ...) pushes
    the upstream gradient through an FP32 graph and compares every parameter gradient (scope ``grad``; the
    other checks shadow the forward only, under no_grad); ``local_divergence_every`` (default 2: checks 0, 2,
    4, ...) measures each module's own error (scope ``local``): every leaf re-run in low precision on the FP32
    inputs; ``composite_divergence_every`` (default 8: checks 0, 8, 16, ...; only on checks with the local
    scope) adds every composite, the root included, re-run with the modules it calls computed in FP32, so its
    own code (what it does between and around its children) is measured too. A composite's re-run costs an FP32
    forward of its subtree, one forward per nesting level in all, so the first such check re-runs every
    composite and the later ones one nesting depth each in turn (about one FP32 forward per check).
    1 = on every check, None = never.
    """

    def __init__(self, model: nn.Module, trace: str | os.PathLike | TraceWriter | IO[str] | None = None, *,
                 every: int = 50, divergence_every: int | None = None, dtype: torch.dtype = torch.float16,
                 raise_on_nonfinite: bool = False, stats: bool = True, stats_every: int = 16,
                 locate_first: bool = True, max_replays: int = 10, max_events: int = 4,
                 grad_divergence_every: int | None = 8, local_divergence_every: int | None = 2,
                 composite_divergence_every: int | None = 8, grad_hist: bool = True, scaler: Any = None,
                 precursors: bool = True, precursors_every: int = 8, swamping: bool = True):
        _refuse_bad_options(model, dtype, max_replays, every=every, stats_every=stats_every,
                            precursors_every=precursors_every,
                            max_events=max_events, divergence_every=divergence_every,
                            grad_divergence_every=grad_divergence_every,
                            local_divergence_every=local_divergence_every,
                            composite_divergence_every=composite_divergence_every)
        # Options.
        self.model, self.root, self.dtype = model, unwrap(model), dtype
        self.every, self.divergence_every, self.stats_every = every, divergence_every, stats_every
        self.precursors_every = precursors_every
        self.raise_on_nonfinite, self.stats = raise_on_nonfinite, stats
        self.locate_first, self.max_replays, self.max_events = locate_first, max_replays, max_events
        first = next(iter(self.root.parameters()), None)
        self.device_type = first.device.type if first is not None else "cpu"
        if any(is_sharded(p) for p in self.root.parameters()):
            # FSDP: a forward gathers parameters from every rank, so this process cannot rerun one alone.
            if divergence_every is not None:
                raise UsageError("watch(): divergence checks rerun the model in FP32 in this process alone, which a "
                                 "sharded (FSDP) model cannot do", hint="drop divergence_every for sharded models")
            self.locate_first, self.max_replays = False, 0
        # Parts.
        self._names = module_names(self.root)
        self._acc = StatsAccumulator(dtype)
        self._hist = GradHistograms(scaler) if stats and grad_hist else None
        # The scale a replay divides out (PassHooks): the scaler's, else (step, scale) from set_loss_scale.
        self._scaler, self._loss_scale = scaler, None
        self._prec = PrecursorMeter(self.root, dtype) if stats and precursors else None
        self._fslot = {m: self._acc.slot(n, "forward") for m, n in self._names.items()}
        self._bslot = {m: self._acc.slot(n, "backward") for m, n in self._names.items()}
        self._schedule = DivergenceSchedule(self.root, self._names, device_type=self.device_type,
                                            every=divergence_every, grad_every=grad_divergence_every,
                                            local_every=local_divergence_every,
                                            composite_every=composite_divergence_every)
        # Decisions (argmax, topk, x > t, round, ...) against FP32, on the same checks: ``decision`` events.
        self._decisions = (DecisionCheck(self.root, device_type=self.device_type)
                           if divergence_every is not None else None)
        self._log = EventLog(trace)
        self._swamp, self._swamp_last = None, None
        if stats and swamping:
            from ampaudit.runtime.swamping import SwampMeter

            self._swamp = SwampMeter(self.root, skip=lambda: self.replaying)
        self._updates = self._measure_updates if self._swamp is not None else None
        self.events = self._log.events
        self._pass = PassState()
        # Across passes.
        self.step = 0
        self.closed = False
        self._explicit_step = False
        self._forwards = 0
        self._passes = 0
        self._interval_start: int | None = None
        self._counts_due = True
        self._suspended = False
        self._replays = 0
        self._replayed_interval: int | None = None
        self._pending_error: NonFiniteError | None = None
        self._handles: list[Any] = []
        self._stat_modules = [m for m in self._names if m is not self.root]
        self._module_handles: list[Any] = []     # the statistics hooks of the sampled pass now open
        self.set_hooks(True)
        if self._log.writes_meta:
            self._log.emit_record(trace_meta(
                "watch", dtype=name_of(dtype), device=self.device_type, model=type(self.root).__name__,
                every=every, divergence_every=divergence_every, stats_every=stats_every,
                precursors_every=precursors_every if self._prec is not None else None,
                grad_divergence_every=grad_divergence_every, local_divergence_every=local_divergence_every,
                composite_divergence_every=composite_divergence_every))

    # --- public loop integration ---------------------------------------------------------------------
    def set_hooks(self, on: bool) -> None:
        """Attach (``on``) or detach every module hook; the statistics so far are kept. Passes run while
        detached are not seen at all (a compiled model's: its graph must not trace the hooks)."""
        if not on or self.closed:
            self._remove_module_hooks()
            for h in self._handles:
                h.remove()
            self._handles.clear()
            return
        if self._handles:
            return
        # First of the root's pre-hooks: a replay calls the root, which runs the user's pre-hooks again, so it
        # must start from the caller's arguments and RNG, not from what a pre-hook already made of them.
        self._handles.append(self.root.register_forward_pre_hook(self._on_forward_start, with_kwargs=True,
                                                                 prepend=True))
        if self.stats:
            # The root's own statistics hook stays (the root's hooks run on every pass anyway); the other
            # modules get theirs only for a sampled pass (PassHooks._install_module_hooks).
            self._handles.append(self.root.register_forward_hook(self._on_module_output))
        self._handles.append(self.root.register_forward_hook(self._on_forward_end))
        if self._pass.open and self._pass.sample:      # re-attached inside a sampled pass
            self._install_module_hooks()

    def set_step(self, step: int) -> None:
        """Number the following forwards/backwards ``step`` (else each forward counts as one step)."""
        self._explicit_step = True
        if step != self.step:
            self._maybe_flush(step)
        self.step = int(step)

    def after_backward(self) -> None:
        """Optional: call after ``backward()`` (before the optimizer step) to end the pass explicitly."""
        if self._pass.open and self._pass.upstream:
            self._end_pass()
        self._raise_pending()

    def set_loss_scale(self, scale: float) -> None:
        """The loss scale the backward of one step carries: the step of the pass now open, else the step numbered
        by :meth:`set_step`, else the next forward's. Said before that backward, a replay of the step's pass tells
        the scaler's own overflows from faults by it; a step it was not said for has no scale (a loop's scaler
        may have moved since), so its overflows get no such verdict. ``grad_hist`` events record it (there a
        step with none takes the latest). Not needed with ``scaler=``."""
        p = self._pass
        step = p.step if p.open and p.step is not None else self.step if self._explicit_step else self._forwards
        self._loss_scale = (step, float(scale))
        if self._hist is not None:
            self._hist.note_scale(float(scale), step)

    def on_skipped_step(self, scale: float, found: dict | None = None) -> dict:
        """The loss scaler skipped this step: name the parameters (and their modules) with inf/NaN grads.

        Writes a ``skip`` event and returns ``{"params": [...], "modules": [...]}``. ``found``: that
        attribution already made by the caller (sharded gradients, joined across ranks).
        """
        found = found if found is not None else nonfinite_grads(self.root.named_parameters())
        bad, modules = found["params"], found["modules"]
        self._emit("skip", scale=float(scale), params=bad, modules=modules)
        # The step was skipped, so the weights are still those of the pass that overflowed: replay it.
        if bad and not self._pass.open and self._should_replay(True):
            with self.suspended():
                self._replay(scale=float(scale))
        return {"params": bad, "modules": modules}

    def flush(self) -> None:
        """Write ``stats`` events for the passes completed since the last flush."""
        if not self.stats:
            return
        step = self._pass.step if self._pass.step is not None else self.step
        for rec in self._acc.drain():
            self._emit("stats", step=step, **rec)
        if self._prec is not None:
            for rec in self._prec.drain():
                self._emit("precursor", step=step, **rec)
        if self._hist is not None:
            for rec in self._hist.drain(self._acc.names):
                self._emit("grad_hist", **rec)
        self._interval_start = None
        self._counts_due = True

    def close(self) -> None:
        """Finish the open pass, flush statistics, remove every hook, close an owned trace file."""
        if self.closed:
            return
        try:
            if self._pass.open:
                self._end_pass()
            self._finish_updates()
            self.flush()
        finally:
            self.closed = True
            self._remove_module_hooks()
            for h in self._handles:
                h.remove()
            self._handles.clear()
            if self._prec is not None:
                self._prec.abort()
            if self._swamp is not None:
                self._swamp.abort()
            self._schedule.close()
            self._pass = PassState()       # drops the last pass's inputs and gradients
            self._log.close()

    def __enter__(self) -> "Watch":
        return self

    def __exit__(self, exc_type: Any, *exc: object) -> None:
        self.close()
        if exc_type is None:
            self._raise_pending()

    @property
    def nonfinite(self) -> list[dict]:
        """``nonfinite`` events so far, in order."""
        return [e for e in self.events if e["event"] == "nonfinite"]

    @property
    def divergence(self) -> list[dict]:
        """``divergence`` events so far, in order."""
        return [e for e in self.events if e["event"] == "divergence"]

    def _measure_updates(self, step: int) -> None:
        """A forward of ``step`` starts: the measured step before it is over (its optimizer has stepped), and a
        sampled step (the first, one per ``every``) is measured from here."""
        meter = self._swamp
        if meter.active and meter.step != step:
            self._finish_updates()
        if not meter.active and step != self._swamp_last and (self._swamp_last is None or step % self.every == 0):
            self._swamp_last = step
            meter.begin(step)

    def _finish_updates(self) -> None:
        if self._swamp is None or not self._swamp.active:
            return
        for ev in self._swamp.finish():
            self._emit("swamping", **ev)
        for ev in self._swamp.overflows:
            self._emit("state_overflow", **ev)

    def _emit(self, event: str, step: int | None = None, **fields: Any) -> None:
        self._log.emit(event, self.step if step is None else step, **fields)


watch = Watch
