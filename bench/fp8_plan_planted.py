"""Training loss per recipe on the planted models: the plan restricted to one recipe, every Linear in that recipe,
and bf16, over seeds.

    OMP_NUM_THREADS=1 python bench/fp8_plan_planted.py                 # 6 models x 5 recipes, seeds 0 1 2, 40 steps (~6 min)
    python bench/fp8_plan_planted.py --recipes mxfp8,nvfp4 --models per_block_gamma --seeds 0 1 2 3
    python bench/fp8_plan_planted.py --quick                           # smoke run: 1 seed, 3 steps
    python bench/fp8_plan_planted.py --json out.json

The models are the planted ones of ``tests/planted_fp8/`` and ``tests/planted_recipes/`` (each file's
``build_model``, ``train_data``, ``loss_fn``): layers whose data breaks one scale per tensor, per row or per
16-block by a published mechanism. Per model and recipe (float8_tensorwise, float8_rowwise,
float8_rowwise_with_gw_hp, mxfp8, nvfp4), with ``ampaudit.Trainer`` (bf16 autocast, AdamW lr 3e-3, clip_norm 1.0):

- ``plan``: ``ampaudit.plan(..., recipes=<recipe>, speed_model="off")`` (accuracy alone; the recipe or bf16 /
  fp32 per layer, per GEMM where the recipe allows it), made once per model and recipe on the first seed's weights and
  its first ``--calibrate`` batches, applied with ``apply_plan`` (what ``train --plan`` does) to every seed;
- ``all``: every nn.Linear in the recipe (``convert.set_recipe``); a Linear the recipe cannot take (mxfp8 needs
  in/out features in 32-blocks, nvfp4 in 16-blocks) stays bf16, and the ``in recipe`` column counts it out;
- ``bf16``: bf16 autocast, no low-precision layer (one run per model and seed, shared by the recipes).

Seeds: seed ``s`` builds the model with its ``torch.manual_seed(0)`` run as ``manual_seed(s)`` (the planted
structure, gains and outliers, is built on top of that init as the file says) and trains on the file's batches in
a seed-shuffled cyclic order; a file whose targets are floats (regression) trains against an FP32 teacher
instead, the same planted model built at seed ``1000 + s`` (the planted_recipes files' own targets are noise, which
no recipe's error makes harder to fit). Entries a file's ``FIXED`` names keep their planted values (their gradients zeroed,
as bench/outlier_lm.py fixes its outlier's weights): per_block_gamma's norm gains and the inverse-gain weights,
nvfp4_gain_inside_blocks' too, massive_activations' probe columns that read the 1e5 dims at 1e-5. Final loss: mean training loss of the last ``--last`` steps; spread: max - min over
the seeds; paired: each seed's final loss minus bf16's on the same seed.

What this shows and does not: the recipes are emulated on CPU with torchao's quantizers (float8 ``emulate=True``,
MXFP8's emulated training op, NVFP4 through torchao's NVFP4 tensor where its training config refuses the CPU), so
these are their numerics, not their speed; the models are tiny and trained for tens of steps on a few batches
(the planted files' own 4-8), which measures whether a recipe's error shows in the loss, not a long run's outcome.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import itertools
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import ampaudit  # noqa: E402
from ampaudit.errors import UsageError  # noqa: E402
from ampaudit.planning.apply import apply_plan  # noqa: E402
from ampaudit.precision.convert import set_recipe  # noqa: E402
from ampaudit.precision.recipes import HIGH_PRECISION, parse_recipes  # noqa: E402

PLANTED = [ROOT / "tests" / "planted_fp8", ROOT / "tests" / "planted_recipes"]
RECIPES = "float8_tensorwise,float8_rowwise,float8_rowwise_with_gw_hp,mxfp8,nvfp4"
QUICK_MODELS = "per_block_gamma,massive_activations"


def load_module_file(path: Path):
    """Import a planted model file by path under its own name."""
    spec = importlib.util.spec_from_file_location(f"_planted_{path.parent.name}_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def planted_files() -> dict[str, Path]:
    """``{stem: path}`` of every planted model file."""
    return {p.stem: p for folder in PLANTED for p in sorted(folder.glob("*.py"))}


@contextlib.contextmanager
def _seeded(seed: int):
    """Inside, ``torch.manual_seed(n)`` seeds with ``seed`` instead (a planted file's build_model seeds 0)."""
    real = torch.manual_seed
    torch.manual_seed = lambda _n: real(seed)
    try:
        yield
    finally:
        torch.manual_seed = real


def build(mod, seed: int) -> nn.Module:
    with _seeded(seed):
        return mod.build_model()


def batches_of(mod, seed: int) -> list[tuple]:
    """The file's training batches; float (regression) targets replaced by an FP32 teacher's output: the same
    planted model built at seed ``1000 + seed``. The planted_recipes files' own targets are noise, which no
    recipe's error could make worse to fit; a teacher's need what the planted layer carries."""
    batches = list(mod.train_data())
    if not all(torch.is_floating_point(y) for _, y in batches):
        return batches          # class labels: the file's own
    teacher = build(mod, 1000 + seed)
    with torch.no_grad():
        return [(x, teacher(x).float()) for x, _ in batches]


def stream(batches: list[tuple], seed: int):
    """The batches in a seed-shuffled order, cycled without end."""
    order = list(range(len(batches)))
    random.Random(seed).shuffle(order)
    return lambda: (batches[i] for i in itertools.cycle(order))


def make_optimizer(params):
    return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.0)


def all_in(model: nn.Module, name: str) -> int:
    """Every Linear of ``model`` in recipe ``name`` where it can take it; returns how many took it."""
    took = 0
    for fqn, m in model.named_modules():
        if isinstance(m, nn.Linear):
            try:
                set_recipe(m, name, name=fqn)
                took += 1
            except UsageError:
                pass            # its shape does not fit the recipe's blocks: it stays bf16
    return took


def fix_planted(mod, model: nn.Module) -> None:
    """Zero the gradient of the entries the file's ``FIXED`` names (``{param: index or None}``): the planted
    structure a training step must not undo (Adam moves a 2^-12 weight by ~lr at once)."""
    params = dict(model.named_parameters())
    for name, index in getattr(mod, "FIXED", {}).items():
        keep = torch.ones_like(params[name])
        keep[index if index is not None else ...] = 0.0
        params[name].register_hook(lambda g, keep=keep: g * keep)


def train(mod, model: nn.Module, batches: list[tuple], seed: int, steps: int) -> list[float]:
    fix_planted(mod, model)
    trainer = ampaudit.Trainer(model, mod.loss_fn, stream(batches, seed), optimizer=make_optimizer,
                               dtype="bfloat16", clip_norm=1.0, handle_signals=False)
    return trainer.fit(steps=steps).losses


def make_plan(mod, name: str, batches: list[tuple], calibrate: int, seed: int) -> dict:
    cal = [((x,), {}, y) for x, y in batches[:calibrate]]
    return ampaudit.plan(build(mod, seed), cal, recipes=name, loss_fn=mod.loss_fn, speed_model="off").to_dict()


def _final(losses: list[float], last: int) -> float:
    return statistics.fmean(losses[-last:])


def _row(finals: list[float], base: list[float]) -> dict:
    paired = [a - b for a, b in zip(finals, base)]
    return {"final": finals, "mean": statistics.fmean(finals), "spread": max(finals) - min(finals),
            "paired": paired, "paired_mean": statistics.fmean(paired)}


def bench_model(stem: str, path: Path, names: tuple[str, ...], args) -> dict:
    mod = load_module_file(path)
    data = {s: batches_of(mod, s) for s in args.seeds}
    linears = sum(isinstance(m, nn.Linear) for m in build(mod, 0).modules())
    bf16 = [_final(train(mod, build(mod, s), data[s], s, args.steps), args.last) for s in args.seeds]
    out = {"linears": linears, "bf16": _row(bf16, bf16), "recipes": {}}
    print(f"\n{stem} ({linears} Linear): bf16 {out['bf16']['mean']:.5f} (spread {out['bf16']['spread']:.5f})",
          flush=True)
    for name in names:
        plan = make_plan(mod, name, data[args.seeds[0]], args.calibrate, args.seeds[0])
        planned = sum(layer["choice"] not in HIGH_PRECISION for layer in plan["layers"])
        finals: dict[str, list[float]] = {"plan": [], "all": []}
        took = 0
        for s in args.seeds:
            model = build(mod, s)
            apply_plan(model, plan)
            finals["plan"].append(_final(train(mod, model, data[s], s, args.steps), args.last))
            model = build(mod, s)
            took = all_in(model, name)
            finals["all"].append(_final(train(mod, model, data[s], s, args.steps), args.last))
        kept = {layer["module"]: layer["choice"] for layer in plan["layers"] if layer["choice"] in HIGH_PRECISION}
        res = {"plan": _row(finals["plan"], bf16) | {"in_recipe": planned, "kept": kept},
               "all": _row(finals["all"], bf16) | {"in_recipe": took}}
        out["recipes"][name] = res
        for variant in ("plan", "all"):
            r = res[variant]
            extra = f"  kept: {', '.join(f'{k} {v}' for k, v in kept.items())}" if variant == "plan" and kept else ""
            print(f"  {name:26s} {variant:4s} {r['in_recipe']}/{linears} in recipe  {r['mean']:.5f} "
                  f"(spread {r['spread']:.5f})  paired - bf16 {min(r['paired']):+.5f}..{max(r['paired']):+.5f}"
                  f"{extra}", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=40, help="optimizer steps per run")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--last", type=int, default=10, help="final loss: mean over this many last steps")
    ap.add_argument("--calibrate", type=int, default=4, help="batches each plan measures on")
    ap.add_argument("--recipes", default=RECIPES, help="comma-separated, full or short names")
    ap.add_argument("--models", default=None, help=f"comma-separated file stems (default: all of {', '.join(planted_files())})")
    ap.add_argument("--quick", action="store_true", help=f"smoke run: seed 0, 3 steps, models {QUICK_MODELS}")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.quick:
        args.seeds, args.steps, args.calibrate = args.seeds[:1], 3, 1
        args.models = args.models or QUICK_MODELS
    args.last = min(args.last, args.steps)
    files = planted_files()
    stems = args.models.split(",") if args.models else list(files)
    unknown = [s for s in stems if s not in files]
    if unknown:
        ap.error(f"unknown planted model(s) {', '.join(unknown)}; choose from {', '.join(files)}")
    names = parse_recipes(args.recipes)
    torch.set_num_threads(1)
    start = time.perf_counter()
    print(f"steps={args.steps} last={args.last} seeds={' '.join(map(str, args.seeds))} recipes={','.join(names)}; "
          "recipes emulated on CPU: their numerics, not their speed")
    results = {"args": {k: str(v) for k, v in vars(args).items()},
               "models": {stem: bench_model(stem, files[stem], names, args) for stem in stems}}
    results["seconds"] = time.perf_counter() - start
    print(f"\n{results['seconds']:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
