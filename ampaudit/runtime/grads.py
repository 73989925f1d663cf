"""Which parameters (and modules) hold non-finite gradients: the one attribution the watch, the callbacks and the
trainer's halt diagnosis share.

    found = nonfinite_grads(model.named_parameters())       # {"params": ["fc.weight"], "modules": ["fc"]}
    found = from_flags(names, ~torch.isfinite(norms))         # when per-parameter norms are already computed
    names, norms = param_grad_norms(list(model.named_parameters()))   # those norms, one fused pass, not read

One host read for all parameters (a stacked flag tensor), parameters in ``named_parameters`` order, modules sorted
(dotted paths, "" for the top module): the same step gives the same event wherever it is written.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch


def from_flags(names: Sequence[str], flags: torch.Tensor | Sequence[bool]) -> dict[str, list[str]]:
    """``{"params", "modules"}`` for the ``names`` whose flag is set."""
    values = flags.tolist() if isinstance(flags, torch.Tensor) else list(flags)
    params = [n for n, bad in zip(names, values) if bad]
    return {"params": params, "modules": sorted({n.rpartition(".")[0] for n in params})}


def is_sharded(t: torch.Tensor) -> bool:
    """A DTensor (FSDP2's sharded parameters and gradients), without importing torch.distributed.tensor."""
    return type(t).__name__ == "DTensor" and hasattr(t, "to_local")


def local(t: torch.Tensor) -> torch.Tensor:
    """This process's part of ``t``: a DTensor's local shard (reading it needs no other rank), else ``t``."""
    return t.to_local() if is_sharded(t) else t


def nonfinite_flags(named_params: Iterable[tuple[str, torch.Tensor]]) -> tuple[list[str], torch.Tensor | None]:
    """Names of the parameters that have a ``.grad``, and one bool per name: it holds inf or NaN (None: no
    gradients). FSDP's sharded gradients are read in this process's shards only (no collective)."""
    named = [(n, local(p.grad)) for n, p in named_params if p.grad is not None]
    if not named:
        return [], None
    with torch.no_grad():
        return [n for n, _ in named], torch.stack([~torch.isfinite(g).all() for _, g in named])


def nonfinite_grads(named_params: Iterable[tuple[str, torch.Tensor]]) -> dict[str, list[str]]:
    """``{"params", "modules"}`` of the parameters whose ``.grad`` holds inf or NaN. For FSDP's sharded
    gradients this process's shards are read (no collective: a watch on rank 0 alone must not wait for the
    others); :func:`ampaudit.train.fsdp.nonfinite_grads` joins every rank's."""
    names, flags = nonfinite_flags(named_params)
    return from_flags(names, flags) if flags is not None else {"params": [], "modules": []}


def param_grad_norms(named: list[tuple[str, torch.Tensor]]) -> tuple[list[str], torch.Tensor | None]:
    """Names of the parameters (of ``named``) that have gradients, and their L2 norms as one fp32 tensor
    (not read back)."""
    names = [n for n, p in named if p.grad is not None]
    if not names:
        return [], None
    # FSDP shards: each norm is of this rank's shard (the whole tensor's needs every rank; see end_step).
    grads = [local(p.grad.detach()) for _, p in named if p.grad is not None]
    try:
        # One fused pass, as clip_grad_norm_ does.
        return names, torch.stack(torch._foreach_norm(grads)).float()
    except (RuntimeError, TypeError):               # gradients on several devices or in several dtypes
        device = grads[0].device
        return names, torch.stack([torch.linalg.vector_norm(g).float().to(device) for g in grads])
