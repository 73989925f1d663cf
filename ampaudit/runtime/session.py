"""A :class:`~ampaudit.runtime.watch.Watch` driven by a training loop's hooks: the one owner of a watched
training run's trace, shared by the Lightning and Hugging Face callbacks and by ``ampaudit.train.Trainer``.
The callbacks only translate their framework's hooks into these calls:

    session = WatchSession(trace="run.jsonl", every=50, divergence_every=500)
    session.start(model, dtype=torch.float16, integration="lightning")
    # per optimizer step (micro-batches of one step share its number):
    session.begin_step(step)                  # before the first forward of the step
    session.add_loss(loss)                    # each micro-batch's loss (a tensor is read once, at end_step)
    session.before_optimizer_step(scaled=True)   # gradients complete, not clipped: per-parameter norms
    session.end_step(skipped=False, scale=65536.0, lr=1e-3)   # writes the `step` event; a skip names the culprits
    session.close()                           # flush statistics, remove hooks, then on_close(events) if given

The trainer measures the gradient norm itself (it clips) and writes its own events:

    session = WatchSession(trace, every=50, memory=False)      # trace None: no watch, every call a no-op
    session.start(model, dtype=torch.float16, source="train", step=0, append=resumed, meta={...})
    session.begin_step(step); ...; session.skip(scale, named, model_grads=True)   # on a skipped step
    session.write_step(loss=0.5, scale=65536.0, skipped=False, grad_norm=1.2, clipped=False, lr=1e-3)
    session.write("checkpoint", step=step, path="ckpt/last.pt")
    session.close_watch(); session.write("halt", step=step, ...)   # the watch's statistics go before the halt
    session.close()

On the steps the statistics sample, in-place updates of low-precision state that round away are measured
(``swamping`` events, :mod:`ampaudit.runtime.swamping`; the trainer adds its optimizer and FP32 masters with
``session.measure_updates(optimizer=..., mastered=..., names=...)``).
Everything the watch finds (``stats``, ``nonfinite``, ``divergence``, ``skip``, ``precursor``), the ``step`` events
and, when the model holds torchao Float8Linear layers (a plan's), their ``fp8`` / ``fp8_budget`` events, and for a
plan's low-precision layers ``recipe_stats`` and, with ``fp8_fallback``, ``fallback`` events (those meters:
:mod:`ampaudit.runtime.layer_meters`) go to one trace: the JSON Lines file ``trace``, an open :class:`TraceWriter`
(not closed here), or memory (``session.events``) when ``trace`` is None and ``memory`` is True.
"""
from __future__ import annotations

import contextlib
import math
import os
import time
from pathlib import Path
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.nn as nn

from ampaudit.dtypes import name_of
from ampaudit.runtime.grads import from_flags, is_sharded, nonfinite_grads, param_grad_norms  # noqa: F401
from ampaudit.runtime.trace import MemoryTrace, TraceWriter, read_trace
from ampaudit.runtime.trace_schema import meta as trace_meta

if TYPE_CHECKING:
    from ampaudit.runtime.layer_meters import LayerMeters
    from ampaudit.runtime.swamping import SwampMeter
    from ampaudit.runtime.watch import Watch


def _float(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return float(value.item() if value.numel() == 1 else value.detach().float().mean().item())
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


class SessionViews:
    """What both framework callbacks expose about their :class:`WatchSession` (held as ``self.session``)."""

    session: "WatchSession"

    @property
    def events(self) -> list[dict]:
        """Every event of the run so far (read back from the trace file when there is one)."""
        return self.session.events

    @property
    def skips(self) -> list[dict]:
        """One ``{"step", "params", "modules"}`` per step the scaler skipped."""
        return self.session.skips


class WatchSession:
    """One watched training run: a :class:`Watch` plus ``step`` events; see the module docstring.

    ``trace``: a JSON Lines path, an open :class:`TraceWriter` (shared, not closed here), or None: events in
    memory (:attr:`events`) when ``memory``, else no watch and no events (``active`` stays False; the trainer on
    DDP ranks other than 0, or without ``trace=``). ``fp8_fallback``: a plan's low-precision layer that leaves
    its budget trains in the next safer recipe from the next step (:mod:`ampaudit.runtime.fallback`; a
    Float8Linear the plan did not convert: in bf16, logged in its ``fp8_budget`` event). ``plan_file``: the plan
    the fallback rewrites atomically on each switch.
    """

    def __init__(self, trace: str | os.PathLike | TraceWriter | None = None, *, every: int = 50,
                 divergence_every: int | None = None, raise_on_nonfinite: bool = False, stats: bool = True,
                 grad_norm_every: int | None = None, on_close: Callable[[list[dict]], Any] | None = None,
                 memory: bool = True, fp8_fallback: bool = False, replays: bool = True,
                 stats_every: int | None = None, plan_file: str | os.PathLike | None = None):
        self.trace = trace
        self.replays, self.stats_every = replays, stats_every
        self.memory = memory
        self.every, self.divergence_every = every, divergence_every
        self.raise_on_nonfinite, self.stats = raise_on_nonfinite, stats
        # The norms cost one pass over every gradient. With a loss scaler they are taken every step (a skipped
        # step is attributed from them); without one, every `grad_norm_every` steps (default: `every`).
        self.grad_norm_every = grad_norm_every or every
        self.on_close = on_close    # given the run's events after the trace is closed (TensorBoard's writer)
        self.fp8_fallback, self.plan_file = fp8_fallback, plan_file
        self.watch: Watch | None = None
        self.layers: LayerMeters | None = None      # fp8 and recipe statistics, the fallback (with the statistics)
        self._recipe_state: dict | None = None
        self.swamp: SwampMeter | None = None
        self._model: nn.Module | None = None
        self.writer: TraceWriter | None = None
        self._owns_writer = False
        self._memory: MemoryTrace | None = None     # the events of a run kept in memory (trace None)
        self._step: int | None = None
        self._t0: float | None = None
        self._losses: list[Any] = []
        self._norms: tuple[list[str], torch.Tensor | None, float] = ([], None, 1.0)
        self._params: list[tuple[str, nn.Parameter]] = []
        self._sharded = False
        self._first_step: int | None = None
        self.skips: list[dict] = []
        self._pauses: list[bool] = []

    @property
    def active(self) -> bool:
        """Whether the watch is attached and steps are recorded (the trainer measures the norm only then)."""
        return self.watch is not None

    def start(self, model: nn.Module, *, dtype: torch.dtype, integration: str | None = None,
              source: str = "watch", step: int | None = None, append: bool = False,
              meta: dict[str, Any] | None = None, **fields: Any) -> None:
        """Open the trace, write its ``meta`` line and attach the watch to ``model``.

        ``integration`` (a callback's framework): the session describes the run itself (dtype, device, model,
        every, divergence_every); without it ``meta`` (a dict: its keys may clash with these parameters' names)
        and ``fields`` are the whole description. ``step``: the meta line's step. ``append``: a resumed or
        continued run extends a non-empty trace file (or a shared writer) without a second meta line.
        """
        if self.writer is not None:
            self.close()
        if self.trace is None and not self.memory:
            return
        if self.trace is None:
            self._memory = MemoryTrace()
            self.writer, self._owns_writer = self._memory, False
        elif isinstance(self.trace, TraceWriter):
            self.writer, self._owns_writer = self.trace, False
        else:
            path = Path(self.trace)
            append = append and path.is_file() and path.stat().st_size > 0
            self.writer, self._owns_writer = TraceWriter(path, append=append), True
        self._params = list(model.named_parameters())
        # FSDP: rank 0's shards give no global gradient norm, and name only the inf/NaN they hold (end_step).
        self._sharded = any(is_sharded(p) for _, p in self._params)
        self._first_step = None
        if not append:
            self.writer.write_record(self._meta(model, dtype, integration, source, step, {**(meta or {}), **fields}))
        # Imported here: `import ampaudit.train` stays lean for library use without a trace.
        from ampaudit.runtime.watch import Watch

        # Given an open writer, the watch adds its events to our trace and writes no second meta line.
        options: dict[str, Any] = {} if self.replays else {"locate_first": False, "max_replays": 0}
        if self.stats_every is not None:
            options["stats_every"] = self.stats_every
        # The session measures swamping itself (the trainer gives it the optimizer and the masters), not the watch.
        self.watch = Watch(model, self.writer, every=self.every, divergence_every=self.divergence_every,
                           dtype=dtype, raise_on_nonfinite=self.raise_on_nonfinite, stats=self.stats,
                           swamping=False, **options)
        if self.stats:
            from ampaudit.runtime.layer_meters import LayerMeters

            self.layers = LayerMeters.attach(model, self.writer, every=self.every, fp8_fallback=self.fp8_fallback,
                                             plan_file=self.plan_file, recipe_state=self._recipe_state,
                                             skip=lambda: self.watch is not None and self.watch.replaying)
            self._model = model
            self.measure_updates()

    def _meta(self, model: nn.Module, dtype: torch.dtype, integration: str | None, source: str, step: int | None,
              given: dict[str, Any]) -> dict:
        first = self._params[0][1] if self._params else None
        run = {"dtype": name_of(dtype), "device": first.device.type if first is not None else "cpu",
               "model": type(model).__name__}
        if integration is not None:     # a callback's run: the session's own settings describe it too
            run.update(integration=integration, every=self.every, divergence_every=self.divergence_every)
        return trace_meta(source, step=step, **{**run, **given})

    def recipe_state(self) -> dict | None:
        """What a checkpoint keeps of the recipe statistics (their first-step amaxes), or None."""
        return self.layers.recipe_state() if self.layers is not None else self._recipe_state

    def restore_recipe_state(self, state: dict | None) -> None:
        """Restore :meth:`recipe_state` from a checkpoint (before :meth:`start`, which applies it)."""
        self._recipe_state = state
        if self.layers is not None and state:
            self.layers.restore_recipe_state(state)

    def measure_updates(self, *, optimizer: torch.optim.Optimizer | None = None,
                        mastered: list[torch.Tensor] | tuple = (), names: dict[int, str] | None = None,
                        o2: bool = False) -> None:
        """Measure swamping (:mod:`ampaudit.runtime.swamping`) of the model's low-precision state on the steps
        the statistics sample: ``optimizer``'s states too, less the ``mastered`` parameters (an FP32 master takes
        their updates); ``names``: id(optimizer parameter) -> parameter name; ``o2``: the run casts the model itself
        (the fixes say so). :meth:`start` measures the model's
        parameters and buffers alone; the trainer calls this after it with its optimizer and masters."""
        if self.watch is None or not self.stats:
            return
        from ampaudit.runtime.swamping import SwampMeter

        if self.swamp is not None:
            self.swamp.abort()
        self.swamp = SwampMeter(self._model, optimizer=optimizer, mastered=mastered, names=names, o2=o2,
                                skip=lambda: self.watch is not None and self.watch.replaying)

    def begin_step(self, step: int, scale: float | None = None) -> None:
        """Number what follows ``step``; the step's clock starts at its first micro-batch. ``scale``: the loss
        scale its backward will carry (the watch tells the scaler's own overflows from faults by it)."""
        if self.watch is None:
            return
        if self._first_step is None:
            self._first_step = step
        if self._step != step or self._t0 is None:
            self._step, self._t0 = step, time.perf_counter()
            self._losses, self._norms = [], ([], None, 1.0)
            # Swamping is measured over the whole step (forward, backward, optimizer, in-place updates), on the
            # steps the statistics sample: the first and one per `every`.
            if self.swamp is not None and (step == self._first_step or step % self.every == 0):
                self.swamp.begin(step)
        self.watch.set_step(step)
        if scale:
            self.watch.set_loss_scale(scale)
        if self.layers is not None:
            self.layers.begin_step(step)

    def due(self, step: int) -> bool:
        """Whether the watch wants to see ``step``'s passes: the first step, one per ``every``, the divergence
        checks and the fp8 samples (a compiled trainer runs those steps eagerly)."""
        if self.watch is None:
            return False
        dv = self.divergence_every
        return (step == self._first_step or step % self.every == 0 or (dv is not None and step % dv == 0)
                or (self.layers is not None and self.layers.sampled(step)))

    def set_hooks(self, on: bool) -> None:
        """Attach (``on``) or detach the watch's module hooks, e.g. around passes of a compiled model, which
        would otherwise trace them into its graph."""
        if self.watch is not None:
            self.watch.set_hooks(on)

    def add_loss(self, loss: Any) -> None:
        if self.watch is not None and loss is not None:
            self._losses.append(loss.detach() if isinstance(loss, torch.Tensor) else loss)

    def before_optimizer_step(self, *, scaled: bool = False, grad_scale: float | None = None) -> None:
        """Gradients are complete and not yet clipped: take each parameter's gradient norm (one fused pass, kept
        on the device) when due. ``scaled``: a loss scaler may skip this step (norms are then taken every step).
        ``grad_scale``: the loss scale still in the gradients (they are divided by it)."""
        if self.watch is None or self._step is None:
            return
        if scaled or self._step % self.grad_norm_every == 0:
            names, norms = param_grad_norms(self._params)
            self._norms = (names, norms, float(grad_scale) if grad_scale else 1.0)

    def end_step(self, *, skipped: bool, scale: float | None, lr: float | None = None,
                 clipped_at: float | None = None, loss: Any = None) -> dict | None:
        """Write the ``step`` event (``scale``: the loss scale the step ran with; ``clipped_at``: the clipping
        norm, if any; ``loss`` replaces the mean of :meth:`add_loss`'s losses). On a skipped step, also write a
        ``skip`` event naming the parameters (and their modules) whose gradients were not finite, and return it."""
        if self.watch is None or self._step is None:
            return None
        step = self._step
        losses = [_float(x) for x in ([loss] if loss is not None else self._losses)]
        losses = [x for x in losses if x is not None]
        names, norms, divisor = self._norms
        norm = None
        if norms is not None and not self._sharded:
            norm = float(torch.linalg.vector_norm(norms).item()) / divisor
        attribution = None
        if skipped:
            attribution = from_flags(names, ~torch.isfinite(norms)) if norms is not None else \
                {"params": [], "modules": []}
            scope = {"scope": "rank 0's shards"} if self._sharded else {}
            self.writer.write("skip", step=step, scale=scale, **attribution, **scope)
            self.skips.append({"step": step, **attribution})
        clipped: bool | None = False
        if clipped_at:      # unknown on steps whose norm was not measured, or was not finite
            clipped = norm > clipped_at if norm is not None and math.isfinite(norm) else None
        self.write_step(loss=sum(losses) / len(losses) if losses else None, scale=scale, skipped=skipped,
                        grad_norm=norm, clipped=clipped, lr=lr)
        return attribution

    def write_step(self, *, loss: float | None, scale: float | None, skipped: bool, grad_norm: float | None,
                   clipped: bool | None, lr: float | None) -> None:
        """Write the ``step`` event from what the caller measured itself (the trainer clips, so it has the norm);
        ``time`` is the session's clock since :meth:`begin_step`."""
        if self.watch is None or self._step is None:
            return
        elapsed = time.perf_counter() - self._t0 if self._t0 is not None else None
        if self.layers is not None:     # the step's fp8 and recipe events go before its `step` line
            self.layers.end_step(self._step)
        if self.swamp is not None and self.swamp.active:   # the optimizer has stepped: the step's updates are in
            for event in self.swamp.finish():
                self.writer.write("swamping", **event)
            for event in self.swamp.overflows:
                self.writer.write("state_overflow", **event)
        # The scale this step's gradients carried, for its grad_hist events; no scale is no scaler: 1.
        self.watch.set_loss_scale(scale or 1.0)
        self.writer.write("step", step=self._step, loss=loss, scale=scale, skipped=bool(skipped),
                          grad_norm=grad_norm, clipped=clipped, lr=lr, time=elapsed)
        self._t0, self._losses, self._norms = None, [], ([], None, 1.0)

    def skip(self, scale: float | None, named: list[tuple[str, torch.Tensor]], *,
             model_grads: bool, found: dict[str, list[str]] | None = None) -> dict[str, list[str]]:
        """The loss scaler skipped the current step, whose gradients the caller holds (the trainer): write the
        ``skip`` event and return ``{"params", "modules"}`` with non-finite gradients.

        ``model_grads``: the gradients still sit on the watched model (O1), where the watch names them and
        replays the overflowing pass to locate it; else (O2: on the FP32 masters) those of ``named`` are named.
        Without a watch nothing is written, but the attribution is still returned (a halt diagnosis needs it).
        ``found``: the attribution the caller already joined across ranks (sharded gradients), used as is.
        """
        if self.watch is not None and model_grads:
            info = self.watch.on_skipped_step(scale, found=found) or {}
            found = {"params": list(info.get("params", [])), "modules": list(info.get("modules", []))}
        else:
            found = found if found is not None else nonfinite_grads(named)
            self.write("skip", step=self._step, scale=scale, **found)
        if self.watch is not None:
            self.skips.append({"step": self._step, **found})
        return found

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """A context in which the model runs outside the watched training passes (the trainer's evaluation, the
        recompute of checkpointed activations) unseen by the watch."""
        if self.watch is None:
            yield
            return
        self._pauses.append(self.replaying)    # a pause inside a replay is still part of that replay
        try:
            with self.watch.suspended():
                yield
        finally:
            self._pauses.pop()

    @property
    def replaying(self) -> bool:
        """Whether the watch is re-running the model on this rank alone (its locator replay, the FP32 shadow):
        a module that talks to the other ranks (SyncBatchNorm) must not then."""
        if self.watch is None or not self.watch.replaying:
            return False
        return not self._pauses or self._pauses[-1]

    def write(self, event: str, step: int | None = None, **fields: Any) -> None:
        """Write an event of the caller's own (the trainer's ``checkpoint`` and ``halt``) while the trace is open."""
        if self.writer is not None:
            self.writer.write(event, step=step, **fields)

    @property
    def events(self) -> list[dict]:
        """Every event so far (from memory, or read back from the trace file), as a list of the caller's own."""
        memory = self.trace if isinstance(self.trace, MemoryTrace) else self._memory
        if memory is not None:
            return list(memory.events)
        path = self.trace.path if isinstance(self.trace, TraceWriter) else self.trace
        if path is not None and os.path.isfile(path):
            return read_trace(path)[0]
        return []

    def close_watch(self) -> None:
        """Flush the watch's statistics and remove its hooks; the trace stays open for :meth:`write`."""
        watch, self.watch = self.watch, None
        layers, self.layers = self.layers, None
        if layers is not None:
            if layers.recipes is not None:
                self._recipe_state = layers.recipe_state()
            layers.close()
        swamp, self.swamp = self.swamp, None
        if swamp is not None:
            swamp.abort()
        if watch is not None:
            watch.close()

    def close(self) -> None:
        """Flush statistics, remove the hooks, close the trace (unless shared); then call ``on_close`` with the
        events (the integrations' TensorBoard logs)."""
        if self.writer is None:
            return
        try:
            self.close_watch()
        finally:
            writer, self.writer = self.writer, None
            if self._owns_writer:
                writer.close()
        if self.on_close is not None:
            self.on_close(self.events)
