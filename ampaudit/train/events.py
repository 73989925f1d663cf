"""The trainer's side of a trace: the JSON Lines writer, its own events, and the ``watch`` hooks.

The trainer writes ``meta``, ``step``, ``skip``, ``checkpoint`` and ``halt``; ``ampaudit.runtime.watch``, given the
same writer, adds ``stats``, ``nonfinite`` and ``divergence``. Every method is a no-op when there is no trace
(library use without ``trace=``, or a DDP rank other than 0), so the loop calls them unconditionally.

    trace = TrainTrace("run.jsonl", model, dtype=torch.float16, every=50, divergence_every=500)
    trace.open(step=0, append=False, meta={...})
    trace.set_step(1); ...; trace.write("step", step=1, loss=0.5, ...)
    trace.close()
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from ampaudit.runtime.trace import TRACE_VERSION, TraceWriter
from ampaudit.runtime.grads import nonfinite_grads


class TrainTrace:
    """Writer plus optional watch hooks for one training run."""

    def __init__(self, target: str | Path | TraceWriter | None, model: nn.Module, *, dtype: torch.dtype,
                 every: int, divergence_every: int | None = None):
        self._target, self._model, self._dtype, self._every = target, model, dtype, every
        self._divergence_every = divergence_every
        self._writer: TraceWriter | None = None
        self._owns = False
        self._watch: Any = None

    @property
    def active(self) -> bool:
        """Whether events are being written (the trainer computes the gradient norm only then, or to clip)."""
        return self._writer is not None

    def open(self, *, step: int, append: bool, meta: dict[str, Any]) -> None:
        """Open the writer and attach the hooks; a continued run appends to a non-empty file without a new meta."""
        if self._target is None:
            return
        if isinstance(self._target, TraceWriter):
            self._writer, self._owns = self._target, False
        else:
            path = Path(self._target)
            append = append and path.is_file() and path.stat().st_size > 0
            self._writer, self._owns = TraceWriter(path, append=append), True
        if not append:
            self._writer.write("meta", step=step, version=TRACE_VERSION, source="train", **meta)
        self._watch = self._start_watch()

    def _start_watch(self) -> Any:
        from ampaudit.runtime.watch import watch

        return watch(self._model, trace=self._writer, every=self._every, dtype=self._dtype, stats=True,
                     divergence_every=self._divergence_every)

    def write(self, event: str, step: int | None = None, **fields: Any) -> None:
        if self._writer is not None:
            self._writer.write(event, step=step, **fields)

    def set_step(self, step: int) -> None:
        if self._watch is not None:
            self._watch.set_step(step)

    def skip(self, step: int, scale: float | None, named: list[tuple[str, torch.Tensor]], *,
             model_grads: bool) -> tuple[list[str], list[str]]:
        """Name the parameters/modules with non-finite gradients and write the ``skip`` event.

        ``model_grads``: the gradients still sit on the model's parameters (O1), where the watch looks for them;
        under O2 they moved to the masters in ``named``.
        """
        if self._watch is not None and model_grads:
            info = self._watch.on_skipped_step(scale) or {}
            return list(info.get("params", [])), list(info.get("modules", []))
        found = nonfinite_grads(named)
        params, modules = found["params"], found["modules"]
        self.write("skip", step=step, scale=scale, params=params, modules=modules)
        return params, modules

    def close_watch(self) -> None:
        """Detach the hooks, flushing their pending statistics."""
        watch, self._watch = self._watch, None
        if watch is not None:
            watch.close()

    def close(self) -> None:
        try:
            self.close_watch()
        finally:
            if self._writer is not None and self._owns:
                self._writer.close()
            self._writer = None
