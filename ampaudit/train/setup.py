"""The trainer's construction: options that cannot go together, the optimizer, the preflight verdict, and
:class:`TrainerSetup`, which prepares the model, applies its transforms in order (:mod:`ampaudit.train.transforms`)
and builds the step and the watch around it.

Each check raises the one-line error a bad combination deserves, before anything is built or sharded:

    clip_mode, clip_max = check_options(opt_level="O1", accum=4, clip_norm=1.0, ...)
    check_distributed(synchronised_batchnorm(model, ctx), ctx, divergence_every=None, fp8_fallback=False, tracing=True)
    optimizer = build_optimizer(make_optimizer, params, lr=None, masters=False)
    enforce(trainer.preflight, ctx, checks)     # every rank stops when a check failed on any rank
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from ampaudit.errors import TrainError, UsageError
from ampaudit.runtime.session import WatchSession
from ampaudit.train import ddp
from ampaudit.train import fsdp as fsdp_lib
from ampaudit.train import transforms
from ampaudit.train.batchnorm import convert_for_ddp, warn_small_batches
from ampaudit.train.clip import check_clip, layer_groups
from ampaudit.train.config import TrainConfig
from ampaudit.train.data import DataStream
from ampaudit.train.diagnosis import SkipLog
from ampaudit.train.evaluate import Evaluator
from ampaudit.train.lr import LRPolicy
from ampaudit.train.masters import MasterWeights, cast_model_o2, refuse_low_precision_weights
from ampaudit.train.preflight import Check, failed, resource_checks, structure_checks
from ampaudit.train.preflight_state import STATE_CHECKS, check_optimizer_state, check_updates_of
from ampaudit.train.scaler import LossScaler, scaler_for
from ampaudit.train.signals import StopSignals


def check_options(*, opt_level: str, accum: int, clip_norm: float | None, clip_value: float | None, clip_mode: str,
                  checkpoint_every: int | None, trace_every: int, divergence_every: int | None, fsdp: bool,
                  fp8_fallback: bool, eval_every: int | None) -> tuple[str | None, float | None]:
    """Refuse options that are invalid or contradict each other; return ``(clip mode, clip threshold)``."""
    if accum < 1:
        raise UsageError(f"accum must be >= 1, got {accum}", hint="e.g. accum=4")
    if clip_norm is not None and clip_value is not None:
        raise UsageError("clip by norm or by value, not both", hint="drop clip_norm or clip_value")
    mode = "value" if clip_value is not None else (clip_mode if clip_norm is not None else None)
    threshold = clip_value if clip_value is not None else clip_norm
    check_clip(mode, threshold)
    for name, value in (("checkpoint_every", checkpoint_every), ("trace_every", trace_every),
                        ("divergence_every", divergence_every)):
        if value is not None and value < 1:
            raise UsageError(f"{name} must be >= 1, got {value}")
    if divergence_every is not None and opt_level == "O2":
        # The FP32 shadow runs the model's own weights, which O2 keeps in low precision.
        raise UsageError("divergence checks need FP32 weights: opt level O1",
                         hint='use opt_level="O1" with divergence_every, or drop divergence_every')
    if fsdp and (divergence_every is not None or fp8_fallback):
        # Rank 0 alone would run the FP32 shadow / swap a layer; a sharded forward needs every rank.
        raise UsageError("divergence checks and fp8_fallback cannot run on an FSDP model",
                         hint="drop divergence_every / fp8_fallback, or check them in a single-process run")
    if fsdp and eval_every is not None:
        # FSDP gathers the weights in the training dtype: its "FP32" evaluation would run bf16/fp16 weights.
        raise UsageError("FP32 evaluation (eval_every) cannot run on an FSDP model: FSDP gathers the weights in "
                         "the training dtype", hint="drop eval_every, or evaluate the saved full state_dict in FP32")
    return mode, threshold


def synchronised_batchnorm(model: nn.Module, ctx: ddp.DistContext) -> bool:
    """Whether a forward of ``model`` talks to the other ranks: torch's SyncBatchNorm in a multi-rank run."""
    return ctx.world_size > 1 and any(isinstance(m, nn.SyncBatchNorm) for m in model.modules())


def check_distributed(synced: bool, ctx: ddp.DistContext, *, divergence_every: int | None, fp8_fallback: bool,
                      tracing: bool) -> None:
    """Refuse what rank 0 would do alone in a multi-rank run (``synced``: :func:`synchronised_batchnorm`)."""
    if divergence_every is not None and synced:
        # Rank 0 alone runs the FP32 shadow; a SyncBatchNorm in it would wait for the other ranks forever.
        raise UsageError("divergence checks cannot run on a distributed model with SyncBatchNorm",
                         hint="drop divergence_every, or check divergence in a single-process run")
    if fp8_fallback and (not tracing or ctx.world_size > 1):
        # Rank 0's trace hooks see the flushing; a layer swapped on one rank alone would split the ranks.
        raise UsageError("fp8_fallback needs a trace and a single process",
                         hint="pass trace=..., or drop fp8_fallback under torchrun")


def build_optimizer(optimizer: Any, params: list[torch.Tensor], lr: float | None, *,
                    masters: bool) -> torch.optim.Optimizer:
    """The optimizer over ``params``: AdamW by default, a factory's, or an instance (not with O2 ``masters``)."""
    if optimizer is None:
        opt = torch.optim.AdamW(params, lr=1e-3 if lr is None else lr)
    elif isinstance(optimizer, torch.optim.Optimizer):
        if masters:
            raise UsageError("opt level O2 builds the optimizer over FP32 master weights",
                             hint="pass a factory, e.g. optimizer=lambda params: torch.optim.AdamW(params)")
        opt = optimizer
    else:
        opt = optimizer(params)
        if not isinstance(opt, torch.optim.Optimizer):
            raise TrainError(f"make_optimizer(params) returned {type(opt).__name__}, not a torch optimizer",
                             hint="return e.g. torch.optim.AdamW(params, lr=1e-3)")
    if lr is not None:
        for group in opt.param_groups:
            group["lr"] = lr
    return opt


def enforce(kept: list[Check], ctx: ddp.DistContext, checks: list[Check]) -> None:
    """Append ``checks`` to ``kept``; raise on every rank when any rank's check failed (memory differs per host)."""
    kept += checks
    mine = failed(checks)
    _, anywhere = ddp.mean_and_any([], bool(mine), ctx)
    if anywhere:
        first = mine[0] if mine else Check("preflight", "fail", "a check failed on another rank")
        raise TrainError(f"preflight: {first.name}: {first.message}",
                         hint=f"{first.hint + '; ' if first.hint else ''}preflight_only() in "
                              "ampaudit.train.preflight lists every check")


class TrainerSetup:
    """The trainer's construction after its options are read (a mixin: :class:`~ampaudit.train.trainer.Trainer`
    calls these in order, and they set the attributes its loop and :class:`~ampaudit.train.state.TrainerState`
    read)."""

    config: TrainConfig
    dtype: torch.dtype
    reduce_dtype: torch.dtype
    opt_level: str
    device: torch.device
    dist: ddp.DistContext
    fsdp: bool
    session: WatchSession
    _meta: dict[str, Any]
    _clip_mode: str | None

    def _prepare(self, model: nn.Module, factory: Callable) -> tuple[nn.Module, list[tuple[str, nn.Module]]]:
        """The model on its device, checked, O2-cast and SyncBatchNorm-converted; its FSDP units."""
        cfg = self.config
        model.to(self.device)
        self.preflight: list[Check] = []
        self._preflight = cfg.preflight and (self.fsdp or self.dist.enabled)
        units = self._units = fsdp_lib.block_units(model, cfg.fsdp_wrap) if self.fsdp else []
        if self._preflight:
            enforce(self.preflight, self.dist, structure_checks(
                model, dtype=self.dtype, world_size=self.dist.world_size, fsdp=self.fsdp, units=units,
                opt_level=self.opt_level))
        if self.opt_level == "O2" and not self.fsdp:
            if self.dtype == torch.float32:
                raise UsageError('opt level O2 needs dtype="float16" or dtype="bfloat16"',
                                 hint="use O1 for float32 training")
            cast_model_o2(model, self.dtype)
        else:
            # Under FSDP, O2 is what the sharded fp32 parameters already are: masters, cast for compute.
            refuse_low_precision_weights(model)
        # Tensors that change in place in low precision without an FP32 master lose their small updates: looked for
        # under O2 (after the cast, which O2's masters will cover for trainable parameters) and FSDP (before the
        # shard: a dry forward of the plain model needs no collective). Warnings: the run is valid.
        self._state_preflight = cfg.preflight and (self.opt_level == "O2" or self.fsdp)
        if self._state_preflight:
            self.preflight.append(check_updates_of(model, factory, dtype=self.dtype, o2=self.opt_level == "O2",
                                                   mastered=[p for p in model.parameters() if p.requires_grad]))
        if cfg.sync_bn and self.dist.enabled:   # before the wrap: DDP / FSDP must see the modules they will run
            model = convert_for_ddp(model, self.device, divergence_every=cfg.divergence_every,
                                    alone=lambda: self.session.replaying)   # rank 0's watch replays alone
        return model, units

    def _transform(self, model: nn.Module, units: list[tuple[str, nn.Module]]) -> None:
        """Activation checkpointing, compile, then FSDP/DDP: the order of :mod:`ampaudit.train.transforms` (its
        first, a plan, is applied before the trainer is built)."""
        cfg = self.config
        log = self.transforms = [t for t in transforms.applied(model) if t == "plan"]
        if cfg.checkpoint_activations:      # "auto" or class names; the recomputes run unwatched
            self._meta.setdefault("checkpoint_activations", transforms.checkpoint_activations(
                model, cfg.checkpoint_activations, recompute_context=lambda: self.session.paused(), log=log))
        self._compiled = bool(cfg.compile)
        if self._compiled:
            transforms.compile_model(model, cfg.compile, log=log)
        self._wrapped = transforms.data_parallel(model, self.dist, self.device, fsdp=self.fsdp, units=units,
                                                 dtype=self.dtype, reduce_dtype=self.reduce_dtype, log=log)
        # Every rank waits for the others before leaving the group while a wrapper or compiled graph may use it.
        self._sync_on_close = self._wrapped is not model or self._compiled

    def _build_step(self, model: nn.Module, factory: Callable) -> None:
        """Masters, optimizer, LR policy, scheduler, resource preflight, scaler, clip groups and the data stream."""
        cfg = self.config
        # Masters are taken after the DDP wrap: its constructor broadcasts rank 0's weights into the model.
        self.masters = MasterWeights(model) if self.opt_level == "O2" and not self.fsdp else None
        if self.masters is not None:
            self._named = self.masters.named_parameters()
        else:
            self._named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        params = [p for _, p in self._named]
        if not params:
            raise TrainError("the model has no trainable parameters", hint="check requires_grad on its weights")
        self.optimizer = build_optimizer(cfg.optimizer, params, cfg.lr, masters=self.masters is not None)
        if self._state_preflight:
            self.preflight.append(check_optimizer_state(self.optimizer, {id(t): n for n, t in self._named}))
        # Scaled before the scheduler is built, so its base LRs are the scaled ones (ampaudit.train.lr).
        self._lr_policy = LRPolicy.build(self.optimizer, factory, micro_batch=cfg.micro_batch,
                                         warmup_steps=cfg.warmup_steps, scale=cfg.scale_lr,
                                         base_batch=cfg.base_batch, accum=cfg.accum,
                                         world_size=self.dist.world_size)
        if self._lr_policy.active:
            self._meta.setdefault("lr_policy", self._lr_policy.describe())
        self.scheduler = cfg.scheduler(self.optimizer) if cfg.scheduler is not None else None
        if self._preflight:
            enforce(self.preflight, self.dist, resource_checks(
                model, dtype=self.dtype, reduce_dtype=self.reduce_dtype, world_size=self.dist.world_size,
                accum=cfg.accum, fsdp=self.fsdp, units=self._units, opt_level=self.opt_level, optimizer=self.optimizer,
                device=self.device))
        self.scaler = cfg.loss_scale if isinstance(cfg.loss_scale, LossScaler) else scaler_for(
            cfg.loss_scale, self.dtype, self.device.type, max_consecutive_skips=cfg.max_consecutive_skips,
            **cfg.scaler_options())
        self._clip_groups = layer_groups(self._named) if self._clip_mode == "layer" else [params]
        self._stream = DataStream(factory, accum=cfg.accum, rank=self.dist.rank, world_size=self.dist.world_size)
        self.step = 0
        self._skips = SkipLog()
        self._saved_step: int | None = None
        self._signals = StopSignals(cfg.handle_signals)

    def _build_watch(self, model: nn.Module, factory: Callable, loss_fn: Callable) -> None:
        """The watch session, the start's warnings and the evaluator."""
        cfg = self.config
        synced = synchronised_batchnorm(model, self.dist)
        check_distributed(synced, self.dist, divergence_every=cfg.divergence_every, fp8_fallback=cfg.fp8_fallback,
                          tracing=cfg.trace is not None)
        # The run's trace, owned by the same session the Lightning/HF callbacks drive. Rank 0 alone writes it; with
        # no trace the session watches nothing (memory=False: no in-memory events either).
        # Replays rerun one pass on rank 0 alone: a sharded forward, or torch's (CUDA) SyncBatchNorm, would wait for
        # the other ranks, and under compile the watch has not seen the compiled passes it would replay.
        watch = cfg.watch_options()
        trace = watch.pop("trace")
        self.session = WatchSession(trace if self.dist.is_main else None, **watch, memory=False,
                                    fp8_fallback=cfg.fp8_fallback, plan_file=cfg.plan_file,
                                    replays=not (self.fsdp or self._compiled or synced),
                                    stats_every=1 if self._compiled else None)
        # BatchNorm over small per-rank micro-batches: warned about at the start (ampaudit.train.batchnorm).
        # The micro-batch the LR policy read from the data already, if it had to: train_data() is not read twice.
        known = cfg.micro_batch if cfg.micro_batch is not None else self._lr_policy.micro_batch
        found = warn_small_batches(model, factory, micro_batch=known, accum=cfg.accum,
                                   world_size=self.dist.world_size) if self.dist.is_main else None
        self.warnings: list[str] = [found] if found else []
        if self.dist.is_main:       # the state preflight warns; ampaudit train prints these at the start
            self.warnings += [f"preflight {c.name}: {c.message} -> {c.hint}" for c in self.preflight
                              if c.status == "warn" and c.name in STATE_CHECKS]
        if found:
            self._meta.setdefault("warnings", self.warnings)
        # Autocast beside FP32 on eval_data() every eval_every steps (ampaudit.train.evaluate); rank 0 evaluates.
        self.evaluator = None if cfg.eval_every is None else Evaluator(
            cfg.eval_data, loss_fn, every=cfg.eval_every, metric_fn=cfg.metric_fn, dtype=self.dtype,
            device=self.device)


__all__ = ["TrainerSetup", "build_optimizer", "check_distributed", "check_options", "enforce",
           "synchronised_batchnorm"]
