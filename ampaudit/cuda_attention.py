"""The fp16 attention backward as CUDA's flash kernels compute it, for the CUDA simulation on a CPU.

    dq, dk, dv = flash_backward(grad_out, q, k, v, out, logsumexp, 0.0, False)   # fp16 in, fp16 out

CPU's fp16 ``_scaled_dot_product_flash_attention_for_cpu_backward`` is a reference kernel on a CPU without
avx512_fp16 (fp16 GEMMs through a scalar path: 7-8x fp32 at 12 heads x 1024 tokens x 64, the backward of every
fp16 ``scaled_dot_product_attention``; 78% of a simulated forward+backward of timm's qwen3_vit). CUDA's kernels
for fp16 attention (FlashAttention-2, the memory-efficient kernel, cuDNN's) compute the backward so: scores
``S = scale * q @ k.T`` accumulated in fp32 from the half inputs, the probabilities ``P = exp(S - logsumexp)``
in fp32, ``D = rowsum(grad_out * out)`` in fp32; ``P`` rounded to half for ``dv = P.T @ grad_out``, ``dS = P *
(grad_out @ v.T - D)`` in fp32 and rounded to half for ``dq = scale * dS @ k`` and ``dk = scale * dS.T @ q``;
each GEMM accumulates in fp32 over the whole sequence (tensor cores read half operands and accumulate in fp32)
and ``dq``, ``dk``, ``dv`` are rounded to half once. :func:`flash_backward` computes exactly those steps with
fp32 GEMMs on the half-rounded operands; what differs from CUDA is only the order of the fp32 summation.
CPU's fp16 kernel rounds ``P`` and ``dS`` at the same points but also adds each 256-query or 512-key block's
share into fp16 ``dq``/``dk``/``dv``, rounding every partial sum: this is closer to CUDA's arithmetic than the
kernel it replaces.

The scores are computed a block of queries at a time (:data:`BLOCK_BYTES` of them), so the L x S matrices of a
long sequence never exist whole and the steps between the GEMMs stay in cache: 0.8 CPU s for 12 heads x 2304
tokens x 64 on one thread, where CPU's fp16 kernel takes 7 s and its fp32 one 0.66 s. Dropout (a random mask this
cannot replay) and a boolean mask go to the real kernel: :func:`applies` says which calls this computes.
"""
from __future__ import annotations

import math

import torch

from ampaudit.dtypes import name_of

# fp32 bytes of one block's scores (queries x keys x heads; P and dS each take that much): about what one core's
# cache holds, so the elementwise steps between the GEMMs read cache, not memory (2x faster than whole heads).
BLOCK_BYTES = 2 << 20
MIN_ROWS = 64


def applies(args: tuple, kwargs: dict, dtypes: frozenset[str]) -> bool:
    """Whether :func:`flash_backward` computes this call of the CPU flash-attention backward: ``grad_out``,
    ``q``, ``k``, ``v`` and ``out`` of one dtype among ``dtypes`` (names), no dropout, a floating mask or none,
    and as many key/value heads as query heads."""
    tensors, mask = args[:5], kwargs.get("attn_mask")
    dropout_p = args[6] if len(args) > 6 else kwargs.get("dropout_p", 0.0)
    if len(tensors) < 5 or not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in tensors):
        return False
    grad_out, q, k, v, _ = tensors
    return (len({t.dtype for t in tensors}) == 1 and name_of(q.dtype) in dtypes and not dropout_p
            and (mask is None or mask.is_floating_point())
            and k.shape[:2] == q.shape[:2] and v.shape[:2] == q.shape[:2]
            and grad_out.shape == q.shape[:3] + v.shape[3:])


def flash_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   logsumexp: torch.Tensor, dropout_p: float, is_causal: bool, *,
                   attn_mask: torch.Tensor | None = None, scale: float | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``aten._scaled_dot_product_flash_attention_for_cpu_backward`` (tensors ``(batch, heads, length, dim)``,
    ``logsumexp`` fp32 ``(batch, heads, length)``) with CUDA's arithmetic; see the module docstring. The
    gradients have the strides CPU's kernel gives them."""
    low = q.dtype
    length, dim = q.shape[2:]
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    mask = _mask(attn_mask, is_causal, length, k.shape[2])
    meta = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        *(t.to("meta") for t in (grad_out, q, k, v, out, logsumexp)), dropout_p, is_causal,
        attn_mask=None if attn_mask is None else attn_mask.to("meta"), scale=scale)
    grads = [torch.empty_strided(t.shape, t.stride(), dtype=low) for t in meta]
    keys = k.shape[2]
    rows = max(MIN_ROWS, BLOCK_BYTES // (4 * keys))
    per = max(1, BLOCK_BYTES // (4 * keys * min(rows, length)))    # heads per block, for short sequences
    with torch.autocast("cpu", enabled=False):      # fp32 GEMMs, whatever autocast the backward runs under
        for b in range(q.shape[0]):
            for h in range(0, q.shape[1], per):
                at = (b, slice(h, h + per))
                parts = _heads(*(t[at] for t in (grad_out, q, k, v, out, logsumexp)), _mask_of(mask, b, h, per),
                               scale, rows)
                for grad, part in zip(grads, parts):
                    grad[at] = part
    return grads[0], grads[1], grads[2]


def _mask(attn_mask: torch.Tensor | None, is_causal: bool, length: int, keys: int) -> torch.Tensor | None:
    """The additive fp32 mask as a 4-d ``(batch or 1, heads or 1, length, keys)`` tensor, the causal one
    (top-left aligned, as CPU's kernel and ``is_causal`` mean it) folded in; None when there is neither."""
    mask = None
    if attn_mask is not None:
        mask = attn_mask.float()
        while mask.dim() < 4:
            mask = mask.unsqueeze(0)
    if is_causal:
        causal = torch.ones(length, keys, dtype=torch.bool).tril().logical_not()
        causal = torch.zeros(length, keys).masked_fill_(causal, -math.inf)[None, None]
        mask = causal if mask is None else mask + causal
    return mask


def _mask_of(mask: torch.Tensor | None, b: int, h: int, heads: int) -> torch.Tensor | None:
    """Batch ``b``'s share of the 4-d mask for heads ``h`` to ``h + heads``, broadcastable to them."""
    if mask is None:
        return None
    mask = mask[b if mask.shape[0] > 1 else 0]
    return mask[h:h + heads] if mask.shape[0] > 1 else mask


def _heads(grad_out, q, k, v, out, lse, mask, scale: float, rows: int):
    """A few heads, ``(heads, length, dim)`` each (``lse`` ``(heads, length)``, ``mask`` broadcastable to
    ``(heads, length, keys)``): the steps of the module docstring, ``rows`` queries at a time, so that each
    block's scores stay in cache; ``dk`` and ``dv`` accumulate in fp32 over the blocks, as CUDA's do."""
    low = q.dtype
    k32, v32 = k.float(), v.float()
    dq = torch.empty(q.shape, dtype=low)
    dk32, dv32 = torch.zeros(k32.shape), torch.zeros(v32.shape)
    for r in range(0, q.shape[1], rows):
        at = (slice(None), slice(r, r + rows))
        q32, grad32 = q[at].float(), grad_out[at].float()
        probs = torch.baddbmm(lse[at].unsqueeze(-1), q32, k32.transpose(1, 2), beta=-1, alpha=scale)
        if mask is not None:                                         # scale * q @ k.T + mask - lse
            probs.add_(mask[at] if mask.shape[1] > 1 else mask)
        probs.exp_()                                                 # fp32 P
        dv32.baddbmm_(probs.to(low).float().transpose(1, 2), grad32)
        rowsum = (grad32 * out[at].float()).sum(-1, keepdim=True)    # D
        ds = torch.baddbmm(rowsum, grad32, v32.transpose(1, 2), beta=-1).mul_(probs).to(low).float()
        del probs
        dq[at] = torch.bmm(ds, k32).mul_(scale)
        dk32.baddbmm_(ds.transpose(1, 2), q32)
    return dq, dk32.mul_(scale).to(low), dv32.to(low)
