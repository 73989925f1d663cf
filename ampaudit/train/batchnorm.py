"""BatchNorm and small per-rank micro-batches: SyncBatchNorm under DDP, and a warning when it is missing.

BatchNorm normalizes each micro-batch with that micro-batch's own mean and variance. Gradient accumulation does
not grow it (each micro-batch is normalized alone) and neither does DDP (each rank normalizes its own share), so a
global batch of 256 trained as 8 ranks x 4 accumulated x 8 samples normalizes over 8 samples, where the statistics
are noisy and training degrades (Wu & He, Group Normalization, 2018: ImageNet error rises steeply below 16 per
worker). SyncBatchNorm computes the statistics over every rank's micro-batch.

    model = convert_for_ddp(model, device)         # before the DDP wrap (the trainer does it for sync_bn=True)
    layers = batchnorm_layers(model)               # names of the BatchNorm modules that normalize per rank
    message = small_batch_warning(layers, micro_batch=4, accum=8, world_size=2)   # None when the batch is large

torch's own SyncBatchNorm synchronizes CUDA tensors only, and DDP refuses it in a CPU model; on CUDA the model gets
torch's, on CPU :class:`CpuSyncBatchNorm`: a BatchNorm whose training statistics are all-reduced over the gloo
group (the same two all-reduces as torch's: statistics in forward, gradient sums in backward), so CPU runs under
torchrun train as GPU runs do. The threshold is ``min_micro_batch`` in the ``batchnorm`` section of
``rules/policy/settings.toml``; ``ampaudit check --batch N`` judges a model against it before training (AMP304).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
import torch.nn as nn

from ampaudit.batch_norms import min_micro_batch, per_rank_batchnorms
from ampaudit.errors import UsageError


class SmallBatchWarning(UserWarning):
    """A model with BatchNorm trains with per-rank micro-batches below ``min_micro_batch``."""


# Which layers and which threshold: shared with the static audit (AMP304).
batchnorm_layers = per_rank_batchnorms


def small_batch_warning(layers: list[str], *, micro_batch: int, accum: int, world_size: int) -> str | None:
    """The start-of-training warning for ``layers`` (BatchNorm names) at this micro-batch, or None."""
    limit = min_micro_batch()
    if not layers or micro_batch >= limit:
        return None
    shown = ", ".join(n or "<top>" for n in layers[:6]) + (f" and {len(layers) - 6} more" if len(layers) > 6 else "")
    grown = []
    if accum > 1:
        grown.append(f"accumulation of {accum}")
    if world_size > 1:
        grown.append(f"{world_size} ranks")
    note = f" ({' and '.join(grown)} do not enlarge it)" if grown else ""
    fix = ("convert them to SyncBatchNorm (--sync-bn, sync_bn=True) so they normalize over all ranks' micro-batches"
           if world_size > 1 else
           "use a larger micro-batch, or GroupNorm/LayerNorm, which do not depend on the batch")
    return (f"BatchNorm layers {shown} normalize over a micro-batch of {micro_batch} per rank{note}, below "
            f"{limit}: their batch statistics are noisy; {fix}")


def warn_small_batches(model: nn.Module, factory: Callable[[], Iterable], *, micro_batch: int | None, accum: int,
                       world_size: int) -> str | None:
    """Warn (:class:`SmallBatchWarning`) when ``model``'s BatchNorm layers will see micro-batches below the
    threshold, reading the micro-batch from the first batch of ``factory()`` unless ``micro_batch`` is given; return
    the message (None: no BatchNorm, or large enough micro-batches)."""
    layers = batchnorm_layers(model)
    if not layers:
        return None
    from ampaudit.train.data import first_batch_size
    from ampaudit.user_warnings import warn_at_user

    size = micro_batch if micro_batch is not None else first_batch_size(factory)
    message = small_batch_warning(layers, micro_batch=size, accum=accum, world_size=world_size)
    if message:
        warn_at_user(message, SmallBatchWarning)
    return message


class _CpuSyncBatchNorm(torch.autograd.Function):
    """Batch normalization with statistics over every rank's batch (gloo): two-pass mean and variance."""

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, momentum, group):
        dims = [0, *range(2, x.dim())]
        shape = [1, x.shape[1]] + [1] * (x.dim() - 2)
        with torch.autocast("cpu", enabled=False):
            xf = x.float()
            total = torch.tensor([float(xf.numel() // xf.shape[1])])
            sums = torch.cat([xf.sum(dims), total])
            dist.all_reduce(sums, group=group)
            count = float(sums[-1])
            mean = sums[:-1] / count
            centered = xf - mean.view(shape)
            sq = (centered * centered).sum(dims)
            dist.all_reduce(sq, group=group)
            var = sq / count
            invstd = torch.rsqrt(var + eps)
            xhat = centered * invstd.view(shape)
            y = xhat
            if weight is not None:
                y = y * weight.float().view(shape) + bias.float().view(shape)
            if running_mean is not None:
                with torch.no_grad():
                    running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
                    unbiased = var * (count / max(count - 1.0, 1.0))
                    running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
        ctx.save_for_backward(xhat, invstd, weight)
        ctx.count, ctx.group, ctx.dims, ctx.shape, ctx.dtype = count, group, dims, shape, x.dtype
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        xhat, invstd, weight = ctx.saved_tensors
        dims, shape = ctx.dims, ctx.shape
        with torch.autocast("cpu", enabled=False):
            dyf = dy.float()
            sum_dy = dyf.sum(dims)
            sum_dy_xhat = (dyf * xhat).sum(dims)
            grad_weight = sum_dy_xhat.to(weight.dtype) if weight is not None and ctx.needs_input_grad[1] else None
            grad_bias = sum_dy.to(weight.dtype) if weight is not None and ctx.needs_input_grad[2] else None
            both = torch.cat([sum_dy, sum_dy_xhat])
            dist.all_reduce(both, group=ctx.group)       # the input gradient needs the sums over every rank
            g_dy, g_dy_xhat = both.chunk(2)
            scale = invstd if weight is None else invstd * weight.float()
            dx = scale.view(shape) * (dyf - (g_dy / ctx.count).view(shape) - xhat * (g_dy_xhat / ctx.count).view(shape))
        return dx.to(ctx.dtype), grad_weight, grad_bias, None, None, None, None, None


class CpuSyncBatchNorm(nn.modules.batchnorm._BatchNorm):
    """BatchNorm of any input rank whose training statistics cover every rank's batch, for CPU tensors (gloo).
    Made by :func:`convert_for_ddp` from torch's SyncBatchNorm (same attributes, parameters and buffers)."""

    process_group = None
    syncs_across_ranks = True     # ampaudit.batch_norms.SYNCS_RANKS: its statistics are not per rank
    # Whether this rank runs the model alone right now (the watch's replays on rank 0): statistics stay local.
    alone: Callable[[], bool] | None = None

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        group = self.process_group or (dist.group.WORLD if dist.is_available() and dist.is_initialized() else None)
        if not (self.training and input.device.type == "cpu" and group is not None
                and dist.get_world_size(group) > 1) or (self.alone is not None and self.alone()):
            return super().forward(input)
        self._check_input_dim(input)
        momentum = 0.0 if self.momentum is None else self.momentum
        if self.track_running_stats:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:     # cumulative moving average, as nn.BatchNorm does
                momentum = 1.0 / float(self.num_batches_tracked)
        track = self.track_running_stats
        return _CpuSyncBatchNorm.apply(input, self.weight, self.bias, self.running_mean if track else None,
                                       self.running_var if track else None, self.eps, momentum, group)


def convert_for_ddp(model: nn.Module, device: torch.device | str, *, divergence_every: int | None = None,
                    alone: Callable[[], bool] | None = None) -> nn.Module:
    """``model`` with every BatchNorm synchronized over the ranks (same parameters and buffers): torch's
    SyncBatchNorm on CUDA, :class:`CpuSyncBatchNorm` on CPU. Returns the model (a new object only when the model
    itself is a BatchNorm). ``divergence_every``: refused, as rank 0 alone runs the FP32 shadow. ``alone``: true
    while this rank runs the model by itself (the trainer's watch replaying a pass), when statistics stay local."""
    if divergence_every is not None:
        raise UsageError("divergence checks cannot run on a distributed model with SyncBatchNorm",
                         hint="drop sync_bn or divergence_every, or check divergence in a single-process run")
    converted = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    if torch.device(device).type == "cpu":
        for module in converted.modules():
            if type(module) is nn.SyncBatchNorm:
                module.__class__ = CpuSyncBatchNorm    # same attributes; only forward differs
                module.alone = alone
    return converted


__all__ = ["CpuSyncBatchNorm", "SmallBatchWarning", "batchnorm_layers", "convert_for_ddp", "min_micro_batch",
           "small_batch_warning", "warn_small_batches"]
