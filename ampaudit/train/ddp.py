"""Distributed data parallel for the trainer: process group, wrapping, ``no_sync``, small collectives.

Under ``torchrun`` (``WORLD_SIZE`` > 1 in the environment) :func:`setup` joins the process group (gloo on CPU,
nccl on CUDA). Without it everything here is a no-op for a single process, so the trainer has one code path.

    dist_ctx = setup("cpu")
    model = wrap(model, dist_ctx)
    with no_sync(model, not boundary):   # skip the gradient all-reduce on non-boundary micro-batches
        loss.backward()
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from ampaudit.errors import TrainError


@dataclass(frozen=True)
class DistContext:
    """Rank and world size of this process (0 and 1 when not distributed)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    joined: bool = False       # this process group was created by ``setup`` (so ``teardown`` may leave it)

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


_joins = 0      # default groups this process has joined through torchrun's store


def backend_for(device_type: str) -> str:
    """The process-group backend for a device: nccl on CUDA, gloo on CPU."""
    return "nccl" if device_type == "cuda" else "gloo"


def collective_device() -> torch.device:
    """Where tensors handed to the default group's collectives must live: nccl takes CUDA tensors only."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _join(backend: str) -> None:
    """Join the default group torchrun describes. A later join (a second Trainer in the same job, after the first
    left) keys its rendezvous under a fresh prefix of torchrun's store: under the default keys it would find the
    first group's stale addresses and wait forever. Every rank joins in the same order, so the prefixes match."""
    global _joins
    if _joins == 0:
        dist.init_process_group(backend=backend)
    else:
        store, rank, world = next(dist.rendezvous("env://"))
        dist.init_process_group(backend=backend, store=dist.PrefixStore(f"ampaudit-join-{_joins}", store),
                                rank=rank, world_size=world)
    _joins += 1


def setup(device_type: str, *, group: bool = False) -> DistContext:
    """Join the process group torchrun describes, if any; return this process's context. ``group``: a single
    process needs one too (FSDP shards over a group, even of one), made in memory when torchrun made none."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1 and group and dist.is_available() and not dist.is_initialized():
        if "MASTER_ADDR" in os.environ:
            _join(backend_for(device_type))
        else:
            dist.init_process_group(backend="gloo", store=dist.HashStore(), rank=0, world_size=1)
        return DistContext(joined=True)
    if world <= 1:
        return DistContext()
    if not dist.is_available():
        raise TrainError("WORLD_SIZE > 1 but this torch build has no torch.distributed",
                         hint="run without torchrun, or install a torch build with distributed support")
    joined = not dist.is_initialized()
    if joined:
        backend = backend_for(device_type)
        try:
            _join(backend)
        except (RuntimeError, ValueError) as exc:
            raise TrainError(f"cannot join the {backend} process group: {' '.join(str(exc).split())[:200]}",
                             hint="launch with torchrun --nproc-per-node N") from exc
    return DistContext(rank=dist.get_rank(), world_size=dist.get_world_size(),
                       local_rank=int(os.environ.get("LOCAL_RANK", "0")), joined=joined)


def wrap(model: nn.Module, ctx: DistContext, device: torch.device) -> nn.Module:
    """Wrap ``model`` in DistributedDataParallel when distributed (rank 0's weights are broadcast)."""
    if not ctx.enabled:
        return model
    ids = [device] if device.type == "cuda" else None
    return nn.parallel.DistributedDataParallel(model, device_ids=ids)


def no_sync(model: nn.Module, skip: bool) -> contextlib.AbstractContextManager:
    """DDP's ``no_sync`` when ``skip`` (a non-boundary micro-batch), else a null context."""
    if skip and isinstance(model, nn.parallel.DistributedDataParallel):
        return model.no_sync()
    return contextlib.nullcontext()


def mean_and_any(values: list[float], flag: bool, ctx: DistContext) -> tuple[list[float], bool]:
    """Average ``values`` over ranks and OR ``flag`` over ranks, in one all-reduce."""
    if not ctx.enabled:
        return values, flag
    t = torch.tensor([*values, 1.0 if flag else 0.0], dtype=torch.float64, device=collective_device())
    dist.all_reduce(t)
    out = t.cpu().tolist()
    return [v / ctx.world_size for v in out[:-1]], out[-1] > 0


def gather(obj: Any, ctx: DistContext) -> list[Any]:
    """Every rank's ``obj``, in rank order (``[obj]`` when not distributed)."""
    if not ctx.enabled:
        return [obj]
    out: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(out, obj)
    return out


def barrier(ctx: DistContext) -> None:
    """Wait for every rank (no-op when not distributed)."""
    if ctx.enabled:
        dist.barrier()


def teardown(ctx: DistContext | None = None) -> None:
    """Leave the process group ``setup`` joined (with ``ctx``), or any group this process is in (without)."""
    if ctx is not None and not ctx.joined:
        return          # the caller created it, the caller leaves it
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
