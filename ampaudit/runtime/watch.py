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

Cost model (why it stays cheap):
- Every pass: the min/max of the model's outputs and of the upstream gradient, on the device; once per
  pass (at the end of backward, via the autograd engine's final callback, or right after a forward that has
  no backward) ONE boolean is read: "did inf/NaN appear?" (a GradScaler makes the same single sync). On
  sampled passes the per-module statistics feed the same flag; a skipped step (``on_skipped_step``) also
  triggers a replay, since its weights are unchanged.
- One pass in ``stats_every``: a forward hook per module and a gradient hook per module output queue
  on-device statistics (``stats.StatsAccumulator``): absmax, and on the first such pass of each interval
  exact counts (zeros, subnormal, inf, NaN, ...). Nothing is read back per tensor; an interval's statistics
  are read once, by ``flush``. Reading every activation and gradient costs about as much memory traffic as
  an elementwise op per module: on the ~8 ms CPU step of samples/char_transformer.py (bf16, one thread),
  statistics on every pass cost ~20% and exact counts ~150% of a step (bench/watch_overhead.py), hence
  the sampling (``stats_every=1`` for every pass).
- The inputs, autocast settings and RNG state of each forward are kept by reference, and the upstream
  gradient (d loss / d output) of each backward. When the flag trips (and on the first pass, which catches
  an inf that never leaves its module, like an overflowing x**3 inside a GELU), that pass is *replayed*
  under the op-level locator (``locate.replay``) before the optimizer can step: the exact module, aten op
  and source line, forward and backward. Replays are limited to one per stats interval.
- Divergence checks run every ``divergence_every`` steps (``divergence``). The real forward records a sample
  of each module's output; the FP32 shadow forward runs at the end of the pass (after backward, when the
  real activations are freed, before the optimizer step) and compares each module (scope ``global``). Only
  every ``grad_divergence_every``-th check (default 4) keeps the FP32 graph and pushes the real upstream
  gradient through it (scope ``grad``, an FP32 backward: the costliest part); only every
  ``local_divergence_every``-th (default 2) re-runs each leaf module in low precision on its FP32 inputs
  (scope ``local``; modules autocast leaves in FP32, like norms and activations, need no re-run). On the
  sample transformer (CPU, one thread, ~7 ms bf16 step) a forward-only check took ~5.5 ms, one with local
  re-runs ~8 ms and one with every scope ~23 ms; amortized over 50 steps see bench/watch_overhead.py.
Inputs must not be modified in place between forward and backward (they are kept by reference).
"""
from __future__ import annotations

import functools
import math
import os
from typing import IO, Any

import torch
import torch.nn as nn

from ampaudit.errors import AmpAuditError, UsageError
from ampaudit.runtime.divergence import DivergenceProbe
from ampaudit.runtime.locate import float_tensors, capture_rng, module_names, replay, unwrap
from ampaudit.runtime.stats import StatsAccumulator, extremes
from ampaudit.runtime.trace import TRACE_VERSION, TraceWriter

__all__ = ["NonFiniteError", "Watch", "watch"]


class NonFiniteError(AmpAuditError):
    """Raised by a watch created with ``raise_on_nonfinite=True`` when inf/NaN appears."""


def _describe(ev: dict) -> str:
    where = ev["module"] or "the top module"
    op = f" ({ev['op']})" if ev.get("op") else ""
    src = f" at {ev['source']}" if ev.get("source") else ""
    return f"{ev['phase']} {ev['kind']} first produced in {where}{op}{src}"


class Watch:
    """Hooks on a model that write statistics, non-finite origins and FP32 divergence; see :func:`watch`."""

    def __init__(self, model: nn.Module, trace: str | os.PathLike | TraceWriter | IO[str] | None = None, *,
                 every: int = 50, divergence_every: int | None = None, dtype: torch.dtype = torch.float16,
                 raise_on_nonfinite: bool = False, stats: bool = True, stats_every: int = 8,
                 locate_first: bool = True, max_replays: int = 10, max_events: int = 4,
                 grad_divergence_every: int | None = 4, local_divergence_every: int | None = 2):
        if not isinstance(model, nn.Module):
            raise UsageError(f"watch() needs an nn.Module, got {type(model).__name__}",
                             hint="pass the model (or its DDP wrapper) you train")
        for name, value in (("every", every), ("stats_every", stats_every)):
            if not isinstance(value, int) or value < 1:
                raise UsageError(f"watch(): {name} must be a positive integer, got {value!r}")
        if divergence_every is not None and (not isinstance(divergence_every, int) or divergence_every < 1):
            raise UsageError(f"watch(): divergence_every must be a positive integer or None, "
                             f"got {divergence_every!r}")
        for name, value in (("grad_divergence_every", grad_divergence_every),
                            ("local_divergence_every", local_divergence_every)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise UsageError(f"watch(): {name} must be a positive integer or None, got {value!r}",
                                 hint="it counts divergence checks: 1 = on every check")
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
        self._probe: DivergenceProbe | None = None
        self._last_div_step: int | None = None
        self._div_checks = 0             # divergence checks begun: picks the ones with grad / local scopes
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
            self._emit("meta", version=TRACE_VERSION, source="watch", dtype=str(dtype).replace("torch.", ""),
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
        named = [(n, p.grad) for n, p in self.root.named_parameters() if p.grad is not None]
        bad: list[str] = []
        if named:
            flags = torch.stack([~torch.isfinite(g).all() for _, g in named]).tolist()
            bad = [n for (n, _), f in zip(named, flags) if f]
        modules = sorted({n.rsplit(".", 1)[0] if "." in n else "" for n in bad})
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
            if self._probe is not None:
                self._probe.close()
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

    # --- hooks ---------------------------------------------------------------------------------------
    def _maybe_flush(self, step: int) -> None:
        if self._interval_start is None:
            self._interval_start = step
        elif step - self._interval_start >= self.every:
            self.flush()
            self._interval_start = step

    def _on_forward_start(self, mod: nn.Module, args: tuple, kwargs: dict) -> None:
        if self._suspended:
            return
        if self._pass_open:              # the previous forward got no backward
            self._end_pass()
        self._raise_pending()
        if not self._explicit_step:
            self.step = self._forwards
            self._maybe_flush(self.step)
        elif self._interval_start is None:
            self._interval_start = self.step
        self._forwards += 1
        self._last_step = self.step
        self._sample = self.stats and self._passes % self.stats_every == 0
        self._full = self._sample and self._counts_due
        if self._full:
            self._counts_due = False
        dt = self.device_type
        amp = (torch.is_autocast_enabled(dt), torch.get_autocast_dtype(dt))
        tensors = [a for a in args if isinstance(a, torch.Tensor)] if not kwargs else float_tensors((args, kwargs))
        self._replay_state = (args, kwargs, capture_rng(tensors), amp, torch.is_grad_enabled())
        self._upstream, self._bw_queued, self._cheap_flags = [], False, []
        self._lean, self._flag = False, None
        self._pass_open = True
        due = (self.divergence_every is not None and self.step % self.divergence_every == 0
               and self.step != self._last_div_step and amp[0])
        if due:
            self._last_div_step = self.step
            check, self._div_checks = self._div_checks, self._div_checks + 1
            grads = self.grad_divergence_every is not None and check % self.grad_divergence_every == 0
            local = self.local_divergence_every is not None and check % self.local_divergence_every == 0
            self._probe = DivergenceProbe(self.root, device_type=dt, dtype=amp[1],
                                          local="leaves" if local else False, names=self._names)
            self._probe.begin(capture_grads=grads and torch.is_grad_enabled())

    def _on_module_output(self, mod: nn.Module, args: Any, out: Any) -> None:
        if not self._sample or self._suspended or not self._pass_open:
            return
        # The common case (one tensor) skips pytree flattening: this runs for every module every step.
        outs = (out,) if type(out) is torch.Tensor else float_tensors(out)
        fslot, full = self._fslot[mod], self._full
        for t in outs:
            if not t.is_floating_point():
                continue
            self._acc.observe(fslot, t, full=full)
            if t.requires_grad:
                if t is self._hooked[0]:
                    # A container returning its child's output: one gradient hook serves both modules.
                    self._hooked[1].append(self._bslot[mod])
                else:
                    slots = [self._bslot[mod]]
                    t.register_hook(self._grad_hook(slots))
                    self._hooked = (t, slots)

    def _grad_hook(self, slots: list[int]):
        def hook(grad: torch.Tensor) -> None:
            if not self._suspended and grad is not None and grad.is_floating_point():
                for slot in slots:
                    self._acc.observe(slot, grad, full=self._full)
        return hook

    def _on_forward_end(self, mod: nn.Module, args: tuple, out: Any) -> None:
        if self._suspended or not self._pass_open:
            return
        self._hooked = (None, [])
        outs = [out] if type(out) is torch.Tensor and out.is_floating_point() else float_tensors(out)
        grads = [i for i, o in enumerate(outs) if o.requires_grad] if torch.is_grad_enabled() else []
        if self._probe is not None:
            self._probe.end_forward()    # the FP32 shadow runs at the end of the pass
        if not self._sample:             # a sampled pass has the root's statistics instead
            # The outputs and, below, d loss / d output: a loss linear in the output (a sum, a policy
            # gradient) passes a NaN output on as a finite gradient.
            self._cheap_flags.extend(v for o in outs if o.numel() for v in extremes(o))
        if not grads:
            self._end_pass()
            self._raise_pending()
            return
        self._upstream = [None] * len(outs)
        # One output, nothing due at the end of backward (statistics, a divergence check, the first
        # replay): the pass ends in its gradient hook, as soon as d loss / d output is known, without a
        # callback from the autograd engine. That is the pass of almost every step.
        self._lean = (len(grads) == 1 and not self._sample and self._probe is None
                      and not (self.locate_first and self._replays == 0))
        for i in grads:
            outs[i].register_hook(functools.partial(self._on_upstream, i))

    def _on_upstream(self, index: int, grad: torch.Tensor) -> None:
        if self._suspended or not self._pass_open:
            return
        self._upstream[index] = grad.detach()
        if grad.numel() and not self._sample:
            self._cheap_flags.extend(extremes(grad))
        if self._lean:
            self._flag = self._nonfinite_flag()
            if not self._flag:
                self._pass_open = False
                self._passes += 1
                return
        if not self._bw_queued:
            self._bw_queued = True
            # Runs once the whole backward is done and before the optimizer can step: a replay then
            # still sees this step's weights.
            torch.autograd.Variable._execution_engine.queue_callback(self._end_pass_from_engine)

    def _end_pass_from_engine(self) -> None:
        self._end_pass()
        self._raise_pending()

    # --- end of a forward(+backward) pass ------------------------------------------------------------
    def _end_pass(self) -> None:
        if not self._pass_open:
            return
        self._pass_open = False
        self._passes += 1
        if self._sample:      # the root's slots already cover its outputs and the upstream gradient
            bad = self._acc.end_pass(full=self._full)
        else:
            flag = self._flag if self._flag is not None else self._nonfinite_flag()
            bad = [("", "")] if flag else []
        self._suspended = True
        try:
            if self._probe is not None:
                self._finish_divergence()
            if self._should_replay(bool(bad)):
                self._replay()
        finally:
            self._suspended = False
        if bad and self.raise_on_nonfinite and self._pending_error is None:
            located = [e for e in self.events if e["event"] == "nonfinite" and e["step"] == self.step]
            what = _describe(located[0]) if located else f"inf/NaN in {', '.join(sorted({m for m, _ in bad}))}"
            self._pending_error = NonFiniteError(f"step {self.step}: {what}",
                                                 hint="see the nonfinite events of the trace; keep that "
                                                      "module in fp32 or use bf16")

    @property
    def replaying(self) -> bool:
        """True while the watch runs the model itself (FP32 shadow, locator replay) and sets autocast on its own."""
        return self._suspended

    def _nonfinite_flag(self) -> bool:
        # The extremes of the model's outputs and of the upstream gradient. An overflow that starts inside
        # backward shows up in the per-module gradient statistics of the next sampled pass, or in
        # on_skipped_step; checking every parameter gradient on every pass would cost more than the rest of
        # this path together.
        flags = self._cheap_flags
        if not flags:
            return False
        device = flags[0].device.type
        if device == "cpu":
            # A CPU read costs no synchronisation: reading each extreme beats any kernel that combines
            # them (in a training loop each small op costs 10-30 us on CPU, cold caches, more than its data).
            return not all(math.isfinite(f.item()) for f in flags)
        stacked = torch.stack(flags)
        if device == "mps":                    # no float64 there
            return not bool(torch.isfinite(stacked).all())
        # One read (one synchronisation): a float64 sum of the extremes is finite exactly when they all
        # are (inf - inf gives NaN).
        return not math.isfinite(stacked.sum(dtype=torch.float64).item())

    def _finish_divergence(self) -> None:
        probe, self._probe = self._probe, None
        saved_args, saved_kwargs, rng, _, _ = self._replay_state
        grads = probe.capture_grads and any(g is not None for g in self._upstream)
        try:
            # After backward (the real activations are freed) and before the optimizer step. Without the
            # gradient scope the shadow runs under no_grad: no FP32 graph is kept.
            probe.shadow(saved_args, saved_kwargs, rng_state=rng, grad=grads)
            if grads:
                probe.grads(self._upstream)
            for ev in probe.events():
                self._emit("divergence", **ev)
        finally:
            probe.close()

    def _should_replay(self, bad: bool) -> bool:
        if self._replay_state is None or self._replays >= self.max_replays:
            return False
        if self._replays == 0 and self.locate_first:
            return True
        return bad and self._replayed_interval != self._interval_start

    def _replay(self) -> None:
        args, kwargs, rng, (amp_on, amp_dtype), grad_mode = self._replay_state
        self._replays += 1
        self._replayed_interval = self._interval_start
        upstream = self._upstream if grad_mode and any(g is not None for g in self._upstream) else None
        found = replay(self.root, args, kwargs, device_type=self.device_type,
                       dtype=amp_dtype if amp_on else self.dtype, autocast=amp_on, rng_state=rng,
                       upstream=upstream, max_events=self.max_events)
        for ev in found:
            self._emit("nonfinite", **ev)
        if found and self.raise_on_nonfinite and self._pending_error is None:
            self._pending_error = NonFiniteError(f"step {self.step}: {_describe(found[0])}",
                                                 hint="keep that module in fp32 (ampaudit.keep_fp32) or use bf16")

    def _raise_pending(self) -> None:
        err, self._pending_error = self._pending_error, None
        if err is not None:
            raise err


def watch(model: nn.Module, trace: str | os.PathLike | TraceWriter | IO[str] | None = None, *, every: int = 50,
          divergence_every: int | None = None, dtype: torch.dtype = torch.float16,
          raise_on_nonfinite: bool = False, stats: bool = True, stats_every: int = 8,
          locate_first: bool = True, grad_divergence_every: int | None = 4,
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
    check, which therefore has all three: ``grad_divergence_every`` (default 4: checks 0, 4, 8, ...) pushes
    the upstream gradient through an FP32 graph and compares every parameter gradient (scope ``grad``; the
    other checks shadow the forward only, under no_grad); ``local_divergence_every`` (default 2: checks 0, 2,
    4, ...) re-runs each leaf module in low precision on the FP32 inputs (scope ``local``). 1 = on every
    check (the behaviour before these options), None = never.
    """
    return Watch(model, trace, every=every, divergence_every=divergence_every, dtype=dtype,
                 raise_on_nonfinite=raise_on_nonfinite, stats=stats, stats_every=stats_every,
                 locate_first=locate_first, grad_divergence_every=grad_divergence_every,
                 local_divergence_every=local_divergence_every)
