"""State that overflows its storage: a low-precision buffer or parameter written in place whose stored value is
inf/NaN (or pinned at the dtype's largest value) while the same writes in FP32 give a finite one.

BatchNorm on features of magnitude ~1e3 keeps a running variance ~1e5, beyond fp16's 65504: once the model is cast
to half (``model.half()``, O2 without fp32 BatchNorm) the buffer is inf. Training-mode BatchNorm normalises with
the batch's statistics, so the outputs and the loss stay finite and nothing looks wrong until eval reads the
buffer. The swamping meter (:mod:`ampaudit.runtime.swamping`) already re-runs each in-place write into such a
tensor on an FP32 copy on its sampled steps; at the end of the step it asks here, per tensor::

    row = overflow(start_inf, final, intended)    # None, or {"elements", "numel", "fp32_absmax", "limit", ...}
    fields = describe_overflow(candidate, row, model, o2=True)   # the event's fields, with why and fix

An element already inf when the step began (the cast made it so) has no FP32 value to start from: the FP32 copy
starts it at the dtype's largest finite value, and it counts only where the step's writes take even that start
beyond the dtype's range (the update itself is out of range, whatever the true start was).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.nn.modules.batchnorm import _BatchNorm

from ampaudit import dtypes
from ampaudit.dtypes import name_of


def fp32_start(stored: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The FP32 copy a measure starts from, and the mask of elements that were +-inf in storage (None: none
    were); those start at +-the dtype's largest finite value."""
    start = stored.detach().float()
    inf = torch.isinf(start)
    if not bool(inf.any()):
        return start, None
    limit = float(dtypes.limits(stored.dtype).max)
    return torch.where(inf, start.sign() * limit, start), inf


def overflow(start_inf: torch.Tensor | None, final: torch.Tensor, intended: torch.Tensor) -> dict | None:
    """The numbers of one tensor whose stored value ``final`` lost elements FP32's ``intended`` holds finite, or
    None. ``start_inf``: the elements inf when the step began (:func:`fp32_start`)."""
    limit = float(dtypes.limits(final.dtype).max)
    got, want = final.detach().float(), intended.detach().float()
    beyond = want.abs() > limit
    stored_bad = ~torch.isfinite(got)
    # Saturation (a clamped cast leaves +-max): lost only where FP32 lies beyond the range.
    lost = torch.isfinite(want) & (stored_bad | ((got.abs() >= limit) & beyond))
    if start_inf is not None:
        lost &= beyond | ~start_inf
    n = int(lost.sum())
    if n == 0:
        return None
    # An element inf before the step has a lower bound only: its FP32 copy started at the largest finite value.
    bound = start_inf is not None and bool(start_inf[lost].any())
    return {"elements": n, "numel": final.numel(), "fp32_absmax": float(want[lost].abs().max()),
            "limit": limit, "dtype": name_of(final.dtype), "nonfinite": bool(stored_bad[lost].any()),
            "lower_bound": bound}


def describe_overflow(c: Any, row: dict, model: nn.Module, *, o2: bool) -> dict:
    """The ``state_overflow`` event's fields: the numbers, ``tensor``, ``module``, ``kind``, ``why`` and ``fix``.
    ``c``: the meter's candidate (name, module, kind); ``o2``: the run casts the model itself (opt level O2)."""
    dtype, leaf = row["dtype"], c.name.rsplit(".", 1)[-1]
    held = "inf/NaN" if row["nonfinite"] else f"pinned at {row['limit']:.6g}"
    reach = (f"take even {row['limit']:.6g} (it was already inf) to {row['fp32_absmax']:.3g} in FP32"
             if row.get("lower_bound") else f"compute up to {row['fp32_absmax']:.3g} in FP32")
    why = (f"{c.name} is stored in {dtype}, whose largest value is {row['limit']:.6g}; its in-place updates "
           f"{reach}, so {row['elements']} of its {row['numel']} elements are {held}")
    cast = "after the O2 cast" if o2 else f"where the model is cast to {dtype}"
    try:
        owner = model.get_submodule(c.module) if c.module else model
    except AttributeError:
        owner = None
    if isinstance(owner, _BatchNorm):
        why += (": training-mode BatchNorm normalises with the batch's statistics, so training looks fine, but "
                "eval reads this buffer and collapses")
        fix = (f"keep BatchNorm in float32 ({c.module}.float() {cast}; `ampaudit train --opt-level O2` keeps "
               "BatchNorm fp32), or train in fp32 storage under autocast (O1)")
    elif c.kind == "buffer":
        fix = (f"keep the buffer in float32 ({c.module or 'model'}.{leaf} = ....float() {cast}), or rescale what "
               "it accumulates")
    else:
        fix = (f"keep {c.module or 'the model'} in float32 ({cast}), or give it an FP32 master; a range beyond "
               f"{dtype} needs bfloat16 or float32 storage")
    return {"tensor": c.name, "module": c.module, "kind": c.kind, "dtype": dtype, "elements": row["elements"],
            "numel": row["numel"], "fp32_absmax": row["fp32_absmax"], "limit": row["limit"], "why": why, "fix": fix}


__all__ = ["describe_overflow", "fp32_start", "overflow"]
