"""Blockwise FP8 training numerics (DeepSeek-V3, arXiv 2412.19437) on any device: what torchao's
``fp8_blockwise_mm`` computes with its Triton kernels, as dequantize-then-fp32-matmul, each tile cast with
torchao.float8's own dynamic e4m3 cast (torchao's blockwise quantizers, reference ones included, import Triton).

    out = blockwise_linear(x, weight, gemms={})       # in, out features and tokens multiples of 128
    q = act_qdq(t)                                     # t through e4m3 with one scale per 1x128 tile of its last dim

Per GEMM, as ``torchao.prototype.blockwise_fp8_training.linear.fp8_blockwise_mm`` casts: output = input (1x128
tiles along K) @ weight (128x128 blocks)^T; grad_input = grad_output (1x128 along N) @ weight (128x128);
grad_weight = grad_output^T (1x128 along the tokens M) @ input (128x1 along M). A GEMM ``gemms`` keeps in bf16 runs
from the unquantized operands. torchao's Float8BlockwiseLinear itself needs an SM90 GPU and Triton, has no emulated
mode, and refuses a bias (added here after the GEMM).
"""
from __future__ import annotations

import torch

from ampaudit.precision.emulated_gemm import emulated_linear

__all__ = ["blockwise_linear", "act_qdq", "weight_qdq"]

TILE = 128


def _tiles_qdq(tiles: torch.Tensor) -> torch.Tensor:
    """Each row of ``tiles`` through e4m3 with its own scale: torchao.float8's axiswise dynamic cast (scale
    448 / amax in fp32, saturated cast), then back to fp32."""
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_utils import tensor_to_scale, to_fp8_saturated

    e4m3 = torch.float8_e4m3fn
    scale = tensor_to_scale(tiles, e4m3, scaling_granularity=ScalingGranularity.AXISWISE, axiswise_dim=-1)
    return to_fp8_saturated(tiles * scale, e4m3).float() / scale


def act_qdq(t: torch.Tensor) -> torch.Tensor:
    """2-D ``t`` (last dim a multiple of 128) through e4m3 with a scale per 1x128 tile of its last dim, in fp32."""
    x = t.detach().float().contiguous()
    return _tiles_qdq(x.reshape(-1, TILE)).reshape(x.shape)


def _rows_qdq(t: torch.Tensor) -> torch.Tensor:
    """2-D ``t`` with a scale per 128x1 tile (128 rows of one column), in fp32."""
    return act_qdq(t.t()).t()


def weight_qdq(w: torch.Tensor) -> torch.Tensor:
    """2-D ``w`` (both dims multiples of 128) with a scale per 128x128 block, in fp32."""
    x = w.detach().float()
    h, wd = x.shape
    blocks = x.reshape(h // TILE, TILE, wd // TILE, TILE).permute(0, 2, 1, 3).reshape(-1, TILE * TILE)
    q = _tiles_qdq(blocks).reshape(h // TILE, wd // TILE, TILE, TILE).permute(0, 2, 1, 3)
    return q.reshape(h, wd)


class _BlockwiseLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d: torch.Tensor, weight: torch.Tensor, low_out: bool, low_gi: bool, low_gw: bool):
        ctx.save_for_backward(x2d, weight)
        ctx.low = (low_gi, low_gw)
        if not low_out:
            return x2d.float() @ weight.float().t()
        return act_qdq(x2d) @ weight_qdq(weight).t()

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x2d, weight = ctx.saved_tensors
        low_gi, low_gw = ctx.low
        go = grad_out.float()
        gi = act_qdq(go) @ weight_qdq(weight) if low_gi else go @ weight.float()
        gw = act_qdq(go.t()) @ _rows_qdq(x2d) if low_gw else go.t() @ x2d.float()
        return gi.to(x2d.dtype), gw.to(weight.dtype), None, None, None


def blockwise_linear(x: torch.Tensor, weight: torch.Tensor, gemms: dict[str, str]) -> torch.Tensor:
    """``x @ weight.T`` with blockwise-FP8 operands in each GEMM ``gemms`` does not keep in bf16; the output in the
    run's autocast dtype, else in ``x``'s dtype."""
    return emulated_linear(_BlockwiseLinear, x, weight, gemms)
