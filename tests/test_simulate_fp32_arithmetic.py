"""The CUDA simulation computes fp16 convolution and convolution_backward as CUDA's kernel does (fp32 on the half inputs, each
output rounded to half: rules/policy/kernels.toml ``simulated_in_fp32``), not with CPU's slow half kernel; the
results are the half kernel's within one rounding, and a CPU target keeps CPU's kernels."""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from ampaudit.policy import Policy, kernels
from ampaudit.simulate import target_autocast

EPS16 = torch.finfo(torch.float16).eps
ATOL_CPU_HALF = 4 * EPS16     # of the largest magnitude: how CPU's half kernels round their partial sums

# (conv, input shape, weight shape): one of each kind a model reaches convolution_backward through; 6 output
# channels each (a transposed conv's weight is in x out).
CONVS = {
    "conv1d": (F.conv1d, (2, 8, 20), (6, 8, 3)),
    "conv2d": (F.conv2d, (2, 8, 10, 10), (6, 8, 3, 3)),
    "conv3d": (F.conv3d, (1, 8, 4, 8, 8), (6, 8, 3, 3, 3)),
    "conv_transpose3d": (F.conv_transpose3d, (1, 8, 3, 5, 5), (8, 6, 3, 3, 3)),
}


def _inputs(x_shape, w_shape, dtype):
    torch.manual_seed(0)
    x = torch.randn(x_shape).to(dtype).requires_grad_()
    w = (torch.randn(w_shape) * 0.2).to(dtype).requires_grad_()
    b = torch.randn(6).to(dtype).requires_grad_()
    return x, w, b


def _grads(conv, x, w, b):
    out = conv(x, w, b)
    # The same upstream gradient whatever the dtype: fp16-representable values.
    upstream = torch.linspace(-1, 1, out.numel()).reshape(out.shape).half().to(out.dtype)
    return (out, *torch.autograd.grad(out, (x, w, b), upstream))


@pytest.mark.parametrize("name", list(CONVS))
def test_fp16_conv_backward_is_cudas_arithmetic_and_the_half_kernels_within_a_rounding(name):
    conv, xs, ws = CONVS[name]
    x, w, b = _inputs(xs, ws, torch.float16)
    with target_autocast(Policy.load("cuda", "float16"), "cpu") as sim:
        simulated = _grads(conv, x, w, b)
    assert sim.in_fp32.get("convolution_backward", 0) >= 1           # the fast path was taken
    assert sim.in_fp32.get("convolution", 0) >= 1                    # the forward too (no reference kernel)
    assert all(t.dtype == torch.float16 for t in simulated)
    # CUDA's arithmetic: fp32 on the half-rounded inputs, each result rounded once to half (the forward's bias
    # added before that rounding, as CPU's half kernels add it).
    up = [t.detach().float().requires_grad_() for t in (x, w, b)]
    cuda = [t.half() for t in _grads(conv, *up)]
    for got, want in zip(simulated, cuda):
        assert torch.equal(got.detach(), want.detach())
    # CPU's half kernel: the same within a few fp16 roundings of the largest magnitude. With avx512_fp16 it
    # accumulates in fp32 (within 1e-4 of it); without, the reference backward rounds partial sums (up to 1.6
    # EPS16 of the largest gradient on an AMD EPYC with avx512_bf16 only).
    half = _grads(conv, x, w, b)
    for got, want in zip(simulated, half):
        got, want = got.detach().float(), want.detach().float()
        torch.testing.assert_close(got, want, rtol=EPS16, atol=ATOL_CPU_HALF * float(want.abs().max()))


def test_bfloat16_and_cpu_targets_keep_cpus_kernels():
    conv, xs, ws = CONVS["conv2d"]
    x, w, b = _inputs(xs, ws, torch.bfloat16)
    with target_autocast(Policy.load("cuda", "bfloat16"), "cpu") as sim:
        _grads(conv, x, w, b)
    assert sim.in_fp32 == {}                   # not listed for bf16: CPU's bf16 kernels are fast
    x, w, b = _inputs(xs, ws, torch.float16)
    with target_autocast(Policy.load("cpu", "float16"), "cpu") as sim:
        on_cpu = _grads(conv, x, w, b)
    assert sim is None                         # no simulation: CPU's own half kernels ran
    for got, want in zip(on_cpu, _grads(conv, x, w, b)):
        assert torch.equal(got, want)


def test_mixed_dtypes_go_to_the_real_kernel():
    grad, x, w = torch.randn(1, 4, 6, 6).half(), torch.randn(1, 3, 8, 8).half(), torch.randn(4, 3, 3, 3)
    with target_autocast(Policy.load("cuda", "float16"), "cpu") as sim:
        with contextlib.suppress(RuntimeError):      # the real kernel may refuse them (as CUDA's does)
            torch.ops.aten.convolution_backward(grad, x, w, [4], [1, 1], [0, 0], [1, 1], False, [0, 0], 1,
                                                [True, True, True])
    assert sim.in_fp32 == {}


def test_the_table_names_aten_ops_and_half_dtypes():
    table = kernels()["simulated_in_fp32"]
    assert table, "kernels.toml [simulated_in_fp32] lists no op"
    for op, dtypes in table.items():
        assert hasattr(torch.ops.aten, op), op
        assert dtypes and dtypes <= {"float16", "bfloat16"}, (op, dtypes)


def test_fp16_gemms_are_cublas_arithmetic_fp32_accumulated_and_rounded_once():
    torch.manual_seed(0)
    gemms = {"mm": (torch.mm, (torch.randn(32, 48), torch.randn(48, 16))),
             "addmm": (F.linear, (torch.randn(32, 48), torch.randn(16, 48), torch.randn(16))),
             "bmm": (torch.bmm, (torch.randn(3, 32, 48), torch.randn(3, 48, 16)))}
    for name, (gemm, operands) in gemms.items():
        half = [t.half() for t in operands]
        with target_autocast(Policy.load("cuda", "float16"), "cpu") as sim:
            got = gemm(*half)
        assert sim.in_fp32.get(name, 0) >= 1, (name, sim.in_fp32)
        want = gemm(*[t.float() for t in half]).half()
        assert got.dtype == torch.float16 and torch.equal(got, want), name


def _conv_without_data(where: str) -> tuple[torch.Tensor, dict]:
    from torch._subclasses.fake_tensor import FakeTensorMode

    x, w, b = (t.detach() for t in _inputs((2, 8, 10, 10), (6, 8, 3, 3), torch.float16))
    x = x.to(memory_format=torch.channels_last)         # strides the output keeps
    mode = FakeTensorMode() if where == "fake" else contextlib.nullcontext()
    with mode:
        args = [mode.from_tensor(t) for t in (x, w, b)] if where == "fake" else [t.to("meta") for t in (x, w, b)]
        with target_autocast(Policy.load("cuda", "float16"), "cpu") as sim:
            out = F.conv2d(*args)
    return out, sim.in_fp32


@pytest.mark.parametrize("where", ["fake", "meta"])
def test_tensors_without_data_run_the_op_itself_with_the_same_dtype_shape_and_strides(monkeypatch, where):
    """An export traces on fake tensors (a meta-built model on meta ones): there the fp32 copies of the CUDA
    arithmetic would compute nothing anyone reads, so the op runs as it is; what the trace sees is the same."""
    import ampaudit.simulate as simulate

    with monkeypatch.context() as m:
        m.setattr(simulate, "_without_data", lambda tree: False)        # the fp32 path, as on real tensors
        before, _ = _conv_without_data(where)
    calls = []
    real_in_fp32 = simulate._in_fp32
    monkeypatch.setattr(simulate, "_in_fp32", lambda *a: calls.append(a) or real_in_fp32(*a))
    out, in_fp32 = _conv_without_data(where)
    assert not calls and in_fp32.get("convolution") == 1               # counted as before, not computed
    assert (out.dtype, out.shape, out.stride()) == (before.dtype, before.shape, before.stride())
    assert out.dtype == torch.float16 and before.device == out.device
