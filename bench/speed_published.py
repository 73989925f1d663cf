"""The whole-step speed model against published end-to-end runs: Llama3-8B on 8xH100 and 8xB200 (torchao's and
torchtitan's tables), predicted from the model's shapes and the GPUs' datasheets, beside the published speed-ups.

    PYTHONPATH=$PWD python bench/speed_published.py            # the comparison, the parts of each step
    PYTHONPATH=$PWD python bench/speed_published.py --json     # the same as JSON
    PYTHONPATH=$PWD python bench/speed_published.py --gpu torchao_h100=h100   # what-if: another GPU for a run
    PYTHONPATH=$PWD python bench/speed_published.py --sensitivity  # every error under each unsettled assumption

The runs, their settings and the published tokens/s are rules/policy/speed_published.toml; the model is
ampaudit/planning/step_model.py. Nothing is fitted: the published numbers are read only to be compared with.
For a prediction outside the tolerance the last column says what the recipe's low-precision GEMMs would have
to reach (as a fraction of the format's peak; the model assumes torchao's 0.78) for the step to match.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from ampaudit.errors import AmpAuditError
from ampaudit.planning import speed
from ampaudit.planning.step_model import compare, load_runs, ratio_tolerance, step_seconds

COMPILE = "compile_vs_eager"
PARTS = ("gemm_low", "gemm_bf16", "casts", "attention", "pointwise", "optimizer", "fsdp_copies", "communication")


def implied_gemm_efficiency(run, recipe: str, published: float) -> float | None:
    """The fraction of peak the low-precision GEMMs would need for the predicted speed-up to equal
    ``published`` (the other parts as modelled); None when no fraction does."""
    base = step_seconds(run, run.baseline)["total"]
    step = step_seconds(run, recipe)
    low = step["parts"]["gemm_low"]
    needed = low + base / published - step["total"]
    return speed.efficiency()["gemm"] * low / needed if needed > 0 else None


def rows(gpus: dict[str, str] | None = None) -> list[dict]:
    """One dict per (run, recipe) compared, with the step parts in seconds; ``gpus``: run name -> GPU to model
    it on instead of its own."""
    out = []
    tol = ratio_tolerance()
    runs = load_runs()
    unknown = set(gpus or {}) - set(runs)
    if unknown:
        raise SystemExit(f"error: unknown run(s) {', '.join(sorted(unknown))}; choose from {', '.join(runs)}")
    for run in runs.values():
        if gpus and run.name in gpus:
            run = dataclasses.replace(run, gpu=gpus[run.name])
        for c in compare(run):
            if c.recipe == COMPILE:   # compiled bf16 over eager bf16
                base, step = step_seconds(run, "bfloat16", compiled=False), step_seconds(run, "bfloat16")
            else:
                base, step = step_seconds(run, run.baseline), step_seconds(run, c.recipe)
            row = {"run": run.name, "gpu": run.gpu, "recipe": c.recipe, "published_speedup": c.published,
                   "predicted_speedup": c.predicted, "error": c.error, "within": abs(c.error) <= tol,
                   "published_tps": c.published_tps, "predicted_tps": c.predicted_tps,
                   "published_baseline_tps": run.published_eager if c.recipe == COMPILE else
                   run.published[run.baseline],
                   "predicted_baseline_tps": run.tokens / base["total"],
                   "parts": step["parts"], "baseline_parts": base["parts"], "source": run.source}
            row["implied_gemm_efficiency"] = None if row["within"] or c.recipe == COMPILE else \
                implied_gemm_efficiency(run, c.recipe, c.published)
            out.append(row)
    return out


# What-ifs on the assumptions no source settles: (label, run name or "*" for all, fields to replace).
WHAT_IFS = (
    ("as modelled", "*", {}),
    ("datasheet H100 (3.35 TB/s), not 2.4", "*", {"gpu": "h100"}),
    ("no CSE of shared casts", "*", {"cse": False}),
    ("AC recomputes every fp8 forward GEMM", "*", {"recompute_all_low": True}),
    ("torchtitan float8 without fp8 all-gather", "torchtitan_h100", {"float8_all_gather": ()}),
)


def sensitivity() -> list[dict]:
    """Each comparison's error under each what-if of WHAT_IFS (the datasheet-H100 one only for h100 runs)."""
    out = []
    for label, which, fields in WHAT_IFS:
        for run in load_runs().values():
            if which not in ("*", run.name) or (fields.get("gpu") and not run.gpu.startswith("h100")):
                continue
            for c in compare(dataclasses.replace(run, **fields)):
                out.append({"what_if": label, "run": run.name, "recipe": c.recipe, "error": c.error})
    return out


def _print_sensitivity(table: list[dict]) -> None:
    print("Error (predicted / published - 1) under each what-if\n")
    labels = list(dict.fromkeys(r["what_if"] for r in table))
    for i, label in enumerate(labels):
        print(f"  {chr(65 + i)}: {label}")
    cell = {(r["what_if"], r["run"], r["recipe"]): r["error"] for r in table}
    print(f"\n{'run':<16} {'recipe':<18} " + " ".join(f"{chr(65 + i):>7}" for i in range(len(labels))))
    for run, recipe in dict.fromkeys((r["run"], r["recipe"]) for r in table):
        vals = [cell.get((label, run, recipe)) for label in labels]
        print(f"{run:<16} {recipe:<18} " + " ".join(f"{'-' if v is None else f'{v:+.1%}':>7}" for v in vals))


def _print(table: list[dict]) -> None:
    tol = ratio_tolerance()
    print(f"Speed-up over bf16, predicted from shapes vs published (tolerance +-{tol:.0%} of the ratio)\n")
    print(f"{'run':<16} {'gpu':<10} {'recipe':<18} {'published':>9} {'predicted':>9} {'error':>7} "
          f"{'gain pub/pred':>14}  {'ok':<3} {'needs GEMM at':>13}")
    for r in table:
        need = r["implied_gemm_efficiency"]
        gains = f"{r['published_speedup'] - 1:+.0%} / {r['predicted_speedup'] - 1:+.0%}"
        print(f"{r['run']:<16} {r['gpu']:<10} {r['recipe']:<18} {r['published_speedup']:>9.3f} "
              f"{r['predicted_speedup']:>9.3f} {r['error']:>+7.1%} {gains:>14}  {'yes' if r['within'] else 'NO':<3} "
              f"{'' if need is None and r['within'] else (f'{need:.2f} of peak' if need else 'none'):>13}")
    print("\nAbsolute tokens/s per GPU (the model has no power limit, overlap loss or host time)\n")
    seen = set()
    for r in table:
        first = "bfloat16 eager" if r["recipe"] == COMPILE else "bfloat16"
        if (r["run"], first) not in seen:
            seen.add((r["run"], first))
            print(f"{r['run']:<16} {first:<18} published {r['published_baseline_tps']:>8.0f}  "
                  f"predicted {r['predicted_baseline_tps']:>8.0f}")
        if r["recipe"] != COMPILE:
            print(f"{r['run']:<16} {r['recipe']:<18} published {r['published_tps']:>8.0f}  "
                  f"predicted {r['predicted_tps']:>8.0f}")
    print("\nParts of one step, ms per GPU (bf16 | recipe; for compile_vs_eager: bf16 eager | compiled)\n")
    print(f"{'run':<16} {'recipe':<18} " + " ".join(f"{p:>13}" for p in PARTS))
    for r in table:
        cells = [f"{1e3 * r['baseline_parts'][p]:>5.0f} | {1e3 * r['parts'][p]:>4.0f}" for p in PARTS]
        print(f"{r['run']:<16} {r['recipe']:<18} " + " ".join(f"{c:>13}" for c in cells))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument("--gpu", action="append", default=[], metavar="RUN=GPU",
                        help="model RUN on GPU (a name in rules/policy/gpus.toml) instead of the run's own")
    parser.add_argument("--sensitivity", action="store_true",
                        help="each error under the what-ifs of the assumptions no source settles")
    args = parser.parse_args(argv)
    if args.sensitivity:
        table = sensitivity()
        json.dump(table, sys.stdout, indent=1) if args.json else _print_sensitivity(table)
        return 0
    try:
        table = rows(dict(item.split("=", 1) for item in args.gpu))
    except ValueError:
        parser.error("--gpu takes RUN=GPU")
    except AmpAuditError as exc:
        parser.error(exc.one_line())
    if args.json:
        json.dump(table, sys.stdout, indent=1)
        print()
    else:
        _print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
