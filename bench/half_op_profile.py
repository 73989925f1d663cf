"""Per aten op, where one forward+backward of a corpus model spends its time in FP32 and under the CUDA fp16
simulation (torch.profiler, self CPU time): which CPU half kernels are slow enough to need kernels.toml's
``simulated_in_fp32``.

    OMP_NUM_THREADS=1 PYTHONPATH=$PWD .venv-bench/bin/python bench/half_op_profile.py transformers-all/regnet
    OMP_NUM_THREADS=1 PYTHONPATH=$PWD .venv-bench/bin/python bench/half_op_profile.py timm/samvit_base_patch16 --depth 3

``--depth N`` builds a timm model with its first N blocks only (``timm.create_model(name, depth=N)``, the same
inputs): a large ViT's blocks in the proportions of the whole, at a fraction of its time. Prints the two passes' seconds (and the ops the simulation computed in fp32), then the slowest ops of the
simulated pass beside the same op's FP32 time and call count. The backward differentiates the mean of the
outputs, as calibration does without a loss. One process, one pass each after a warm-up: only ratios mean
anything on a shared machine.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def profile(family_name: str, top: int, depth: int | None = None) -> None:
    from torch.profiler import ProfilerActivity, profile as torch_profile

    from ampaudit.analysis.calibrate import batch_loss
    from ampaudit.policy import Policy
    from ampaudit.simulate import target_autocast
    from coverage_models import build
    from coverage_tvops import import_torchvision

    import_torchvision()
    family, _, name = family_name.partition("/")
    built = build({"family": family, "name": name}, "cpu")
    model, loss = built.model, batch_loss(None, None)
    if depth is not None:
        if family != "timm":
            raise SystemExit("--depth is for timm models")
        import timm

        torch.manual_seed(0)
        model = timm.create_model(name, pretrained=False, depth=depth).eval()

    def run(low: bool) -> None:
        with torch.autocast("cpu", dtype=torch.float16, enabled=low):
            out = model(*built.args, **built.kwargs)
        total = loss(out)
        if total is not None:
            total.backward()
        model.zero_grad(set_to_none=True)

    per_op = {}
    for low in (False, True):
        with target_autocast(Policy.load("cuda", "float16"), "cpu", enter_autocast=False) as sim:
            run(low)                                      # warm-up
            start = time.perf_counter()
            with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
                run(low)
            seconds = time.perf_counter() - start
        print(f"{'simulated fp16' if low else 'fp32':14s} {seconds:7.2f} s"
              + (f"  in fp32: {sim.in_fp32}" if low and sim is not None else ""))
        per_op[low] = {e.key: (e.self_cpu_time_total / 1e3, e.count) for e in prof.key_averages()}
    print(f"{'op (self CPU)':44s} {'simulated ms':>12s} {'calls':>6s} {'fp32 ms':>9s} {'calls':>6s}")
    for key, (ms, calls) in sorted(per_op[True].items(), key=lambda kv: -kv[1][0])[:top]:
        f32 = per_op[False].get(key, (0.0, 0))
        print(f"{key[:44]:44s} {ms:12.1f} {calls:6d} {f32[0]:9.1f} {f32[1]:6d}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", help="FAMILY/NAME of bench/coverage_models.py: transformers-all/regnet, ...")
    p.add_argument("--top", type=int, default=15, help="how many ops to list (default 15)")
    p.add_argument("--depth", type=int, default=None, help="a timm model's first N blocks only")
    args = p.parse_args(argv)
    profile(args.model, args.top, args.depth)
    return 0


if __name__ == "__main__":
    sys.exit(main())
