"""A GPU day in one run: every CUDA claim ampaudit simulates on CPU, checked on a real GPU, and the headline
speed-ups measured, inside one command of at most ten minutes.

    python bench/gpu_day.py --dry-run              # what it would run, the figures, the budget split (no GPU needed)
    python bench/gpu_day.py --out gpu-day          # every part, 480 s of measuring; gpu-day/gpu_day.{json,md}
    python bench/gpu_day.py --only fp8 --budget-s 120
    python bench/gpu_day.py --simulate --tiny      # the plumbing on a CPU (its figures are no GPU numbers)

Parts (``--only NAME``), in order:
  policy       output dtype of every op of PyTorch's own CUDA autocast test lists and every node of the samples
               and planted models: real CUDA autocast vs rules/policy vs the CPU simulation (goal: no row)
  calibration  ``check --calibrate`` calibrated on the GPU vs the simulated CUDA target: the same findings,
               module for module
  trainer      the sample transformer scaled to 152M parameters: tokens/s and peak memory of FP32, fp16 O1,
               bf16 O1, bf16 O2 (then FP32 with TF32) under ``ampaudit.Trainer`` and a hand-written loop,
               alternated in one process
  watch        watch's statistics and divergence (every 50 steps) against no hooks, at those step times
  fp8          torchao Float8Linear (tensorwise, rowwise; eager, then compiled) vs bf16 per Linear shape of
               the sample and of Llama-3-8B, against ampaudit/planning/speed.py's roofline for this GPU

Without CUDA (and without ``--simulate``) each part records "skipped: no CUDA" and the run exits 0.

Output: ``OUT/gpu_day.json`` (machine, torch/CUDA/torchao versions, every figure with its baseline and their
ratio, the disagreement tables) and ``OUT/gpu_day.md``, both rewritten (atomically) after every figure, so a
run stopped by a time limit keeps what finished. ``--budget-s`` is shared by the parts in proportion to their
shares (time one leaves unused goes to the next); a part stops between measurements when its share is spent,
and an alarm stops a stuck measurement ``--grace-s`` after the whole budget.

Install, on a bare machine with network (a CUDA build of torch, torchao, the project):

    pip install torch --index-url https://download.pytorch.org/whl/cu128 && pip install torchao && pip install -e .

On a machine that already has a CUDA torch and no network (an image with torch, numpy and networkx: all this
script imports besides torchao), carry a torchao wheel built for that torch (torchao's compatibility table) in
``.whl/``, fetched elsewhere with ``pip download --no-deps --only-binary=:all: --python-version 3.12
--platform manylinux_2_28_x86_64 -d .whl torchao==VERSION``, and run the project from its checkout, timing the
install into the JSON:

    t0=$(date +%s); python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl \\
      && export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 \\
      && python3 bench/gpu_day.py --install-s $(( $(date +%s) - t0 )) --out $OUT

What the install costs has not been measured yet (no GPU has run this script): a local wheel install is
expected to take seconds and a network install of CUDA torch minutes; the JSON's ``install_s`` holds the
figure of the run. The default budget, 480 s of measuring plus 30 s grace, leaves about a minute and a half of
a ten-minute command for the install and the start.
"""
from __future__ import annotations

import argparse
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from gpu_day_device import Device, cuda_device, machine, simulated_cuda  # noqa: E402
from gpu_day_record import Budget, BudgetExceeded, Record  # noqa: E402

NO_CUDA = "skipped: no CUDA"


@dataclass(frozen=True)
class Part:
    """One part: where its code is, its share of the budget, its settings on a GPU and in ``--tiny``."""

    module: str
    function: str
    share: float
    figures: str
    gpu: dict = field(default_factory=dict)
    tiny: dict = field(default_factory=dict)

    def runner(self) -> Callable:
        return getattr(__import__(self.module), self.function)


PARTS = {
    "policy": Part("gpu_day_truth", "policy_truth", 1.0,
                   "per dtype: test-list ops and model nodes whose CUDA dtype differs from rules/policy or the "
                   "simulation (baseline: how many were compared); table 'disagreements'",
                   tiny={"dtypes": ["bfloat16"], "models": 2}),
    "calibration": Part("gpu_day_truth", "calibration_truth", 1.5,
                        "per dtype: models whose calibrated findings are identical (baseline: models compared); "
                        "table 'differing findings'", tiny={"dtypes": ["bfloat16"], "models": 1}),
    "trainer": Part("gpu_day_train", "trainer_speed", 3.0,
                    "per config and loop: tokens/s and peak MiB (baseline: the same loop in FP32); trainer / "
                    "hand-written step time", gpu={"rounds": 3, "steps": 10},
                    tiny={"shape": "tiny", "rounds": 1, "steps": 1, "configs": ["fp32", "bf16 O2"]}),
    "watch": Part("gpu_day_train", "watch_cost", 1.5,
                  "step time of watch(stats), watch(divergence every 50), both (baseline: no hooks)",
                  gpu={"steps": 100, "warmup": 5, "chunk": 10},
                  tiny={"shape": "tiny", "steps": 4, "warmup": 1, "chunk": 2}),
    "fp8": Part("gpu_day_fp8", "fp8_speed", 3.0,
                "per Linear shape, recipe and eager/compiled: fp8 speed-up over bf16 (baseline: the roofline's "
                "prediction for this GPU); table 'per shape'",
                tiny={"modes": ["eager"], "models": ["sample"], "tokens": 32, "max_shapes": 2, "iters": 1,
                      "gpu": "h200"}),
}


def run_part(name: str, record: Record, budget: Budget, still: list[str], dev: Device | None, tiny: bool) -> None:
    part = PARTS[name]
    record.start(name)
    if dev is None:
        record.finish(name, NO_CUDA)
        print(f"{name}: {NO_CUDA}")
        return
    with budget.part(name, still) as share:
        print(f"{name}: {share.seconds:.0f} s", flush=True)
        try:
            status = part.runner()(record, share, dev, part.tiny if tiny else part.gpu)
        except BudgetExceeded:
            raise
        except Exception as exc:        # one broken part must not cost the others their figures
            record.data["parts"][name]["traceback"] = traceback.format_exc(limit=8)
            status = f"error: {type(exc).__name__}: {exc}"[:300]
    record.finish(name, status)
    print(f"{name}: {status}", flush=True)


def dry_run(names: list[str], budget: Budget, dev: Device | None, tiny: bool) -> None:
    print(f"device: {dev.name if dev else 'none (no CUDA): every part would say ' + repr(NO_CUDA)}")
    print(f"budget: {budget.total_s:g} s of measuring, shared as below (unused time passes to the next part)")
    for name, seconds in budget.split(names).items():
        part = PARTS[name]
        cfg = part.tiny if tiny else part.gpu
        alone = f"python bench/gpu_day.py --only {name} --budget-s {seconds:.0f}" + (" --tiny" if tiny else "")
        print(f"\n{name:<12} {seconds:6.0f} s   {part.module}.{part.function}({cfg or ''})")
        print(f"{'':<12} alone: {alone}")
        print(f"{'':<12} figures: {part.figures}")


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="list the parts, their figures and the budget split")
    ap.add_argument("--only", choices=sorted(PARTS), action="append", help="run this part (repeatable)")
    ap.add_argument("--budget-s", type=float, default=480.0, help="seconds of measuring, all parts together")
    ap.add_argument("--grace-s", type=float, default=30.0, help="after the budget, stop a stuck measurement")
    ap.add_argument("--out", type=Path, default=Path("gpu-day"), help="folder for gpu_day.json and gpu_day.md")
    ap.add_argument("--install-s", type=float, default=None, help="the install's measured seconds, for the JSON")
    ap.add_argument("--simulate", action="store_true",
                    help="run on the CPU simulation instead of a GPU: tests the plumbing, measures no GPU")
    ap.add_argument("--tiny", action="store_true", help="CPU-sized models and counts (with --simulate)")
    args = ap.parse_args(argv)
    if args.budget_s <= 0:
        ap.error(f"--budget-s must be positive, got {args.budget_s:g}")
    return args


def main(argv: list[str] | None = None, device: Device | None = None) -> int:
    """Run the parts; ``device`` overrides the one found (tests pass a simulated one). Exit status 0 unless the
    arguments are wrong: a part's error or skip is in the results, not the status."""
    args = parse(argv)
    names = [n for n in PARTS if not args.only or n in args.only]
    dev = device or (simulated_cuda() if args.simulate else cuda_device())
    shares = {n: PARTS[n].share for n in names}
    if args.dry_run:
        dry_run(names, Budget(args.budget_s, shares), dev, args.tiny)
        return 0
    info = {**machine(dev), "budget_s": args.budget_s, "install_s": args.install_s,
            "sizes": "tiny" if args.tiny else "gpu"}
    record = Record(args.out, info)
    budget = Budget(args.budget_s, shares)          # the clock starts with the first part, imports done
    try:
        with budget.hard_stop(args.grace_s):
            for i, name in enumerate(names):
                run_part(name, record, budget, names[i:], dev, args.tiny)
    except BudgetExceeded as exc:
        running = [n for n, p in record.data["parts"].items() if p["status"] == "running"]
        for name in running:
            record.finish(name, f"stopped: {exc}")
        print(f"stopped: {exc}")
    for name in names:
        if record.part(name)["status"] == "pending":
            record.finish(name, "stopped: budget (not started)")
    print(f"wrote {args.out / 'gpu_day.json'} and {args.out / 'gpu_day.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
