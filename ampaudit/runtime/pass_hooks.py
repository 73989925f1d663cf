"""What ``ampaudit.watch`` does in each forward and backward pass of the watched model.

:class:`PassHooks` is the half of :class:`~ampaudit.runtime.watch.Watch` that runs inside the training loop:
the root module's forward pre-hook and forward hook, the per-module statistics hooks of sampled passes,
the hook on d loss / d output, and the end of a pass: the non-finite flag, the divergence check's FP32
shadow and the replay under the op-level locator. What one pass knows is a :class:`PassState` (a fresh one
per forward); what the methods read across passes is declared on :class:`PassHooks` and set up by
``Watch.__init__``, which also owns the public API. docs/watch.md explains the costs.

A pass starts at the root's forward and ends where its outcome is known: in the upstream-gradient hook
when nothing else is due (most passes), else once the autograd engine has finished the backward (before
the optimizer can step, so a replay sees this step's weights), or right after a forward without backward.
"""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten

from ampaudit.errors import AmpAuditError
from ampaudit.runtime.decision_record import DecisionCheck
from ampaudit.runtime.divergence import DivergenceProbe
from ampaudit.runtime.grad_hist import GradHistograms
from ampaudit.runtime.locate import describe_nonfinite, judge_against_fp32, judge_against_unscaled, replay
from ampaudit.runtime.memory_guard import warn_backward_unchecked
from ampaudit.runtime.replay_state import capture_rng, float_tensors
from ampaudit.runtime.precursors import PrecursorMeter
from ampaudit.runtime.schedule import DivergenceSchedule
from ampaudit.runtime.stats import StatsAccumulator, any_nonfinite, extremes, key_histogram, nonfinite_now


_NO_HOOKED: tuple = (None, ())      # statistics: no tensor whose gradient hook is shared (see _on_module_output)


class NonFiniteError(AmpAuditError):
    """Raised by a watch created with ``raise_on_nonfinite=True`` when inf/NaN appears."""


@dataclass(slots=True)
class PassState:
    """One forward(+backward) pass of the watched model, from the root's forward pre-hook to its end."""

    step: int | None = None          # the step of its forward (events of a late-ending pass carry it)
    replay: tuple | None = None      # (args, kwargs, rng states, (autocast on, dtype), grad mode): to rerun it
    open: bool = False
    forward_done: bool = False       # the root's forward returned (else it raised)
    sample: bool = False             # gathers per-module statistics
    full: bool = False               # ... including exact counts (first sampled pass of an interval)
    lean: bool = False               # ends in the upstream gradient hook (see _on_forward_end)
    flag: bool | None = None         # the non-finite flag, once read
    probe: DivergenceProbe | None = None    # the divergence check of this pass, if any
    upstream: list = field(default_factory=list)      # d loss / d output, per output
    cheap_flags: list = field(default_factory=list)   # extremes of outputs and upstream gradients, not yet read
    seen_nonfinite: bool = False     # ... or, for CPU tensors, already read (nonfinite_now)
    bw_queued: bool = False          # the end-of-backward callback is queued
    hooked: tuple = _NO_HOOKED       # statistics: the tensor whose gradient hook the last module output got


class PassHooks:
    """Hook methods of ``Watch``. The attributes below are set by ``Watch.__init__``; the methods read no other."""

    # options
    root: nn.Module
    dtype: torch.dtype
    device_type: str
    every: int
    divergence_every: int | None
    stats: bool
    stats_every: int
    precursors_every: int
    raise_on_nonfinite: bool
    locate_first: bool
    max_replays: int
    max_events: int
    # parts
    _acc: StatsAccumulator
    _hist: GradHistograms | None     # log2|gradient| histograms, on full passes (None: off)
    _prec: PrecursorMeter | None     # instability precursors, on sampled passes (None: off)
    _fslot: dict
    _bslot: dict
    _stat_modules: list[nn.Module]   # every module but the root: statistics hooks on sampled passes only
    _module_handles: list            # their handles while a sampled pass is open
    _schedule: DivergenceSchedule
    _decisions: DecisionCheck | None     # decision flips against FP32, on the divergence checks
    _updates: Callable[[int], None] | None   # a step starts: the swamping meter's turn (None: off)
    _pass: PassState
    # across passes
    step: int
    events: list[dict]
    _explicit_step: bool
    _forwards: int
    _passes: int
    _interval_start: int | None
    _counts_due: bool
    _suspended: bool                 # the watch runs the model itself (shadow, replay): hooks stand aside
    _replays: int
    _replayed_interval: int | None
    _pending_error: "NonFiniteError | None"
    _emit: Callable[..., None]           # (event, step=None, **fields): to the event log
    flush: Callable[[], None]            # write the interval's statistics

    def _maybe_flush(self, step: int) -> None:
        if self._interval_start is None:
            self._interval_start = step
        elif step - self._interval_start >= self.every:
            self.flush()
            self._interval_start = step

    # The three hooks below run on every pass: they are written for the common case (one tensor in and
    # out, nothing due), where every attribute lookup and call shows in the step time (docs/watch.md).
    def _on_forward_start(self, mod: nn.Module, args: tuple, kwargs: dict) -> None:
        if self._suspended:
            return
        if self._pass.open:              # the previous forward got no backward
            self._end_pass()
        if self._pending_error is not None:
            self._raise_pending()
        if not self._explicit_step:
            self.step = self._forwards
            self._maybe_flush(self.step)
        elif self._interval_start is None:
            self._interval_start = self.step
        step = self.step
        if self._updates is not None:
            self._updates(step)
        self._forwards += 1
        p = self._pass = PassState(step=step, open=True)
        if self.stats and self._passes % self.stats_every == 0:
            p.sample, p.full = True, self._counts_due
            self._counts_due = False
            self._install_module_hooks()
        # More passes than the statistics' (a quarter of their cost): a growing logit is seen soon after it crosses.
        if self._prec is not None and (p.sample or self._passes % self.precursors_every == 0):
            self._prec.begin_pass(step)
        dt = self.device_type
        amp = (torch.is_autocast_enabled(dt), torch.get_autocast_dtype(dt))
        if dt == "cpu":                  # only the CPU generator matters
            rng = {"cpu": torch.get_rng_state()}
        else:                            # and the generators of the devices the inputs are on
            rng = capture_rng([t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)])
        p.replay = (args, kwargs, rng, amp, torch.is_grad_enabled())
        every = self.divergence_every
        if every is not None and step % every == 0 and amp[0]:
            p.probe = self._schedule.begin(step, *amp)

    def _install_module_hooks(self) -> None:
        # Only a sampled pass has the statistics hooks on the modules below the root: a module with a hook
        # takes nn.Module's slow call path, which unsampled passes (15 in 16 by default) would pay for nothing.
        # They come off when the pass ends (_end_pass), so a recompute during its backward is seen as before.
        if not self._module_handles:
            hook = self._on_module_output
            self._module_handles = [mod.register_forward_hook(hook) for mod in self._stat_modules]

    def _remove_module_hooks(self) -> None:
        handles, self._module_handles = self._module_handles, []
        for h in handles:
            h.remove()

    def _on_module_output(self, mod: nn.Module, args: Any, out: Any) -> None:
        p = self._pass
        if not p.sample or self._suspended or not p.open:
            return
        if self._prec is not None:       # which module makes the model's output (the logits' precursors name it)
            self._prec.producer.observe(mod, args, out)
        # The common case (one tensor) skips pytree flattening: this runs for every module every step.
        outs = (out,) if type(out) is torch.Tensor else float_tensors(out)
        fslot, full = self._fslot[mod], p.full
        for t in outs:
            if not t.is_floating_point():
                continue
            lohi = self._acc.observe(fslot, t, full=full)
            if full and self._prec is not None:
                self._prec.observe_activation(self._acc.names[fslot][0], t, lohi)
            if t.requires_grad:
                if t is p.hooked[0]:
                    # A container returning its child's output: one gradient hook serves both modules.
                    p.hooked[1].append(self._bslot[mod])
                else:
                    slots = [self._bslot[mod]]
                    t.register_hook(self._grad_hook(slots, full, p.step))
                    p.hooked = (t, slots)

    def _grad_hook(self, slots: list[int], full: bool, step: int | None):
        hist = self._hist if full else None

        def hook(grad: torch.Tensor) -> None:
            if not self._suspended and grad is not None and grad.is_floating_point():
                # One histogram of the gradient's magnitude bits, and one cumulative count of it, give both its
                # exact counts and its log2 bins.
                raw = key_histogram(grad) if hist is not None else None
                cum = raw.cumsum(0) if raw is not None else None
                for slot in slots:
                    self._acc.observe(slot, grad, full=full, histogram=raw, cumulative=cum)
                if hist is not None:
                    hist.observe(slots, grad, step, histogram=raw, cumulative=cum)
        return hook

    def _on_forward_end(self, mod: nn.Module, args: tuple, out: Any) -> None:
        p = self._pass
        if self._suspended or not p.open:
            return
        p.hooked, p.forward_done = _NO_HOOKED, True
        outs = [out] if type(out) is torch.Tensor and out.is_floating_point() else float_tensors(out)
        if self._prec is not None and self._prec.active:
            # The root's statistics hook has just read the extremes of its output: the logits' max reuses them.
            self._prec.end_forward(outs, self._acc.extremes_of(outs[0]) if outs and p.sample else None)
        grads = [i for i, o in enumerate(outs) if o.requires_grad] if torch.is_grad_enabled() else []
        if p.probe is not None:
            p.probe.end_forward()        # the FP32 shadow runs at the end of the pass
        if not p.sample:                 # a sampled pass has the root's statistics instead
            # The outputs and, below, d loss / d output: a loss linear in the output (a sum, a policy
            # gradient) passes a NaN output on as a finite gradient.
            for o in outs:
                if o.is_cpu:
                    p.seen_nonfinite = p.seen_nonfinite or nonfinite_now(o)
                elif o.numel():
                    p.cheap_flags.extend(extremes(o))
        if not grads:
            self._end_pass()
            self._raise_pending()
            return
        p.upstream = [None] * len(outs)
        # One output, nothing due at the end of backward (statistics, a divergence check, the first
        # replay) and a CPU model: the pass ends in its gradient hook, as soon as d loss / d output is
        # known, without a callback from the autograd engine. That is the pass of almost every step. On
        # CUDA a read at the start of backward would stall the queue of kernels (the forward's must finish
        # before any backward kernel is queued): there the flag is read once the backward is done, where
        # a GradScaler makes its own read.
        p.lean = (len(grads) == 1 and not p.sample and p.probe is None and self.device_type == "cpu"
                  and bool(self._replays or not self.locate_first))
        if grads == [0]:
            outs[0].register_hook(functools.partial(self._on_upstream_0, p))
        else:
            for i in grads:
                outs[i].register_hook(functools.partial(self._on_upstream, p, i))

    def _on_upstream_0(self, p: PassState, grad: torch.Tensor) -> None:
        self._on_upstream(p, 0, grad)

    def _on_upstream(self, p: PassState, index: int, grad: torch.Tensor) -> None:
        if self._suspended or not p.open:
            return
        p.upstream[index] = grad.detach()
        if not p.sample:
            if grad.is_cpu:
                p.seen_nonfinite = p.seen_nonfinite or nonfinite_now(grad)
            elif grad.numel():
                p.cheap_flags.extend(extremes(grad))
        if p.lean:
            flag = p.flag = p.seen_nonfinite or any_nonfinite(p.cheap_flags)
            if not flag:
                p.open = False
                self._passes += 1
                return
        if not p.bw_queued:
            p.bw_queued = True
            # Runs once the whole backward is done and before the optimizer can step: a replay then
            # still sees this step's weights.
            torch.autograd.Variable._execution_engine.queue_callback(self._end_pass_from_engine)

    def _end_pass_from_engine(self) -> None:
        self._end_pass()
        self._raise_pending()

    # --- end of a forward(+backward) pass ------------------------------------------------------------
    def _end_pass(self) -> None:
        p = self._pass
        if not p.open:
            return
        p.open = False
        self._passes += 1
        if self._module_handles:
            self._remove_module_hooks()
        # A pass can end after the loop moved on (a forward that raised ends at the next forward): its
        # events carry the step of its own forward.
        now, self.step = self.step, p.step if p.step is not None else self.step
        try:
            self._close_pass(p)
        finally:
            self.step = now

    def _close_pass(self, p: PassState) -> None:
        if not p.forward_done:
            # The forward raised: replay it (the locator names where, as a kind "error" event); there is
            # nothing to compare with FP32.
            bad = [("", "")]
            self._acc.end_pass(full=False)
            if self._prec is not None:
                self._prec.abort()
            if p.probe is not None:
                p.probe, probe = None, p.probe
                probe.close()
        elif p.sample:          # the root's slots already cover its outputs and the upstream gradient
            bad = self._acc.end_pass(full=p.full)
            if p.full and self._hist is not None:
                self._hist.end_pass(p.step)
        else:
            # The extremes of the model's outputs and of the upstream gradient (read already on a lean pass).
            # An overflow that starts inside backward shows up in the per-module gradient statistics of the
            # next sampled pass, or in on_skipped_step; checking every parameter gradient on every pass would
            # cost more than the rest of this path together.
            flag = p.flag if p.flag is not None else p.seen_nonfinite or any_nonfinite(p.cheap_flags)
            bad = [("", "")] if flag else []
        with self.suspended():
            if p.probe is not None:
                self._finish_divergence(p)
            if self._should_replay(bool(bad)):
                self._replay(proactive=not bad)
        if bad and self.raise_on_nonfinite and self._pending_error is None:
            located = [e for e in self.events if e["event"] == "nonfinite" and e["step"] == self.step]
            what = (describe_nonfinite(located[0]) if located
                    else f"inf/NaN in {', '.join(sorted({m for m, _ in bad}))}")
            self._pending_error = NonFiniteError(f"step {self.step}: {what}",
                                                 hint="see the nonfinite events of the trace; keep that "
                                                      "module in fp32 or use bf16")

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """Hooks stand aside while the model runs for something other than a training pass: the watch's own FP32
        shadow and locator replays, or the caller's evaluation."""
        before, self._suspended = self._suspended, True
        try:
            yield
        finally:
            self._suspended = before

    @property
    def replaying(self) -> bool:
        """True while the watch runs the model itself (FP32 shadow, locator replay) and sets autocast on its own."""
        return self._suspended

    def _finish_divergence(self, p: PassState) -> None:
        probe, p.probe = p.probe, None
        args, kwargs, rng, (_, amp_dtype), _ = p.replay
        for ev in self._schedule.finish(probe, args, kwargs, rng, p.upstream):
            self._emit("divergence", **ev)
        if self._decisions is not None:
            for ev in self._decisions.check(args, kwargs, rng, amp_dtype, step=self.step):
                self._emit("decision", **ev)

    def _should_replay(self, bad: bool) -> bool:
        if self._pass.replay is None or self._replays >= self.max_replays:
            return False
        if self._replays == 0 and self.locate_first:
            return True
        return bad and self._replayed_interval != self._interval_start

    def _replay(self, *, proactive: bool = False, scale: float | None = None) -> None:
        """Locate inf/NaN in the pass just ended. ``proactive``: nothing tripped the flag (the first pass,
        replayed to find an inf that never leaves its module): only infs an FP32 replay of the pass does not
        have count there (one FP32 also makes is the model's own, and the pass ended finite). ``scale``: the loss
        scale the pass carried, when the caller knows it better than :meth:`_loss_scale_now`."""
        p = self._pass
        args, kwargs, rng, (amp_on, amp_dtype), grad_mode = p.replay
        self._replays += 1
        self._replayed_interval = self._interval_start
        upstream = p.upstream if grad_mode and any(g is not None for g in p.upstream) else None
        kw = dict(device_type=self.device_type, dtype=amp_dtype if amp_on else self.dtype, rng_state=rng,
                  upstream=upstream, max_events=self.max_events)
        found = replay(self.root, args, kwargs, autocast=amp_on, **kw)
        if not found.backward_checked:
            warn_backward_unchecked(self.step)
        if amp_on:
            # Judged against FP32: an inf the same pass also makes in FP32 is the model's own, not precision's.
            found = judge_against_fp32(self.root, found, args, kwargs, **kw)
            # A backward overflow the unscaled gradient does not have is the loss scaler probing, not a fault.
            found = judge_against_unscaled(self.root, found, args, kwargs, scale=scale or self._loss_scale_now(),
                                           autocast=True, **kw)
        if proactive:
            found = [ev for ev in found if not ev.get("fp32_too")]
        else:
            # Infs FP32 has too (and maybe masks) go after those only low precision makes: the first names the cause.
            found.sort(key=lambda ev: bool(ev.get("fp32_too")))
        found.sort(key=lambda ev: bool(ev.get("scaled_only")))   # the scaler's own overflows last
        for ev in found:
            self._emit("nonfinite", **ev)
        faults = [ev for ev in found if not ev.get("scaled_only")]
        if faults and self.raise_on_nonfinite and self._pending_error is None:
            self._pending_error = NonFiniteError(f"step {self.step}: {describe_nonfinite(faults[0])}",
                                                 hint="keep that module in fp32 (ampaudit.keep_fp32) or use bf16")

    def _loss_scale_now(self) -> float | None:
        """The loss scale the pass just ended carried: the loop's GradScaler, else the one the caller said for
        this step (``set_loss_scale``); None when unknown (no verdict on the scaler then)."""
        scaler = getattr(self, "_scaler", None)
        if scaler is not None and getattr(scaler, "is_enabled", lambda: True)():
            return float(scaler.get_scale())
        said = getattr(self, "_loss_scale", None)
        return said[1] if said is not None and said[0] == self.step else None

    def _raise_pending(self) -> None:
        err, self._pending_error = self._pending_error, None
        if err is not None:
            raise err
