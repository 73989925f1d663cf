"""Loss of training with `ampaudit plan`'s float8 layers, against bf16 and against float8 on every Linear.

    python bench/fp8_plan.py                      # the three models below, 300 steps, seeds 0 1 2
    python bench/fp8_plan.py --models outlier --seeds 0 1 2 3 4 --cli-runs 0    # the massive-activation GPT alone
    python bench/fp8_plan.py --steps 100 --seeds 0 1
    python bench/fp8_plan.py --quick              # smoke run (~20 s): 1 seed, 20 steps, no CLI timing
    python bench/fp8_plan.py --json out.json

Three models, each trained side by side in one run, same initial weights and same batches per seed, with
``ampaudit.Trainer`` (bf16 autocast, AdamW lr 3e-3, clip_norm 1.0):

- ``bf16``: bf16 autocast, no float8 (the baseline);
- ``fp8-all``: torchao's ``convert_to_float8_training`` with no ``module_filter_fn``, i.e. *every* nn.Linear,
  misaligned ones included (which a GPU's ``torch._scaled_mm`` would refuse; the emulation runs them), then
  bf16 autocast for the rest;
- ``plan``: ``ampaudit.plan(..., speed_model="off")`` (accuracy alone decides), its layers converted as it says.

The models: ``samples/char_transformer.py`` (its model, train_data and loss_fn) and a Llama-style decoder from
``bench/llama_meta.py`` (RMSNorm, rotary, grouped-query attention, SwiGLU; all dims multiples of 16) trained on
the same sonnets text at character level, its vocabulary padded to 64; and ``bench/outlier_lm.py``, the sample
transformer (vocabulary 64) with a massive activation (1e5, as LLMs carry on their start token) in one hidden
unit of each MLP at position 0: the model where float8 with one scale per tensor really loses. The plan is
made once per model, on the first seed's initial weights and its first ``--calibrate`` batches (as
``ampaudit plan`` does), and applied to every seed. A second line shows what the plan would choose with
``speed_model="h100"`` at ``--tokens`` rows per GEMM, and its predicted Linear GEMM speedup (a roofline
estimate, see ampaudit/planning/speed.py).

"Final loss" is the mean training loss of the last ``--last`` steps. Noise is bf16's own: the spread (max - min)
of its final loss over the seeds; with one seed, the standard error of the last-k mean. A variant is "within
noise" when |its mean final loss - bf16's| is at most that noise.

What this shows and does not: float8 runs *emulated* on CPU (torchao's ``emulate=True``: the same scales, the
same saturated e4m3/e5m2 casts, then dequantize and a bf16/fp32 matmul), so the losses are float8's numerics;
the ms/step column is the emulation's cost on a CPU, not a float8 speed. Speed is only the roofline prediction.

Planning time (``--cli-only`` for it alone): ``ampaudit plan samples/char_transformer.py`` as a subprocess (imports
and model load included), as shipped (``ampaudit.plan`` measures on one torch thread) and with planning left on
torch's default thread count. Target: under 30 s on CPU.
Exit status 1 when a target is missed (not in --quick).
"""
from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import ampaudit  # noqa: E402
from ampaudit.precision.recipes import HIGH_PRECISION  # noqa: E402
from ampaudit.precision.keep_fp32 import keep_fp32  # noqa: E402
from ampaudit.planning.choose import misaligned_dims  # noqa: E402
from ampaudit.precision.fp8 import config, import_torchao  # noqa: E402
from llama_meta import build_llama  # noqa: E402
from outlier_lm import MASSIVE, MASSIVE_UNIT, OUTLIER_BLOCKS, VOCAB, build_outlier_lm  # noqa: E402
from outlier_lm import ct  # noqa: E402  (samples/char_transformer.py, loaded once, by outlier_lm)

PLAN_TARGET_S = 30.0
SAMPLE = ROOT / "samples" / "char_transformer.py"
VARIANTS = ("bf16", "fp8-all", "plan")
LLAMA = dict(layers=2, hidden=128, heads=4, kv_heads=2, ffn=384, vocab=64)
LLAMA_QUICK = dict(layers=1, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=64)


@dataclass
class Workload:
    name: str
    describe: str
    build: Callable[[int], nn.Module]            # seed -> fresh model
    data: Callable[[int], Callable[[], Iterator]]  # seed -> train_data factory


def char_workload() -> Workload:
    def build(seed: int) -> nn.Module:
        torch.manual_seed(seed)                  # seed 0: exactly the sample's build_model()
        return ct.CharTransformer(len(ct.vocabulary()))

    return Workload("sample transformer",
                    f"samples/char_transformer.py: {ct.N_LAYER} layers, d_model {ct.D_MODEL}, "
                    f"vocab {len(ct.vocabulary())}, {ct.BATCH} x {ct.BLOCK} tokens a step",
                    build, lambda seed: functools.partial(ct.train_data, seed=2 + seed))   # 2: the sample's default


def _text_windows(seq: int, batch: int, seed: int, batches: int = 100_000):
    data = ct.encode(ct.load_text())
    g = torch.Generator().manual_seed(seed)
    offsets = torch.arange(seq)
    for _ in range(batches):
        window = torch.randint(0, len(data) - seq - 1, (batch, 1), generator=g) + offsets
        yield data[window], data[window + 1]


def llama_workload(cfg: dict, seq: int = 64, batch: int = 16) -> Workload:
    def build(seed: int) -> nn.Module:
        return build_llama(**cfg, device="cpu", seed=seed).train()

    shape = ", ".join(f"{k} {v}" for k, v in cfg.items())
    return Workload("Llama-style", f"bench/llama_meta.py: {shape}; sonnets characters, {batch} x {seq} tokens a step",
                    build, lambda seed: functools.partial(_text_windows, seq, batch, 2 + seed))


def outlier_workload(massive: float = MASSIVE) -> Workload:
    return Workload("massive-activation GPT",
                    f"bench/outlier_lm.py: the sample transformer, vocab {VOCAB}, hidden unit {MASSIVE_UNIT} of "
                    f"the MLP of blocks {', '.join(map(str, OUTLIER_BLOCKS))} at {massive:g} on position 0; "
                    f"sonnets characters, {ct.BATCH} x {ct.BLOCK} tokens a step",
                    lambda seed: build_outlier_lm(seed, massive),
                    lambda seed: functools.partial(ct.train_data, seed=2 + seed))


def linears(model: nn.Module) -> dict[str, nn.Linear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}


def convert(model: nn.Module, variant: str, plan_dict: dict, recipe: str) -> nn.Module:
    if variant == "fp8-all":
        import_torchao().convert_to_float8_training(model, config=config(recipe))   # no filter: every Linear
    elif variant == "plan":
        # The plan measured one float8 recipe: its layers in that recipe, the same conversion train --plan makes.
        wanted = {layer["module"] for layer in plan_dict["layers"] if layer["choice"] not in HIGH_PRECISION}
        import_torchao().convert_to_float8_training(model, config=config(recipe),
                                                    module_filter_fn=lambda mod, fqn: fqn in wanted)
        fp32 = [layer["module"] for layer in plan_dict["layers"] if layer["choice"] == "float32"]
        if fp32:
            keep_fp32(model, fp32)
    return model


def train(work: Workload, variant: str, seed: int, steps: int, plan_dict: dict, recipe: str) -> dict:
    model = convert(work.build(seed), variant, plan_dict, recipe)
    trainer = ampaudit.Trainer(model, ct.loss_fn, work.data(seed), optimizer=ct.make_optimizer, dtype="bfloat16",
                               clip_norm=1.0, handle_signals=False)
    start = time.perf_counter()
    result = trainer.fit(steps=steps)
    return {"losses": result.losses, "s_per_step": (time.perf_counter() - start) / steps}


def calibration_batches(work: Workload, seed: int, count: int) -> list[tuple]:
    return [((x,), {}, y) for x, y in itertools.islice(work.data(seed)(), count)]


def _choices(plan) -> str:
    s = plan.summary()
    text = f"{s['low_precision']} float8, {s['bfloat16']} bfloat16, {s['float32']} float32"
    if s.get("predicted_linear_speedup"):
        text += f"; predicted Linear GEMM speedup {s['predicted_linear_speedup']:.2f}x over bf16"
    return text


def _names(names) -> str:
    names = sorted(names)
    return ", ".join(names) if len(names) <= 6 else f"{', '.join(names[:5])}, ... ({len(names)})"


def bench_model(work: Workload, args: argparse.Namespace) -> dict:
    print(f"\n{work.name} ({work.describe})", flush=True)
    probe = work.build(args.seeds[0])
    layers = linears(probe)
    misaligned = [f"{n} {m.in_features}->{m.out_features}" for n, m in layers.items() if misaligned_dims(m)]
    line = f"  fp8-all: all {len(layers)} nn.Linear (convert_to_float8_training, no module_filter_fn)"
    if misaligned:
        line += (f", including {', '.join(misaligned)}: not multiples of 16, which torch._scaled_mm on a GPU "
                 "refuses; the emulation runs it")
    print(line)
    batches = calibration_batches(work, args.seeds[0], args.calibrate)
    start = time.perf_counter()
    plan_off = ampaudit.plan(probe, batches, recipe=args.recipe, loss_fn=ct.loss_fn, speed_model="off")
    plan_s = time.perf_counter() - start
    plan_dict = plan_off.to_dict()
    fp8 = plan_off.float8_modules()
    print(f"  plan (speed_model=off, {len(batches)} batches, {plan_s:.1f} s in-process): {_choices(plan_off)}")
    not_fp8 = {layer.module: "; ".join(layer.reasons) for layer in plan_off.layers if layer.choice in HIGH_PRECISION}
    for name, why in not_fp8.items():
        print(f"    not float8: {name}: {why}")
    plan_gpu = ampaudit.plan(work.build(args.seeds[0]), batches, recipe=args.recipe, loss_fn=ct.loss_fn,
                             speed_model=args.speed_model, tokens=args.tokens)
    print(f"  plan (speed_model={args.speed_model}, tokens={args.tokens}): {_choices(plan_gpu)}; "
          f"float8: {_names(plan_gpu.float8_modules()) or 'none'}")
    speedups = sorted({round(layer.speedup, 2) for layer in plan_gpu.layers if layer.speedup})
    if speedups:
        print(f"    predicted per-layer fp8 speedups at {args.tokens} tokens: {min(speedups):.2f}x-{max(speedups):.2f}x")
    # A plan that converts exactly what fp8-all converts trains the same model on the same batches: the same run
    # (CPU emulation is deterministic), so it is not trained twice.
    same = fp8 == set(layers) and not plan_off.float32_modules()
    runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    for seed in args.seeds:
        order = VARIANTS if seed % 2 == 0 else VARIANTS[::-1]   # alternate so drifting load hits all alike
        for variant in order:
            if variant == "plan" and same:
                continue
            runs[variant].append(train(work, variant, seed, args.steps, plan_dict, args.recipe))
        if same:
            runs["plan"].append(runs["fp8-all"][-1])
        print(f"  seed {seed}: " + "  ".join(f"{v} {statistics.fmean(runs[v][-1]['losses'][-args.last:]):.4f}"
                                            for v in VARIANTS), flush=True)
    return {"plan_s": plan_s, "plan": plan_dict, "plan_gpu": plan_gpu.summary(), "same_as_fp8_all": same,
            "runs": runs, **summarize(runs, args, same)}


def summarize(runs: dict[str, list[dict]], args: argparse.Namespace, same: bool) -> dict:
    k = args.last
    final = {v: [statistics.fmean(r["losses"][-k:]) for r in rs] for v, rs in runs.items()}
    base = statistics.fmean(final["bf16"])
    step_std = statistics.fmean(statistics.stdev(r["losses"][-k:]) for r in runs["bf16"])
    if len(final["bf16"]) > 1:
        noise, noise_what = max(final["bf16"]) - min(final["bf16"]), f"spread of bf16 over {len(final['bf16'])} seeds"
    else:
        noise, noise_what = step_std / k ** 0.5, f"standard error of bf16's last-{k} mean (1 seed)"
    print(f"  {'variant':<10}{'final loss per seed':<30}{'mean':>8}{'/ bf16':>9}{'- bf16':>9}{'within noise':>14}"
          f"{'paired - bf16 (min..max)':>26}{'ms/step':>10}")
    rows = {}
    for v in VARIANTS:
        mean = statistics.fmean(final[v])
        delta = mean - base
        within = abs(delta) <= noise
        ms = statistics.fmean(r["s_per_step"] for r in runs[v]) * 1e3
        per_seed = " ".join(f"{x:.4f}" for x in final[v])
        mark = "-" if v == "bf16" else ("yes" if within else "no")
        # Same weights and batches per seed: the per-seed difference shows a bias the seed spread can hide.
        paired = [a - b for a, b in zip(final[v], final["bf16"])]
        span = "-" if v == "bf16" else f"{min(paired):+.4f}..{max(paired):+.4f}"
        note = " (= fp8-all run)" if v == "plan" and same else ""
        print(f"  {v:<10}{per_seed:<30}{mean:>8.4f}{mean / base:>8.4f}x{delta:>+9.4f}{mark:>14}{span:>26}"
              f"{ms:>10.1f}{note}")
        rows[v] = {"final": final[v], "mean": mean, "ratio": mean / base, "delta": delta, "within_noise": within,
                   "paired": paired, "ms_per_step": ms}
    print(f"  bf16 noise: {noise:.4f} ({noise_what}); std of bf16's last {k} step losses {step_std:.4f} "
          "(batch to batch, mean over seeds)")
    return {"rows": rows, "noise": noise, "noise_what": noise_what, "step_std": step_std}


# `ampaudit plan` as the CLI runs it, but with planning left at the process's thread count (plan(threads=None)).
_CALLER_THREADS = ("import functools, ampaudit.planning.api as api; "
                   "api.plan = functools.partial(api.plan, threads=None); "
                   "from ampaudit.cli import main; main()")


def time_cli(runs: int) -> dict:
    """Wall seconds of `ampaudit plan samples/char_transformer.py` (defaults) in a fresh process: as shipped
    (planning on 1 torch thread) and with planning on torch's default thread count; alternated, so drifting load
    hits both alike."""
    commands = {"1 thread": [sys.executable, "-m", "ampaudit"], "default": [sys.executable, "-c", _CALLER_THREADS]}
    out: dict[str, list[float]] = {k: [] for k in commands}
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    for i in range(runs):
        for name in (list(commands) if i % 2 == 0 else list(commands)[::-1]):
            start = time.perf_counter()
            subprocess.run([*commands[name], "plan", str(SAMPLE), "--dtype", "float8", "-f", "json"], env=env,
                           check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
            out[name].append(time.perf_counter() - start)
    return out


def _load() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.1f} (1 min), {five:.1f} (5 min) on {os.cpu_count()} CPUs"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300, help="optimizer steps per run")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="init and data seeds")
    ap.add_argument("--last", type=int, default=50, help="final loss: mean over this many last steps")
    ap.add_argument("--recipe", default="tensorwise", choices=("tensorwise", "rowwise"))
    ap.add_argument("--calibrate", type=int, default=4, help="batches the plan measures on (ampaudit plan's default)")
    ap.add_argument("--speed-model", default="h100", help="GPU for the plan's second line")
    ap.add_argument("--tokens", type=int, default=16384, help="rows of every GEMM for the speed model")
    ap.add_argument("--models", default="char,llama,outlier", help="comma-separated: char, llama, outlier")
    ap.add_argument("--massive", type=float, default=MASSIVE, help="the outlier model's massive activation")
    ap.add_argument("--cli-runs", type=int, default=2, help="timed `ampaudit plan` subprocesses per thread setting")
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads for the training runs")
    ap.add_argument("--cli-only", action="store_true", help="only time `ampaudit plan` (no training runs)")
    ap.add_argument("--quick", action="store_true", help="smoke run: 1 seed, 20 steps, tiny Llama, no CLI timing")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.quick:
        args.steps = args.steps if args.steps != ap.get_default("steps") else 20
        args.seeds, args.last, args.calibrate, args.cli_runs = args.seeds[:1], 5, 1, 0
    args.last = min(args.last, args.steps)
    default_threads = torch.get_num_threads()     # what the `ampaudit plan` subprocess gets
    torch.set_num_threads(args.threads)
    print(f"steps={args.steps} seeds={' '.join(map(str, args.seeds))} last={args.last} recipe={args.recipe} "
          f"threads={torch.get_num_threads()}; {_load()}")
    print("float8 is emulated on CPU (torchao emulate=True): its numerics, not its speed")
    works = {"char": char_workload, "llama": lambda: llama_workload(LLAMA_QUICK if args.quick else LLAMA),
             "outlier": lambda: outlier_workload(args.massive)}
    results: dict = {"args": {k: str(v) for k, v in vars(args).items()}, "models": {}}
    ok = True
    for key in [] if args.cli_only else args.models.split(","):
        work = works[key]()
        res = bench_model(work, args)
        results["models"][work.name] = res
        plan_ok, all_ok = res["rows"]["plan"]["within_noise"], res["rows"]["fp8-all"]["within_noise"]
        verdict = "PASS" if plan_ok and not all_ok else ("plan within noise, but so is fp8-all" if plan_ok else "MISS")
        print(f"  target (plan within noise of bf16 where fp8-all is not): {verdict}")
        ok = ok and plan_ok
    if args.cli_runs:
        load = _load()
        times = time_cli(args.cli_runs)
        worst = max(times["1 thread"])
        print(f"\nampaudit plan samples/char_transformer.py --dtype float8, wall s (fresh process, imports included): as shipped "
              f"(planning on 1 thread): {' '.join(f'{t:.1f}' for t in times['1 thread'])} (target < "
              f"{PLAN_TARGET_S:g} s) {'PASS' if worst < PLAN_TARGET_S else 'MISS'}; planning on torch's default "
              f"{default_threads} threads: {' '.join(f'{t:.1f}' for t in times['default'])}; {load} before, "
              f"{_load()} after")
        results["cli_seconds"] = times
        ok = ok and worst < PLAN_TARGET_S
    if args.json:
        args.json.write_text(json.dumps(results))
    return 0 if ok or args.quick else 1


if __name__ == "__main__":
    sys.exit(main())
