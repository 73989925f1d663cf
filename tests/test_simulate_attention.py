"""The CUDA simulation computes the fp16 attention backward as CUDA's flash kernels do (ampaudit/cuda_attention.py):
scores and probabilities in fp32, P and dS rounded to half at the kernel's points, fp32 accumulation over the
whole sequence, each gradient rounded to half once; not with CPU's slow fp16 kernel, which also rounds partial
sums. Checked against the same steps evaluated in float64."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from ampaudit import cuda_attention
from ampaudit.policy import Policy, kernels
from ampaudit.simulate import target_autocast

EPS16 = torch.finfo(torch.float16).eps
FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
HALF = frozenset({"float16"})


def _cuda_steps(grad_out, q, k, v, out, lse, mask, causal):
    """CUDA's rounding points, the sums exact (float64), each result rounded to half."""
    d = [t.double() for t in (grad_out, q, k, v, out)]
    grad_out, q, k, v, out = d
    scale = 1 / math.sqrt(q.shape[-1])
    s = q @ k.transpose(-1, -2) * scale
    if mask is not None:
        s = s + mask.double()
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).tril().logical_not(), -math.inf)
    p = torch.exp(s - lse.double()[..., None])
    dv = p.half().double().transpose(-1, -2) @ grad_out
    ds = (p * (grad_out @ v.transpose(-1, -2) - (grad_out * out).sum(-1, keepdim=True))).half().double()
    return [t.half() for t in (ds @ k * scale, ds.transpose(-1, -2) @ q * scale, dv)]


CASES = {   # (batch, heads, queries, keys, dim, mask, causal): rows past one block, a mask, a causal one
    "plain": (1, 3, 300, 300, 64, False, False),
    "mask": (2, 2, 140, 4200, 32, True, False),       # 124 queries a block: two blocks
    "causal": (1, 2, 300, 300, 16, False, True),
}


@pytest.mark.parametrize("name", list(CASES))
def test_the_backward_is_cudas_steps_within_fp32_summation_order(name):
    batch, heads, length, keys, dim, masked, causal = CASES[name]
    torch.manual_seed(0)
    q = torch.randn(batch, heads, length, dim).half()
    k, v = torch.randn(batch, heads, keys, dim).half(), torch.randn(batch, heads, keys, dim).half()
    mask = torch.randn(length, keys).half() if masked else None
    kw = {} if mask is None else {"attn_mask": mask}
    out, lse = FWD(q, k, v, 0.0, causal, **kw)
    args = (torch.randn(batch, heads, length, dim).half(), q, k, v, out, lse, 0.0, causal)
    assert cuda_attention.applies(args, kw, HALF)
    got = cuda_attention.flash_backward(*args, **kw)
    want = _cuda_steps(*args[:6], mask, causal)
    cpu = BWD(*args, **kw)
    for g, w, c in zip(got, want, cpu):
        assert g.dtype == torch.float16 and g.shape == w.shape and g.stride() == c.stride()
        scale = float(w.float().abs().max())
        torch.testing.assert_close(g.float(), w.float(), rtol=EPS16, atol=EPS16 * scale)
        assert (g != w).float().mean() < 0.03          # all but 1-2% of elements bitwise: summation order
        # CPU's fp16 kernel: the same within a few roundings of its fp16 partial sums
        torch.testing.assert_close(c.float(), w.float(), rtol=4 * EPS16, atol=4 * EPS16 * scale)


def test_the_cpu_kernel_rounds_partial_sums_and_this_does_not():
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 2, 600, 64).half() for _ in range(3))
    out, lse = FWD(q, k, v)
    args = (torch.randn(1, 2, 600, 64).half(), q, k, v, out, lse, 0.0, False)
    want = _cuda_steps(*args[:6], None, False)
    dk_cpu, dk_sim = BWD(*args)[1], cuda_attention.flash_backward(*args)[1]
    assert (dk_cpu != want[1]).float().mean() > 0.2 > 0.02 > (dk_sim != want[1]).float().mean()


def test_the_simulation_runs_it_for_fp16_sdpa_and_keeps_cpus_kernel_otherwise():
    torch.manual_seed(0)
    x = torch.randn(1, 4, 80, 32)

    def grads(dtype, policy, **kw):
        q = x.to(dtype).requires_grad_()
        with target_autocast(policy, "cpu") as sim:
            F.scaled_dot_product_attention(q, q * 0.5, q, **kw).float().square().sum().backward()
        return q.grad, sim

    g, sim = grads(torch.float16, Policy.load("cuda", "float16"))
    assert sim.in_fp32.get("_scaled_dot_product_flash_attention_for_cpu_backward") == 1
    _, sim = grads(torch.float16, Policy.load("cuda", "float16"), dropout_p=0.5)
    assert "_scaled_dot_product_flash_attention_for_cpu_backward" not in sim.in_fp32     # dropout: real kernel
    _, sim = grads(torch.bfloat16, Policy.load("cuda", "bfloat16"))
    assert "_scaled_dot_product_flash_attention_for_cpu_backward" not in sim.in_fp32     # bf16: fast kernels
    assert "_scaled_dot_product_flash_attention_for_cpu_backward" in kernels()["simulated_in_fp32"]


def test_a_boolean_mask_or_other_heads_go_to_the_real_kernel():
    q = torch.zeros(1, 2, 8, 4).half()
    lse = torch.zeros(1, 2, 8)
    args = (q, q, q, q, q, lse, 0.0, False)
    assert cuda_attention.applies(args, {}, HALF)
    assert not cuda_attention.applies(args, {"attn_mask": torch.ones(8, 8, dtype=torch.bool)}, HALF)
    assert not cuda_attention.applies(args, {}, frozenset({"bfloat16"}))
    assert not cuda_attention.applies((q, q, q[:, :1], q[:, :1], q, lse, 0.0, False), {}, HALF)
