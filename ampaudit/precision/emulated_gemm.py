"""The calling side of a Linear whose GEMMs run through an emulated low-precision format (NVFP4, blockwise FP8):
which of its three GEMMs are low, autocast off inside, and the output in the dtype the run expects.

    out = emulated_linear(_NVFP4Linear, x, weight, {"grad_weight": "bfloat16"})

``function`` is a ``torch.autograd.Function`` taking ``(x2d, weight, low_output, low_grad_input, low_grad_weight)``.
"""
from __future__ import annotations

import torch

from ampaudit.precision.recipes import HIGH_PRECISION

GEMMS = ("output", "grad_input", "grad_weight")


def emulated_linear(function: type[torch.autograd.Function], x: torch.Tensor, weight: torch.Tensor,
                    gemms: dict[str, str]) -> torch.Tensor:
    """``x @ weight.T`` through ``function``, its GEMMs low except those ``gemms`` keeps in bf16/fp32; the output in
    the run's autocast dtype (bf16 under bf16 autocast), else in ``x``'s dtype."""
    shape = x.shape
    low = [gemms.get(g) not in HIGH_PRECISION for g in GEMMS]
    with torch.autocast(x.device.type, enabled=False):
        out = function.apply(x.reshape(-1, shape[-1]), weight, *low)
    dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
    return out.to(dtype).reshape(*shape[:-1], weight.shape[0])
