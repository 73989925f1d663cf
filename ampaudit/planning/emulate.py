"""Each low-precision recipe's Linear as torchao 0.18 runs it, emulated on CPU, and what its casts do to each operand.

    layer = recipe_linear(lin, "mxfp8")                   # an nn.Module on lin's Parameters, forward and backward
    layer = recipe_linear(lin, "mxfp8", hp_grad_weight=True)   # torchao's wgrad_with_hp: grad_weight unquantized
    unsupported(recipe("nvfp4"), tokens=100, k=64, n=64)  # "tokens 100 not a multiple of 16 (nvfp4 blocks)"
    quant_stats(recipe("nvfp4"), x, w, grad_output)       # {"input": {"flushed_share": ..}, "weight": .., ...}

Per family (rules/policy/recipes.toml ``family``):

- ``float8``: torchao's ``Float8Linear`` (``convert_to_float8_training`` with ``Float8LinearConfig`` of the recipe,
  ``emulate=True``): the numerics torchao trains with. Statistics: :func:`ampaudit.precision.fp8.cast_stats`.
- ``mx`` / mxfp8: torchao's ``_to_mxfp8_then_scaled_mm`` with ``KernelPreference.EMULATED`` and RCEIL scales, the
  function ``MXFP8TrainingOpConfig`` dispatches every Linear to: each operand cut into 1x32 blocks along the
  reduction dim of the GEMM it feeds (input along K for the output, along the tokens for grad_weight; weight along
  K, then along N for grad_input), an E8M0 (power-of-two) scale per block.
- ``mx`` / nvfp4: ``NVFP4Tensor.to_nvfp4`` per operand and GEMM, 1x16 blocks along the reduction dim, E4M3 block
  scales under an fp32 per-tensor scale (amax / (448 * 6)), round to nearest, dequantized and multiplied in fp32.
  torchao's NVFP4 training kernels (``nvfp4_training``) are Triton only; they add a random Hadamard transform,
  stochastic rounding of gradients and 16x16 weight blocks. The emulation has none of those (see :data:`NOTES`).
- ``blockwise``: torchao 0.18's quantizers (``blockwise_fp8_training.kernels``) import Triton at module level, so
  they cannot run here: :func:`unsupported` says so and the plan leaves the recipe out.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from ampaudit.dtypes import limits
from ampaudit.errors import UsageError
from ampaudit.precision import fp8
from ampaudit.precision.recipes import Recipe

__all__ = ["NOTES", "recipe_linear", "unsupported", "quant_stats", "block_stats"]

# What the plan says about a recipe whose CPU numerics are not exactly torchao's training kernels.
NOTES = {
    "nvfp4": "nvfp4 measured with torchao's NVFP4Tensor (1x16 blocks, E4M3 scales, fp32 tensor scale, round to "
             "nearest); torchao's NVFP4 training kernels need a Blackwell GPU and add a random Hadamard transform "
             "and stochastic rounding of gradients, not emulated here",
}

_FP4_MAX, _FP4_TINY = 6.0, 1.0      # e2m1: largest value, smallest normal (0.5 is its one subnormal)


def _mx_modules():
    import contextlib

    from ampaudit.quiet import debug

    fp8.import_torchao()
    # Their import registers enums with torch's pytree, which logs a deprecation: dropped as fp8's import does.
    with contextlib.nullcontext() if debug() else fp8._import_chatter_dropped():
        from torchao.prototype.moe_training.mxfp8_linear import _to_mxfp8_then_scaled_mm
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

    return _to_mxfp8_then_scaled_mm, ScaleCalculationMode, KernelPreference


def _nvfp4_dq(t: torch.Tensor) -> torch.Tensor:
    """``t`` (2-D, blocks along its last dim) through torchao's NVFP4Tensor and back, in fp32."""
    _mx_modules()
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale

    t = t.float().contiguous()
    q = NVFP4Tensor.to_nvfp4(t, per_tensor_scale=per_tensor_amax_to_scale(t.abs().max()))
    return q.dequantize(torch.float32)


class _NVFP4MM(torch.autograd.Function):
    """input @ weight.T with each GEMM's operands quantized to NVFP4 along that GEMM's reduction dim."""

    @staticmethod
    def forward(ctx, x, weight, hp_grad_weight: bool):
        ctx.save_for_backward(x, weight)
        ctx.hp_grad_weight = hp_grad_weight
        x2 = x.reshape(-1, x.shape[-1])
        out = _nvfp4_dq(x2) @ _nvfp4_dq(weight).t()
        return out.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_output):
        x, weight = ctx.saved_tensors
        go = grad_output.reshape(-1, grad_output.shape[-1]).float()
        x2 = x.reshape(-1, x.shape[-1]).float()
        grad_input = _nvfp4_dq(go) @ _nvfp4_dq(weight.t()).t()          # reduction over N
        if ctx.hp_grad_weight:
            grad_weight = go.t() @ x2
        else:                                                           # reduction over the tokens
            grad_weight = _nvfp4_dq(go.t()) @ _nvfp4_dq(x2.t()).t()
        return grad_input.reshape(x.shape), grad_weight, None


class RecipeLinear(nn.Module):
    """An nn.Linear's forward and backward in one recipe (family ``mx``), on the original's Parameters."""

    def __init__(self, lin: nn.Linear, recipe: Recipe, hp_grad_weight: bool = False):
        super().__init__()
        self.weight, self.bias = lin.weight, lin.bias
        self.recipe, self.hp_grad_weight = recipe, hp_grad_weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recipe.torchao == "nvfp4":
            out = _NVFP4MM.apply(x, self.weight, self.hp_grad_weight)
        else:
            mm, mode, kernel = _mx_modules()
            out = mm(x, self.weight, kernel.EMULATED, mode.RCEIL, wgrad_with_hp=self.hp_grad_weight)
        return out if self.bias is None else out + self.bias


def unsupported(r: Recipe, *, tokens: int, k: int, n: int) -> str | None:
    """Why ``r`` cannot run an M x K -> M x N Linear here (None: it can)."""
    if r.family == "blockwise":
        return ("blockwise: torchao 0.18's blockwise FP8 quantizers import Triton, which this CPU install lacks "
                "(they run only on CUDA)")
    if r.family != "mx":
        return None
    for what, size in (("in_features", k), ("out_features", n), ("tokens", tokens)):
        if size % r.block:
            return f"{what} {size} not a multiple of {r.block} ({r.name} blocks)"
    return None


def recipe_linear(lin: nn.Linear, recipe: Recipe, *, hp_grad_weight: bool = False) -> nn.Module:
    """``lin`` (an nn.Linear) as ``recipe`` trains it, sharing its Parameters; ``hp_grad_weight``: the weight
    gradient unquantized (mx family only: torchao's ``wgrad_with_hp``)."""
    if recipe.family == "float8":
        if hp_grad_weight:
            raise UsageError(f"{recipe.name} has no high-precision wgrad variant",
                             hint="use float8_rowwise_with_gw_hp")
        return fp8.import_torchao().float8_linear.Float8Linear.from_float(lin, config=fp8.config(recipe.torchao))
    if recipe.family == "mx":
        return RecipeLinear(lin, recipe, hp_grad_weight)
    raise UsageError(f"cannot emulate {recipe.name} on this machine", hint="leave it out of --recipes")


def block_stats(t: torch.Tensor, dq: torch.Tensor, decode: torch.Tensor, *, fmt_max: float,
                fmt_tiny: float) -> dict[str, float]:
    """Statistics of one block-scaled cast: ``t`` the original, ``dq`` its dequantized value, ``decode`` the
    per-element scale (dq = code * decode). Keys as :func:`ampaudit.precision.fp8.cast_stats`, plus
    ``scale_range_bits`` (log2 of the largest over the smallest block scale)."""
    x = t.detach().float()
    magnitude = x.abs()
    counted = (magnitude > 0) & torch.isfinite(x)
    n = int(counted.sum())
    decode = decode.float()
    positive = decode[decode > 0]
    scale_range = float(torch.log2(positive.max() / positive.min())) if positive.numel() else 0.0
    smallest_scale = float(1.0 / positive.max()) if positive.numel() else 0.0      # encode = 1 / decode
    out = {"amax": float(magnitude.max()) if x.numel() else 0.0, "scale": smallest_scale,
           "flushed_share": 0.0, "clipped_share": 0.0, "dynamic_range_bits": 0.0, "subnormal_share": 0.0,
           "scale_range_bits": scale_range}
    if n == 0:
        return out
    code = torch.where(decode > 0, x / decode.clamp_min(1e-38), torch.zeros_like(x))
    q_code = (dq.float() / decode.clamp_min(1e-38)).abs()
    out["flushed_share"] = int((counted & (dq == 0)).sum()) / n
    out["clipped_share"] = int((counted & (code.abs() > fmt_max * 1.125)).sum()) / n   # past max's rounding interval
    out["subnormal_share"] = int((counted & (dq != 0) & (q_code < fmt_tiny * (1 - 1e-6))).sum()) / n
    out["dynamic_range_bits"] = math.log2(float(magnitude[counted].max()) / float(magnitude[counted].min()))
    return out


def _mx_cast(r: Recipe, t: torch.Tensor) -> dict[str, float]:
    t = t.float().contiguous()
    _, mode, _ = _mx_modules()
    if r.torchao == "nvfp4":
        from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale

        tensor_scale = per_tensor_amax_to_scale(t.abs().max())
        q = NVFP4Tensor.to_nvfp4(t, per_tensor_scale=tensor_scale)
        decode = (q.scale.float() * tensor_scale).repeat_interleave(r.block, dim=-1)
        return block_stats(t, q.dequantize(torch.float32), decode, fmt_max=_FP4_MAX, fmt_tiny=_FP4_TINY)
    from torchao.prototype.mx_formats.mx_tensor import MXTensor

    q = MXTensor.to_mx(t, torch.float8_e4m3fn, r.block, mode.RCEIL)
    decode = q.scale.float().repeat_interleave(r.block, dim=-1).reshape(t.shape)
    info = limits(torch.float8_e4m3fn)
    return block_stats(t, q.dequantize(torch.float32), decode, fmt_max=info.max, fmt_tiny=info.normal)


def quant_stats(r: Recipe, x: torch.Tensor, weight: torch.Tensor, grad_output: torch.Tensor | None) -> dict:
    """Per cast of an mx-family recipe (keys as measure's float8 casts: input, weight, grad_output along the
    GEMM they feed first, ``*_for_grad_*`` along the other dim), :func:`block_stats` of that cast."""
    x2 = x.reshape(-1, x.shape[-1])
    casts = {"input": x2, "weight": weight.detach(), "weight_for_grad_input": weight.detach().t()}
    if grad_output is not None:
        go = grad_output.reshape(-1, grad_output.shape[-1])
        casts["grad_output"] = go
        casts["grad_output_for_grad_weight"] = go.t()
        casts["input_for_grad_weight"] = x2.t()
    return {key: _mx_cast(r, t) for key, t in casts.items()}
