"""The mixed-precision training loop, in the canonical order, with the usual failure modes designed out.

One optimizer step = one window of ``accum`` micro-batches (per rank)::

    for each micro-batch:  autocast forward -> loss / accum -> scaler.scale(loss).backward()   (no_sync but last)
    at the boundary:       [O2: grads to FP32 masters] -> unscale_ once -> clip in fp32 once -> scaler.step
                           -> [stepped: masters to model, scheduler.step] -> scaler.update -> zero_grad(None)

    with Trainer(model, loss_fn, train_data, dtype="float16", opt_level="O1", accum=4, clip_norm=1.0,
                 checkpoint_dir="ckpt", checkpoint_every=100, trace="run.jsonl") as trainer:
        result = trainer.fit(steps=1000, resume=True)
    torch.save(trainer.model.state_dict(), "final.pt")
    trainer = Trainer(model, loss_fn, train_data, config=TrainConfig(dtype="float16", accum=4))  # settings as one value

Under ``torchrun`` the ``with`` block is all a script needs: the trainer joins the process group (gloo on CPU,
nccl on CUDA), wraps the model in DDP, and on leaving waits for every rank and leaves the group it joined.
``fsdp=True`` shards it with FSDP2 instead (:mod:`ampaudit.train.fsdp`: fp32 shards are the master weights,
sharded checkpoints through DCP) after a precision preflight (:mod:`ampaudit.train.preflight`); ``compile=True``
(or a backend name, e.g. ``"aot_eager"``) runs the forward through ``torch.compile``; the watch sees only the
steps it samples, which run eagerly. The model goes through activation checkpointing, compile and FSDP/DDP in
that order (:mod:`ampaudit.train.transforms`; ``trainer.transforms`` lists what was applied).

``train_data`` is a function returning an iterable of ``(inputs, target)`` (inputs: a Tensor, a tuple of them, or a
dict of keyword arguments); ``loss_fn(output, target)`` returns a scalar. ``optimizer`` is a factory called with the
parameters to optimize (the FP32 masters under O2; default AdamW), ``scheduler`` a factory called with the optimizer.
A run that keeps skipping steps raises :class:`~ampaudit.errors.TrainingHalted` after writing a checkpoint and a
diagnosis; SIGINT/SIGTERM end the run after the current step with a checkpoint (``result.stopped`` names the signal).
``fp8_fallback=True`` (with a trace) switches a plan's layer that leaves its budget to a safer recipe
(:mod:`ampaudit.runtime.fallback`), rewriting ``plan_file`` when given.
"""
from __future__ import annotations

import contextlib
import functools
import gc
import json
import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from ampaudit.dtypes import name_of, parse_train_dtype
from ampaudit.errors import TrainError, TrainingHalted, UsageError
from ampaudit.fileio import atomic_write_text
from ampaudit.train import ddp
from ampaudit.train import fsdp as fsdp_lib
from ampaudit.train import transforms
from ampaudit.train.checkpoint import DIAGNOSIS, HALTED
from ampaudit.train.clip import clip_gradients
from ampaudit.train.config import TrainConfig, from_keywords
from ampaudit.train.data import as_factory, resolve_device, split_batch
from ampaudit.train.diagnosis import describe, halt_diagnosis
from ampaudit.train.masters import check_opt_level
from ampaudit.train.progress import TrainProgress
from ampaudit.train.setup import TrainerSetup, check_options
from ampaudit.train.state import TrainerState

DEFAULT_HALT_DIR = Path("ampaudit-halt")   # where a halt checkpoint goes when no checkpoint_dir was given


@dataclass
class TrainResult:
    """What :meth:`Trainer.fit` did. ``stopped``: "steps", "epochs", "SIGINT" or "SIGTERM"."""

    steps: int
    skipped: int
    loss: float | None
    scale: float | None
    stopped: str
    checkpoint: Path | None = None
    losses: list[float] = field(default_factory=list)


def _leaves_group_on_error(init: Callable) -> Callable:
    """A constructor that fails after joining the process group leaves it again (a preflight refusal, a bad
    optimizer): the caller never owned that group and could not tear it down."""
    @functools.wraps(init)
    def wrapper(self: "Trainer", *args: Any, **kwargs: Any) -> None:
        try:
            init(self, *args, **kwargs)
        except BaseException:
            if getattr(self, "dist", None) is not None:
                ddp.teardown(self.dist)
            raise
    return wrapper


class Trainer(TrainerSetup, TrainerState):
    """Mixed-precision trainer: O1/O2, loss-scale policy, clipping, accumulation, DDP/FSDP, checkpoints.

    ``config``: a :class:`~ampaudit.train.config.TrainConfig`; keyword arguments are its fields, set on top of it
    (``Trainer(model, loss_fn, data, dtype="bfloat16", accum=4)``; ``scaler_options={...}`` sets the scale policy's).
    """

    @_leaves_group_on_error
    def __init__(self, model: nn.Module, loss_fn: Callable[[Any, Any], torch.Tensor], train_data: Any, *,
                 config: TrainConfig | None = None, **options: Any):
        cfg = self.config = from_keywords(config, options)
        self.dtype = parse_train_dtype(cfg.dtype)
        self.opt_level = check_opt_level(cfg.opt_level)
        self._clip_mode, self._clip_max = check_options(
            opt_level=self.opt_level, accum=cfg.accum, clip_norm=cfg.clip_norm, clip_value=cfg.clip_value,
            clip_mode=cfg.clip_mode, checkpoint_every=cfg.checkpoint_every, trace_every=cfg.trace_every,
            divergence_every=cfg.divergence_every, fsdp=cfg.fsdp, fp8_fallback=cfg.fp8_fallback,
            eval_every=cfg.eval_every)
        self.accum = cfg.accum
        self._loss_fn = loss_fn
        self._checkpoint_dir = Path(cfg.checkpoint_dir) if cfg.checkpoint_dir is not None else None
        self._meta = dict(cfg.meta or {})
        self.device = resolve_device(cfg.device)
        self.fsdp = bool(cfg.fsdp)
        self.reduce_dtype = parse_train_dtype(cfg.reduce_dtype)
        self.dist = ddp.setup(self.device.type, group=self.fsdp)
        if self.device.type == "cuda" and self.dist.enabled:
            self.device = torch.device("cuda", self.dist.local_rank)
        self._autocast = self.dtype != torch.float32
        factory = as_factory(train_data)
        model, units = self._prepare(model, factory)
        self._transform(model, units)
        self.model = model
        self._build_step(model, factory)
        self._build_watch(model, factory, loss_fn)

    def close(self, *, sync: bool = True) -> None:
        """End the run's distributed state: wait for every rank (``sync``: skip it when this rank failed
        alone, since the others may never come), drop the DDP wrapper (its reducer must not outlive the process
        group) and leave the group if this trainer joined it. Safe to call twice; ``with Trainer(...) as t``
        calls it, syncing unless the block raised something other than a halt (every rank halts together)."""
        if sync and self.dist.enabled and self._sync_on_close:
            # No rank may tear the process group down while another still uses it (gloo aborts the process).
            ddp.barrier(self.dist)
        self._wrapped, self._sync_on_close = self.model, False
        if self._compiled:          # the caller's model runs as it did before the trainer compiled it
            transforms.uncompile(self.model)
        if self.dist.enabled or self.dist.joined:       # a group of one (FSDP in one process) is left too
            gc.collect()        # the DDP reducer goes now, while the process group it talks to still exists
            ddp.teardown(self.dist)

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(sync=exc is None or isinstance(exc, TrainingHalted))

    # -- the loop ----------------------------------------------------------------------------------------------
    def fit(self, steps: int | None = None, *, epochs: int | None = None, resume: bool = False) -> TrainResult:
        """Train for ``steps`` optimizer steps (in total, counting resumed ones) or ``epochs`` passes over the data.

        ``resume=True`` continues from ``checkpoint_dir/last.pt`` when it exists (else starts fresh). With a
        ``checkpoint_dir``, the state at the end (steps reached, data exhausted, or a signal) is saved there too.
        """
        if (steps is None) == (epochs is None):
            raise UsageError("give either steps or epochs", hint="e.g. steps=1000 or epochs=3")
        if (steps is not None and steps < 1) or (epochs is not None and epochs < 1):
            raise UsageError(f"steps/epochs must be >= 1, got {steps if steps is not None else epochs}")
        self._stream.epochs = epochs
        resumed = False
        if resume:
            if self._checkpoint_dir is None:
                raise UsageError("resume needs a checkpoint directory", hint="pass checkpoint_dir=DIR with resume=True")
            resumed = self.load_checkpoint()
        # a resumed or continued run extends its trace
        self.session.start(self.model, dtype=self.dtype, source="train", step=self.step,
                           append=resumed or self.step > 0, meta=self._trace_meta())
        # Swamping: the optimizer's states are measured too, and O2's masters hold their parameters' updates.
        self.session.measure_updates(optimizer=self.optimizer, names={id(t): n for n, t in self._named},
                                     mastered=self.masters.mastered if self.masters is not None else [],
                                     o2=self.opt_level == "O2")
        if self.preflight and not resumed:
            self.session.write("preflight", step=self.step, checks=[c.to_dict() for c in self.preflight])
        losses: list[float] = []
        stopped = "steps" if steps is not None else "epochs"
        checkpoint: Path | None = None
        try:
            with self._signals, TrainProgress(steps, enabled=self.config.progress and self.dist.is_main,
                                              completed=self.step) as bar:
                while steps is None or self.step < steps:
                    loss = self._train_step()
                    if loss is None:
                        break
                    losses.append(loss)
                    bar.update(self.step, loss=loss, scale=self.scaler.get_scale(), skipped=self.scaler.total_skips)
                    halt = self.scaler.halt_reason()
                    if halt:
                        self._halt(halt, loss)
                    if self.evaluator is not None and self.evaluator.due(self.step):
                        self._evaluate()
                    if self.config.checkpoint_every and self.step % self.config.checkpoint_every == 0:
                        checkpoint = self.save_checkpoint()
                    if self._signals.signum is not None:
                        stopped = self._signals.name
                        break
                if self._checkpoint_dir is not None and self._saved_step != self.step:
                    checkpoint = self.save_checkpoint()   # the end state too, so --resume can extend a run
        finally:
            self.session.close()
        return TrainResult(steps=self.step, skipped=self.scaler.total_skips, loss=losses[-1] if losses else None,
                           scale=self.scaler.get_scale(), stopped=stopped, checkpoint=checkpoint, losses=losses)

    def _train_step(self) -> float | None:
        """One optimizer step; None when the data ran out (the partial window is dropped)."""
        step = self.step + 1
        self.session.begin_step(step, self.scaler.get_scale())     # the step's clock starts here
        # Under compile, the steps the watch samples run eagerly with its hooks; the others compiled, without.
        eager = self._compiled and self.session.due(step)
        self.session.set_hooks(eager or not self._compiled)
        total: torch.Tensor | None = None
        with transforms.eager() if eager else contextlib.nullcontext():
            for k, batch in enumerate(self._stream.window()):
                boundary = k == self.accum - 1
                with ddp.no_sync(self._wrapped, not boundary), fsdp_lib.gradient_sync(self.model, boundary):
                    loss = self._micro_step(batch)
                total = loss if total is None else total + loss
        if not self._stream.complete or total is None:
            self.optimizer.zero_grad(set_to_none=True)
            self.model.zero_grad(set_to_none=True)
            return None
        self._lr_policy.begin(self.optimizer, taken=self.step - self.scaler.total_skips)   # warmup share
        lr = float(self.optimizer.param_groups[0]["lr"])
        scale = self.scaler.get_scale()
        stepped, norm, clipped = self._optimizer_step(step, scale)
        self.step = step
        # Every rank leaves the loop on the same step: a signal seen by one rank stops them all.
        (loss_value,), stop = ddp.mean_and_any([float(total)], self._signals.signum is not None, self.dist)
        if stop and self._signals.signum is None:
            self._signals.signum = signal.SIGTERM
        self.session.write_step(loss=loss_value, scale=scale, skipped=not stepped, grad_norm=norm, clipped=clipped,
                                lr=lr)
        return loss_value

    def _micro_step(self, batch: Any) -> torch.Tensor:
        args, kwargs, target = split_batch(batch, self.device)
        try:
            with torch.autocast(self.device.type, dtype=self.dtype, enabled=self._autocast):
                output = self._wrapped(*args, **kwargs)
                loss = self._loss_fn(output, target)
        except (RuntimeError, TypeError, ValueError, IndexError) as exc:
            self._kernel_gap(exc)
            raise TrainError(f"forward or loss_fn failed at step {self.step + 1}: {type(exc).__name__}: "
                             f"{' '.join(str(exc).split())[:240]}",
                             hint="check that train_data() yields what forward() and loss_fn() take "
                                  "(AMPAUDIT_DEBUG=1 shows the traceback)") from exc
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            got = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise TrainError(f"loss_fn must return a scalar tensor, got {got}", hint="reduce it, e.g. .mean()")
        # fp32 before dividing and scaling: an fp16 loss times 65536 would overflow on its own.
        loss = loss.float() / self.accum
        self.scaler.scale(loss).backward()
        return loss.detach()

    def _kernel_gap(self, exc: BaseException) -> None:
        """A TrainError naming this CPU's missing kernel (not the user's data or loss) when that is what ``exc``
        is: oneDNN's fp16 LSTM on many CPUs (:mod:`ampaudit.machine.kernels`)."""
        from ampaudit.machine.kernels import run_gap

        gap = run_gap(exc, self.device.type, self.dtype if self._autocast else None)
        if gap is not None:
            raise TrainError(f"{gap[0]} (step {self.step + 1}: {' '.join(str(exc).split())[:160]})",
                             hint=f"{gap[1]} (train_data() and loss_fn are not at fault)") from exc

    def _optimizer_step(self, step: int, scale: float | None) -> tuple[bool, float | None, bool]:
        if self.masters is not None:
            self.masters.grads_to_masters()
        self.scaler.unscale_(self.optimizer)
        # A sharded norm is a collective: every rank takes it when any does.
        norm, clipped = clip_gradients(self._clip_groups, mode=self._clip_mode, max_value=self._clip_max,
                                       want_norm=self.session.active or (self.fsdp and self.config.trace is not None))
        stepped = self.scaler.step(self.optimizer)
        self._lr_policy.end(self.optimizer)     # the scheduler's own LR back before it steps
        if stepped:
            if self.masters is not None:
                self.masters.copy_to_model()
            if self.scheduler is not None:
                self.scheduler.step()   # only when the optimizer stepped: a skipped step must not advance the LR
        else:
            self._record_skip(step, scale)
        self.scaler.update(step)
        self.optimizer.zero_grad(set_to_none=True)
        if self.masters is not None:
            self.model.zero_grad(set_to_none=True)
        return stepped, norm, clipped

    def _record_skip(self, step: int, scale: float | None) -> None:
        # Each rank holds only its shards' gradients: the attribution is joined across ranks.
        known = fsdp_lib.nonfinite_grads(self._named) if self.fsdp else None
        found = self.session.skip(scale, self._named, model_grads=self.masters is None, found=known)
        self._skips.record(step, scale, found["params"], found["modules"])

    def _halt(self, reason: str, loss: float) -> None:
        diagnosis = halt_diagnosis(reason, self.step, self.scaler, self._skips, loss=loss)
        directory = self._checkpoint_dir or DEFAULT_HALT_DIR
        self.save_checkpoint(HALTED, directory)
        if self.dist.is_main:
            atomic_write_text(directory / DIAGNOSIS, json.dumps(diagnosis, indent=2),
                              hint="choose a writable checkpoint_dir")
            self.session.close_watch()   # its last statistics go before the halt event, which ends the trace
            self.session.write("halt", step=self.step, reason=reason, diagnosis=diagnosis)
        raise TrainingHalted(f"training halted at step {self.step}: {reason}; {describe(diagnosis)}",
                             hint=f"checkpoint and diagnosis in {directory}/; try bfloat16, keep those modules in "
                                  "fp32 (ampaudit check), or lower the learning rate")

    def _evaluate(self) -> None:
        if self.dist.is_main:     # the other ranks go on to the next step and wait for rank 0 in its all-reduce
            with self.session.paused(), transforms.eager():   # the model's own forward, as before compile
                result = self.evaluator.run(self.model, self.step, masters=self.masters)
            self.session.write("eval", step=self.step, **result)

    def _trace_meta(self) -> dict[str, Any]:
        return {"dtype": name_of(self.dtype), "device": str(self.device),
                "model": type(self.model).__name__, "opt_level": self.opt_level, "accum": self.accum,
                "world_size": self.dist.world_size, "scaler": self.scaler.config(), "fsdp": self.fsdp,
                "compile": self._compiled,
                "clip": {"mode": self._clip_mode, "max": self._clip_max}, **self._meta}


__all__ = ["TrainResult", "Trainer"]
