"""Gradient clipping at the accumulation boundary, on unscaled FP32 gradients.

Clipping scaled gradients compares them with a threshold 65536x too small; clipping each micro-batch clips a
partial sum. The trainer therefore calls :func:`clip_gradients` exactly once per optimizer step, after
``unscale_`` and (under O2) after the gradients moved to the FP32 masters. It returns the global gradient norm
*before* clipping and whether anything was clipped, for the ``step`` trace event.

    norm, clipped = clip_gradients(groups, mode="norm", max_value=1.0)

``groups`` is a list of parameter lists, one per layer (module owning the parameters); ``mode`` is ``"norm"``
(global L2 norm over all groups), ``"layer"`` (each group to its own L2 norm) or ``"value"`` (elementwise).
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ampaudit.errors import UsageError
from ampaudit.train.fsdp import group_norms

CLIP_MODES = ("norm", "layer", "value")


def check_clip(mode: str | None, max_value: float | None) -> None:
    """Raise a UsageError for an unknown mode or a threshold that is not a positive number."""
    if mode is None and max_value is None:
        return
    if mode not in CLIP_MODES:
        raise UsageError(f"unknown clip mode {mode!r}", hint=f"use one of {', '.join(CLIP_MODES)}")
    if max_value is None or not (math.isfinite(max_value) and max_value > 0):
        name = "clip_value" if mode == "value" else "clip_norm"
        raise UsageError(f"{name} must be a positive number, got {max_value}", hint=f"e.g. {name}=1.0")


def _grads(params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [p.grad for p in params if p.grad is not None]


def total_norm(params: Sequence[torch.Tensor]) -> torch.Tensor:
    """The global L2 norm of the gradients of ``params``, in fp32 (0 when there are none). Collective when the
    gradients are FSDP shards."""
    return group_norms([_grads(params)], 2.0)[0]


def clip_gradients(groups: Sequence[Sequence[torch.Tensor]], *, mode: str | None, max_value: float | None,
                   want_norm: bool = True) -> tuple[float | None, bool]:
    """Clip in place; return ``(global norm before clipping or None, clipped)``.

    With ``mode=None`` nothing is clipped and the norm is computed only when ``want_norm``. The norms are
    global: FSDP shards are reduced across ranks (every rank must call this then).
    """
    params = [p for group in groups for p in group]
    if mode is None:
        return (float(total_norm(params)) if want_norm else None), False
    if mode == "norm":
        norm = total_norm(params)
        torch.nn.utils.clip_grads_with_norm_(params, max_value, norm, foreach=True)
        value = float(norm)
        return value, math.isfinite(value) and value > max_value
    if mode == "layer":
        groups = [group for group in groups if group]
        per_layer = group_norms([_grads(group) for group in groups], 2.0) if groups else torch.zeros(1)
        for group, norm in zip(groups, per_layer):
            torch.nn.utils.clip_grads_with_norm_(group, max_value, norm, foreach=True)
        value = float(torch.linalg.vector_norm(per_layer, 2.0))
        return value, bool(torch.isfinite(per_layer).all() and (per_layer > max_value).any())
    # mode == "value"
    grads = _grads(params)
    value = float(total_norm(params)) if want_norm else None
    clipped = False
    if grads:
        absmax = group_norms([grads], math.inf)[0]
        clipped = bool(torch.isfinite(absmax) and absmax > max_value)
        torch.nn.utils.clip_grad_value_(params, max_value, foreach=True)
    return value, clipped


def layer_groups(named_params: Sequence[tuple[str, torch.Tensor]]) -> list[list[torch.Tensor]]:
    """Group parameters by owning module: ``body.0.weight`` and ``body.0.bias`` form one layer."""
    groups: dict[str, list[torch.Tensor]] = {}
    for name, p in named_params:
        groups.setdefault(name.rpartition(".")[0], []).append(p)
    return list(groups.values())
