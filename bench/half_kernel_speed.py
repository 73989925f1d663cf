"""Which CPU half kernels are pathologically slow: forward and backward time of each convolution in float16 and
bfloat16 over float32, on this CPU, and the fp16 backward under the CUDA simulation (rules/policy/kernels.toml
``simulated_in_fp32``, which computes it as CUDA's kernel does: fp32 on the half inputs, rounded to half).

    OMP_NUM_THREADS=1 python bench/half_kernel_speed.py          # one line per op: ratios to fp32
    OMP_NUM_THREADS=1 python bench/half_kernel_speed.py --reps 5

Times are the best of ``--reps`` after one warm-up, taken in turn in the same process, so only the ratios are
meant to be compared (the machine may be shared).
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from ampaudit.policy import Policy
from ampaudit.simulate import target_autocast

# (name, function, input shape, weight shape, keyword arguments): shapes of a small video/flow/diffusion layer.
CASES = [
    ("conv1d", F.conv1d, (2, 64, 256), (64, 64, 3), {}),
    ("conv2d", F.conv2d, (2, 32, 56, 56), (32, 32, 3, 3), {}),
    ("conv3d", F.conv3d, (1, 32, 8, 28, 28), (32, 32, 3, 3, 3), {}),
    ("conv3d 1x1x1", F.conv3d, (1, 64, 8, 28, 28), (64, 64, 1, 1, 1), {}),
    ("conv3d depthwise", F.conv3d, (1, 32, 8, 28, 28), (32, 1, 3, 3, 3), {"groups": 32}),
    ("conv_transpose2d", F.conv_transpose2d, (2, 32, 28, 28), (32, 32, 3, 3), {}),
    ("conv_transpose3d", F.conv_transpose3d, (1, 32, 4, 14, 14), (32, 32, 3, 3, 3), {}),
]


def best(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def timings(fn, x_shape, w_shape, kw, dtype, reps: int, simulate: bool = False) -> tuple[float, float]:
    """(forward, backward) seconds of ``fn`` on ``dtype`` tensors; ``simulate``: inside the CUDA fp16 simulation."""
    torch.manual_seed(0)
    x = torch.randn(x_shape, dtype=dtype, requires_grad=True)
    w = (torch.randn(w_shape) * 0.1).to(dtype).requires_grad_()

    def forward():
        return fn(x, w, **kw)

    def backward():
        out = forward()
        torch.autograd.grad(out, (x, w), torch.ones_like(out))

    if not simulate:
        fwd = best(forward, reps)
        return fwd, max(best(backward, reps) - fwd, 0.0)
    with target_autocast(Policy.load("cuda", "float16"), "cpu"):
        fwd = best(forward, reps)
        return fwd, max(best(backward, reps) - fwd, 0.0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()
    print(f"{'op':18s} {'fp32 fwd/bwd ms':>16s}  {'fp16 fwd':>8s} {'fp16 bwd':>8s}  {'bf16 fwd':>8s} {'bf16 bwd':>8s}"
          f"  {'sim fp16 bwd':>12s}")
    for name, fn, xs, ws, kw in CASES:
        f32 = timings(fn, xs, ws, kw, torch.float32, args.reps)
        f16 = timings(fn, xs, ws, kw, torch.float16, args.reps)
        b16 = timings(fn, xs, ws, kw, torch.bfloat16, args.reps)
        sim = timings(fn, xs, ws, kw, torch.float16, args.reps, simulate=True)
        ratio = lambda a, b: f"x{a / b:7.1f}" if b > 0 else "      -"
        print(f"{name:18s} {f32[0] * 1e3:7.1f} / {f32[1] * 1e3:6.1f}  {ratio(f16[0], f32[0])} {ratio(f16[1], f32[1])}"
              f"  {ratio(b16[0], f32[0])} {ratio(b16[1], f32[1])}  {ratio(sim[1], f32[1]):>12s}", flush=True)


if __name__ == "__main__":
    main()
