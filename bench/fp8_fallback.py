"""Fallback during training: a planted model whose outliers grow, trained in float8 with and without
``--fallback``, against bf16, over seeds.

    python bench/fp8_fallback.py                      # seeds 0-4, 160 steps
    python bench/fp8_fallback.py --seeds 0 1 --steps 100
    python bench/fp8_fallback.py --gaussian-sqnr      # the output SQNR each recipe gives gaussian operands
    python bench/fp8_fallback.py --json out.json

The model is tests/assets/train_swiglu_growth.py: a SwiGLU block whose hidden unit 0 (aligned gate and up rows)
squares an input feature that ramps up 400-fold over the first 60 steps (SwiGLU outlier amplification, Fishman et
al. 2024, arXiv:2409.12517). Per seed, three runs with the same initial weights and batches, ``ampaudit.Trainer``
with bf16 autocast and AdamW (lr 3e-3), statistics every ``--every`` steps:

- ``bf16``: no float8;
- ``fp8``: every Linear in float8 tensorwise (the plan a step-0 measurement gives), fixed for the run;
- ``switched``: the same plan with ``fp8_fallback=True``: a layer that leaves its budget walks recipes.toml's
  ``safer`` chain (tensorwise -> rowwise -> rowwise_with_gw_hp -> bfloat16).

"Final loss" is the mean training loss of the last ``--last`` steps. Noise is bf16's own: the spread (max - min) of
its final loss over the seeds. A variant is "within noise" when |its mean final loss - bf16's| is at most that
noise. Float8 runs emulated on CPU (torchao's emulate=True): its numerics, not its speed.
Exit status 1 when the switched run is not within noise of bf16 or the fixed fp8 run is.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "assets"))

import train_swiglu_growth as planted  # noqa: E402

from ampaudit.planning.apply import apply_plan  # noqa: E402
from ampaudit.runtime.trace import read_trace  # noqa: E402
from ampaudit.train.trainer import Trainer  # noqa: E402

VARIANTS = ("bf16", "fp8", "switched")


def run(variant: str, seed: int, steps: int, every: int, workdir: Path) -> dict:
    """One training run; its losses and the fallback events it wrote."""
    model = planted.build_model(seed)
    plan_file = None
    if variant != "bf16":
        plan_file = workdir / f"plan-{variant}-{seed}.json"
        plan_file.write_text(json.dumps(planted.plan()))
        apply_plan(model, planted.plan())
    trace = workdir / f"{variant}-{seed}.jsonl"
    trainer = Trainer(model, planted.loss_fn, lambda: planted.train_data(seed, steps=steps),
                      optimizer=planted.make_optimizer, dtype="bfloat16", trace=trace, trace_every=every,
                      fp8_fallback=variant == "switched", plan_file=plan_file, handle_signals=False)
    result = trainer.fit(steps)
    falls = [{k: e[k] for k in ("step", "module", "from", "to", "reason")}
             for e in read_trace(trace)[0] if e["event"] == "fallback"]
    return {"losses": result.losses, "fallbacks": falls}


def gaussian_sqnr(seeds: int = 5) -> dict[str, list[float]]:
    """Output SQNR (dB) of a 256x256 Linear on 64 gaussian tokens, per recipe and seed (recipes.toml's budgets)."""
    from torch import nn

    from ampaudit.precision.convert import set_recipe
    from ampaudit.runtime.recipe_stats import sqnr_db

    out: dict[str, list[float]] = {}
    for name in ("float8_tensorwise", "float8_rowwise", "float8_rowwise_with_gw_hp", "mxfp8", "nvfp4"):
        for seed in range(seeds):
            torch.manual_seed(seed)
            layer, x = nn.Linear(256, 256), torch.randn(64, 256)
            ref = nn.functional.linear(x, layer.weight, layer.bias).detach()
            set_recipe(layer, name)
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
                out.setdefault(name, []).append(sqnr_db(ref, layer(x)))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--steps", type=int, default=160)
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--last", type=int, default=40)
    ap.add_argument("--gaussian-sqnr", action="store_true")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if args.gaussian_sqnr:
        for name, values in gaussian_sqnr().items():
            print(f"{name:28s} {statistics.mean(values):5.1f} dB  (min {min(values):.1f}, max {max(values):.1f})")
        return 0
    finals: dict[str, list[float]] = {v: [] for v in VARIANTS}
    record: dict = {"args": vars(args) | {"json": str(args.json) if args.json else None}, "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            for variant in VARIANTS:
                got = run(variant, seed, args.steps, args.every, Path(tmp))
                final = statistics.mean(got["losses"][-args.last:])
                finals[variant].append(final)
                record["runs"][f"{variant}/{seed}"] = {"final": final, "fallbacks": got["fallbacks"]}
                first = {f["module"]: f["step"] for f in reversed(got["fallbacks"])}
                print(f"seed {seed} {variant:9s} final loss {final:.5f}"
                      + (f"  first fallback: {first}" if first else ""), flush=True)
    noise = max(finals["bf16"]) - min(finals["bf16"])
    base = statistics.mean(finals["bf16"])
    verdict = {}
    print(f"\n{'variant':9s} {'mean final':>11s} {'spread':>9s} {'vs bf16':>9s}  (bf16 noise {noise:.5f})")
    for v in VARIANTS:
        mean = statistics.mean(finals[v])
        verdict[v] = abs(mean - base) <= noise
        print(f"{v:9s} {mean:11.5f} {max(finals[v]) - min(finals[v]):9.5f} {mean - base:+9.5f}  "
              f"{'within noise' if verdict[v] else 'outside noise'}")
    record.update(finals=finals, noise=noise, within_noise=verdict)
    if args.json:
        args.json.write_text(json.dumps(record, indent=2))
    return 0 if verdict["switched"] and not verdict["fp8"] else 1


if __name__ == "__main__":
    sys.exit(main())
