"""Which CPU half kernels are pathologically slow: forward and backward time of each convolution in float16 and
bfloat16 over float32, on this CPU, and the fp16 backward under the CUDA simulation (rules/policy/kernels.toml
``simulated_in_fp32``, which computes it as CUDA's kernel does: fp32 on the half inputs, rounded to half).

    OMP_NUM_THREADS=1 python bench/half_kernel_speed.py          # one line per op: ratios to fp32
    OMP_NUM_THREADS=1 python bench/half_kernel_speed.py --reps 5
    OMP_NUM_THREADS=1 .venv-bench/bin/python bench/half_kernel_speed.py --model torchvision-video/swin3d_t
        # one forward + backward of a coverage model (bench/coverage_models.py), fp32 then simulated fp16
    ... --model torchvision-flow/raft_small --cpu-half-kernels    # the same with CPU's fp16 conv backward

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


def model_pass(family_name: str) -> None:
    """Seconds of one forward + backward (of the mean of the last output) of a coverage model in fp32, then under
    the CUDA fp16 simulation, and how many ops the simulation computed in fp32."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from coverage_tvops import import_torchvision
    import_torchvision()
    from coverage_models import build

    family, _, name = family_name.partition("/")
    built = build({"family": family, "name": name}, "cpu")
    params = [p for p in built.model.parameters() if p.requires_grad]

    def run():
        out = built.model(*built.args, **built.kwargs)
        out = out[-1] if isinstance(out, (list, tuple)) else out
        torch.autograd.grad(out.float().mean(), params, allow_unused=True)

    start = time.perf_counter()
    run()
    fp32 = time.perf_counter() - start
    with target_autocast(Policy.load("cuda", "float16"), "cpu") as sim:
        start = time.perf_counter()
        run()
        low = time.perf_counter() - start
    print(f"{family_name}: fp32 {fp32:.1f} s, simulated fp16 {low:.1f} s (x{low / fp32:.2f}); in fp32: {sim.in_fp32}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--model", default=None, help="FAMILY/NAME of bench/coverage_models.py: time that model instead")
    p.add_argument("--cpu-half-kernels", action="store_true",
                   help="the simulation without kernels.toml's simulated_in_fp32 (CPU's half kernels): the before")
    args = p.parse_args()
    if args.cpu_half_kernels:
        from ampaudit.policy import kernels
        kernels()["simulated_in_fp32"].clear()
    if args.model:
        return model_pass(args.model)
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
