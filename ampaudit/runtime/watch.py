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
``w.events``: ``stats`` per module and phase every ``every`` steps, ``nonfinite`` where inf/NaN first
appears, ``divergence`` every ``divergence_every`` steps, ``skip`` from :meth:`Watch.on_skipped_step`.

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
from ampaudit.runtime.divergence import DivergenceProbe
from ampaudit.runtime.grads import nonfinite_grads
from ampaudit.runtime.locate import module_names, unwrap
from ampaudit.runtime.pass_hooks import NonFiniteError, PassHooks
from ampaudit.runtime.schedule import DivergenceSchedule, check_every
from ampaudit.runtime.stats import StatsAccumulator
from ampaudit.runtime.trace import TRACE_VERSION, TraceWriter

__all__ = ["NonFiniteError", "Watch", "watch"]


class Watch(PassHooks):
    """Hooks on a model that write statistics, non-finite origins and FP32 divergence; see :func:`watch`."""

    def __init__(self, model: nn.Module, trace: str | os.PathLike | TraceWriter | IO[str] | None = None, *,
                 every: int = 50, divergence_every: int | None = None, dtype: torch.dtype = torch.float16,
                 raise_on_nonfinite: bool = False, stats: bool = True, stats_every: int = 8,
                 locate_first: bool = True, max_replays: int = 10, max_events: int = 4,
                 grad_divergence_every: int | None = 8, local_divergence_every: int | None = 2):
        if not isinstance(model, nn.Module):
            raise UsageError(f"watch() needs an nn.Module, got {type(model).__name__}",
                             hint="pass the model (or its DDP wrapper) you train")
        for name, value, optional in (("every", every, False), ("stats_every", stats_every, False),
                                      ("divergence_every", divergence_every, True),
                                      ("grad_divergence_every", grad_divergence_every, True),
                                      ("local_divergence_every", local_divergence_every, True)):
            check_every(name, value, optional=optional)
        if dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise UsageError(f"watch(): dtype must be torch.float16, torch.bfloat16 or torch.float32, got {dtype}",
                             hint="pass the dtype autocast lowers to")
        self.model = model
        self.root = unwrap(model)
        self.dtype = dtype
        self.every, self.divergence_every, self.stats_every = every, divergence_every, stats_every
        self.grad_divergence_every, self.local_divergence_every = grad_divergence_every, local_divergence_every
        self.raise_on_nonfinite, self.stats = raise_on_nonfinite, stats
        # A replay reports the first ``max_events`` origins (forward first); later ones are mostly echoes.
        self.locate_first, self.max_replays, self.max_events = locate_first, max_replays, max_events
        first = next(iter(self.root.parameters()), None)
        self.device_type = first.device.type if first is not None else "cpu"
        self.events: list[dict] = []
        self.step = 0
        self.closed = False
        self._names = module_names(self.root)
        self._acc = StatsAccumulator(dtype)
        self._fslot = {m: self._acc.slot(n, "forward") for m, n in self._names.items()}
        self._bslot = {m: self._acc.slot(n, "backward") for m, n in self._names.items()}
        self._hooked: tuple[torch.Tensor | None, list[int]] = (None, [])
        self._explicit_step = False
        self._forwards = 0
        self._passes = 0
        self._interval_start: int | None = None
        self._last_step: int | None = None
        self._pass_open = False
        self._forward_done = False       # the root's forward returned (else it raised)
        self._sample = False             # this pass gathers per-module statistics
        self._full = False               # ... including exact counts (first sampled pass of an interval)
        self._counts_due = True
        self._suspended = False
        self._replay_state: tuple | None = None
        self._upstream: list[torch.Tensor | None] = []
        self._bw_queued = False
        self._cheap_flags: list[torch.Tensor] = []
        self._lean = False               # this pass ends in the upstream gradient hook (see _on_forward_end)
        self._flag: bool | None = None   # the pass's non-finite flag, once read
        self._probe: DivergenceProbe | None = None      # the check of this pass, if any
        self._schedule = DivergenceSchedule(self.root, self._names, device_type=self.device_type,
                                            every=divergence_every, grad_every=grad_divergence_every,
                                            local_every=local_divergence_every)
        self._replays = 0
        self._replayed_interval: int | None = None
        self._pending_error: NonFiniteError | None = None
        self._writer, self._owns_writer = self._open_writer(trace)
        self._handles: list[Any] = [
            self.root.register_forward_pre_hook(self._on_forward_start, with_kwargs=True)]
        if stats:
            for mod in self._names:
                self._handles.append(mod.register_forward_hook(self._on_module_output))
        self._handles.append(self.root.register_forward_hook(self._on_forward_end))
        if self._writer is None or self._owns_writer:
            self._emit("meta", version=TRACE_VERSION, source="watch", dtype=name_of(dtype),
                       device=self.device_type, model=type(self.root).__name__, every=every,
                       divergence_every=divergence_every, stats_every=stats_every,
                       grad_divergence_every=grad_divergence_every,
                       local_divergence_every=local_divergence_every)

    # --- public loop integration ---------------------------------------------------------------------
    def set_step(self, step: int) -> None:
        """Number the following forwards/backwards ``step`` (else each forward counts as one step)."""
        self._explicit_step = True
        if step != self.step:
            self._maybe_flush(step)
        self.step = int(step)

    def after_backward(self) -> None:
        """Optional: call after ``backward()`` (before the optimizer step) to end the pass explicitly."""
        if self._pass_open and self._upstream:
            self._end_pass()
        self._raise_pending()

    def on_skipped_step(self, scale: float) -> dict:
        """The loss scaler skipped this step: name the parameters (and their modules) with inf/NaN grads.

        Writes a ``skip`` event and returns ``{"params": [...], "modules": [...]}``.
        """
        found = nonfinite_grads(self.root.named_parameters())
        bad, modules = found["params"], found["modules"]
        self._emit("skip", scale=float(scale), params=bad, modules=modules)
        # The step was skipped, so the weights are still those of the pass that overflowed: replay it.
        if bad and not self._pass_open and self._should_replay(True):
            self._suspended = True
            try:
                self._replay()
            finally:
                self._suspended = False
        return {"params": bad, "modules": modules}

    def flush(self) -> None:
        """Write ``stats`` events for the passes completed since the last flush."""
        if not self.stats:
            return
        step = self._last_step if self._last_step is not None else self.step
        for rec in self._acc.drain():
            self._emit("stats", step=step, **rec)
        self._interval_start = None
        self._counts_due = True

    def close(self) -> None:
        """Finish the open pass, flush statistics, remove every hook, close an owned trace file."""
        if self.closed:
            return
        try:
            if self._pass_open:
                self._end_pass()
            self.flush()
        finally:
            self.closed = True
            for h in self._handles:
                h.remove()
            self._handles.clear()
            self._schedule.close()
            self._probe = None
            self._replay_state, self._upstream = None, []
            if self._writer is not None and self._owns_writer:
                self._writer.close()

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

    # --- events --------------------------------------------------------------------------------------
    def _open_writer(self, trace: Any) -> tuple[TraceWriter | None, bool]:
        if trace is None:
            return None, False
        if isinstance(trace, TraceWriter):
            return trace, False
        return TraceWriter(trace), True

    def _emit(self, event: str, step: int | None = None, **fields: Any) -> None:
        step = self.step if step is None and event != "meta" else step
        record = {"event": event, "step": step, **fields}
        # With a trace file, per-interval statistics live there only (they are the bulk of the events).
        if self._writer is None or event != "stats":
            self.events.append(record)
        if self._writer is not None:
            self._writer.write(event, step=step, **fields)


def watch(model: nn.Module, trace: str | os.PathLike | TraceWriter | IO[str] | None = None, *, every: int = 50,
          divergence_every: int | None = None, dtype: torch.dtype = torch.float16,
          raise_on_nonfinite: bool = False, stats: bool = True, stats_every: int = 8,
          locate_first: bool = True, grad_divergence_every: int | None = 8,
          local_divergence_every: int | None = 2) -> Watch:
    """Attach runtime hooks to ``model`` (plain, DDP or DataParallel); use as a context manager or close().

    ``trace``: JSON Lines path, an open ``TraceWriter`` (shared with a trainer; no ``meta`` line is written),
    or None (events only in ``Watch.events``). ``every``: steps per ``stats`` interval. ``divergence_every``:
    steps between FP32 shadow comparisons (None: off; needs autocast and FP32 weights). ``dtype``: the low
    precision the statistics are judged against (headroom, subnormals). ``stats_every``: per-module
    statistics on one pass in this many (1: every pass); the non-finite flag is checked on every pass.
    ``locate_first``: replay the first pass under the op-level locator (finds infs that never leave their
    module).
    ``raise_on_nonfinite``: raise :class:`NonFiniteError` (from the forward or ``backward()`` call) once the
    origin has been written to the trace.

    Every divergence check compares each module's output to FP32 (scope ``global``). The two costlier
    scopes run on some checks only, counted in divergence checks (not steps), starting with the first
    check, which therefore has all three: ``grad_divergence_every`` (default 8: checks 0, 8, 16, ...) pushes
    the upstream gradient through an FP32 graph and compares every parameter gradient (scope ``grad``; the
    other checks shadow the forward only, under no_grad); ``local_divergence_every`` (default 2: checks 0, 2,
    4, ...) re-runs each leaf module in low precision on the FP32 inputs (scope ``local``). 1 = on every
    check (the behaviour before these options), None = never.
    """
    return Watch(model, trace, every=every, divergence_every=divergence_every, dtype=dtype,
                 raise_on_nonfinite=raise_on_nonfinite, stats=stats, stats_every=stats_every,
                 locate_first=locate_first, grad_divergence_every=grad_divergence_every,
                 local_divergence_every=local_divergence_every)
