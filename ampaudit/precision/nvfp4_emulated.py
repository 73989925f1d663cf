"""NVFP4 training numerics on any device: each GEMM of a Linear computed from operands quantized with torchao's
``NVFP4Tensor.to_nvfp4`` (1x16 blocks along the GEMM's reduction dim, e4m3 block scales under an fp32 tensor
scale, round to nearest) and dequantized, then multiplied in fp32.

    out = nvfp4_linear(x, weight, gemms={})                       # all three GEMMs in NVFP4
    out = nvfp4_linear(x, weight, gemms={"grad_weight": "bfloat16"})   # wgrad from the unquantized operands
    qdq = nvfp4_qdq(t)                                            # t through NVFP4 and back, along its last dim

torchao's ``NVFP4TrainingConfig`` needs its Triton kernels; this is what :mod:`ampaudit.precision.convert` trains an
``nvfp4`` layer with elsewhere, and says so. Reductions run along the last dim, so each operand is transposed to put
the GEMM's reduction dim there: input and weight along K for the output, grad_output and weight along N for
grad_input, grad_output and input along M (tokens) for grad_weight.
"""
from __future__ import annotations

import torch

from ampaudit.precision.emulated_gemm import emulated_linear

__all__ = ["nvfp4_linear", "nvfp4_qdq"]



def nvfp4_qdq(t: torch.Tensor) -> torch.Tensor:
    """``t`` (2-D, last dim a multiple of 16) quantized to NVFP4 along its last dim and dequantized, in fp32."""
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale

    x = t.detach().float().contiguous()
    amax = x.abs().max()
    if not torch.isfinite(amax) or amax == 0:
        return x
    scale = per_tensor_amax_to_scale(amax)
    return NVFP4Tensor.to_nvfp4(x, 16, per_tensor_scale=scale).dequantize(torch.float32)


class _NVFP4Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d: torch.Tensor, weight: torch.Tensor, low_out: bool, low_gi: bool, low_gw: bool):
        ctx.save_for_backward(x2d, weight)
        ctx.low = (low_gi, low_gw)
        a = nvfp4_qdq(x2d) if low_out else x2d.float()
        b = nvfp4_qdq(weight) if low_out else weight.float()
        return a @ b.t()

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x2d, weight = ctx.saved_tensors
        low_gi, low_gw = ctx.low
        go = grad_out.float()
        # grad_input = grad_output @ weight: reduction over N (grad_output's last dim, weight's first).
        gi = nvfp4_qdq(go) @ nvfp4_qdq(weight.t()).t() if low_gi else go @ weight.float()
        # grad_weight = grad_output^T @ input: reduction over the tokens M.
        gw = nvfp4_qdq(go.t()) @ nvfp4_qdq(x2d.t()).t() if low_gw else go.t() @ x2d.float()
        return gi.to(x2d.dtype), gw.to(weight.dtype), None, None, None


def nvfp4_linear(x: torch.Tensor, weight: torch.Tensor, gemms: dict[str, str]) -> torch.Tensor:
    """``x @ weight.T`` with NVFP4 operands in each GEMM ``gemms`` does not keep in bf16/fp32; the output in the
    run's autocast dtype (bf16 under bf16 autocast), else in ``x``'s dtype."""
    return emulated_linear(_NVFP4Linear, x, weight, gemms)
