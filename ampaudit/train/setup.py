"""The trainer's construction checks: options that cannot go together, the optimizer, the preflight verdict.

Each function raises the one-line error a bad combination deserves, before anything is built or sharded:

    clip_mode, clip_max = check_options(opt_level="O1", accum=4, clip_norm=1.0, ...)
    check_distributed(synchronised_batchnorm(model, ctx), ctx, divergence_every=None, fp8_fallback=False, tracing=True)
    optimizer = build_optimizer(make_optimizer, params, lr=None, masters=False)
    enforce(trainer.preflight, ctx, checks)     # every rank stops when a check failed on any rank
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from ampaudit.errors import TrainError, UsageError
from ampaudit.train import ddp
from ampaudit.train.clip import check_clip
from ampaudit.train.preflight import Check, failed


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
