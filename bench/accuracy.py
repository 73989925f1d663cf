"""Is the verdict right in both directions? False alarms on real models, misses on planted faults.

    python bench/accuracy.py --planted-only                      # every planted model, static and --calibrate
    .venv-bench/bin/python bench/accuracy.py --workers 2 --json acc.json      # + the 280-model corpus
    .venv-bench/bin/python bench/accuracy.py --families timm --limit 20 --workers 2   # a smoke run
    .venv-bench/bin/python bench/accuracy.py --corpus-only --calibrate --json acc.json --resume   # go on after a stop

Corpus (bench/coverage.py's lists: real torchvision, timm and transformers models that train fine under AMP
every day, random weights, their own example inputs), under the default target (cuda, float16): the
precision-family findings (sensitive-op, normalization, constant) at warning or above per model, the share of
models that exit 1 because of them, and the median and worst height of the terminal report at 120 columns.
With ``--calibrate`` the corpus is also calibrated (real weights, forward and backward), which must complete on
every model.

Planted (../shared/planted and tests/planted: small models with a known fault and the module that causes it,
``EXPECT`` in each file): the share located to the right module at warning or above, statically and with
``--calibrate``, split by the phase the fault is in (forward, backward).

Targets (issue "Diagnosis you can trust"): models exiting 1 for precision families <= 5%; every planted fault
located; no report over 80 lines.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

PRECISION = ("sensitive-op", "normalization", "constant")
# What calibration measures on the model's data: on a model that trains fine under AMP, a warning here is a false
# alarm too (a relative own-error outlier, a flipped decision, an overflow that is not there).
MEASURED = ("divergence", "range", "nonfinite")
RANK = {"info": 0, "warning": 1, "error": 2}
PLANTED_DIRS = (ROOT.parent / "shared" / "planted", ROOT / "tests" / "planted")


# -- corpus ------------------------------------------------------------------------------------------------------

def precision_alarms(detail: dict, families=PRECISION) -> int:
    """Findings of ``families`` (default: the precision ones) at warning or above in one verdict (see
    coverage_runner.verdict)."""
    total = 0
    for key, n in detail["counts"].items():
        _rule, family, severity = key.split("|")
        if family in families and RANK[severity] >= RANK["warning"]:
            total += n
    return total


def corpus_summary(rows: list[dict], stage: str) -> dict:
    done = [r for r in rows if r.get("eager") and (r.get("detail") or {}).get(stage)]
    alarms = {f"{r['family']}/{r['model']}": precision_alarms(r["detail"][stage]) for r in done}
    lines = sorted(r["detail"][stage]["lines"] for r in done)
    by_rule: dict[str, int] = {}
    for r in done:
        for key, n in r["detail"][stage]["counts"].items():
            rule, family, severity = key.split("|")
            if family in PRECISION + MEASURED and RANK[severity] >= RANK["warning"]:
                by_rule[f"{rule} {severity}"] = by_rule.get(f"{rule} {severity}", 0) + n
    measured = {f"{r['family']}/{r['model']}": precision_alarms(r["detail"][stage], MEASURED) for r in done}
    eager = [r for r in rows if r.get("eager")]
    failed = [f"{r['family']}/{r['model']}: {r['errors'].get(stage, 'not run')}" for r in eager
              if not (r.get("detail") or {}).get(stage)]
    worst = max(done, key=lambda r: r["detail"][stage]["lines"]) if done else None
    return {
        "models": len(eager), "completed": len(done), "failed": failed,
        "precision_alarms": sum(alarms.values()),
        "models_exit1_precision": sum(1 for v in alarms.values() if v),
        "share_exit1_precision": (sum(1 for v in alarms.values() if v) / len(done)) if done else None,
        "measured_alarms": sum(measured.values()),
        "models_with_measured_alarms": sorted(k for k, v in measured.items() if v),
        "models_exit1_any": sum(1 for r in done if RANK.get(r["detail"][stage]["worst"] or "info", 0) >= 1
                                and r["detail"][stage]["worst"] is not None),
        "by_rule": dict(sorted(by_rule.items(), key=lambda kv: -kv[1])),
        "worst_alarms": sorted(((v, k) for k, v in alarms.items() if v), reverse=True)[:10],
        "median_lines": statistics.median(lines) if lines else None,
        "max_lines": lines[-1] if lines else None,
        "max_lines_model": f"{worst['family']}/{worst['model']}" if worst else None,
        "over_80_lines": sum(1 for n in lines if n > 80),
    }


def run_corpus(args) -> dict:
    from coverage import select
    from coverage_runner import run_all

    from coverage import write_json

    specs = select(args)
    stages = ("eager", "audit") + (("calibrate",) if args.calibrate else ())
    done = _resumed(args, specs, stages)
    kept = {(r["family"], r["model"]) for r in done}
    specs = [s for s in specs if (s["family"], s["name"]) not in kept]
    total = len(specs) + len(done)

    def on_row(row):
        done.append(row)
        if args.json is not None:   # rows so far: a run stopped halfway keeps them, and --resume goes on from them
            write_json(args.json, {"argv": sys.argv[1:], "partial": True, "corpus": {"rows": done}})
        if not args.quiet:
            d = row.get("detail") or {}
            marks = ", ".join(f"{s}: {precision_alarms(d[s])} alarm(s), {d[s]['lines']} lines" for s in d)
            err = "; ".join(f"{k}: {v[:100]}" for k, v in row["errors"].items())
            print(f"[{len(done)}/{total}] {row['family']}/{row['model']}: {marks or '-'}"
                  + (f"  ({err})" if err else ""), flush=True)

    run_all(specs, workers=args.workers, timeout=args.timeout, on_row=on_row, stages=stages) if specs else None
    rows = list(done)
    out = {"rows": rows, "audit": corpus_summary(rows, "audit")}
    if args.calibrate:
        out["calibrate"] = corpus_summary(rows, "calibrate")
    return out


def _resumed(args, specs: list[dict], stages: tuple[str, ...]) -> list[dict]:
    """With ``--resume``, the rows of ``--json``'s earlier (maybe partial) run that are in this selection and ran
    every stage asked for, so a long run stopped halfway goes on where it was."""
    if not args.resume or args.json is None or not args.json.exists():
        return []
    wanted = {(s["family"], s["name"]) for s in specs}
    rows = json.loads(args.json.read_text()).get("corpus", {}).get("rows", [])
    return [r for r in rows if (r["family"], r["model"]) in wanted
            and all(st == "eager" or st in (r.get("detail") or {}) or st in r.get("errors", {}) for st in stages)]


# -- planted -----------------------------------------------------------------------------------------------------

def planted_files() -> list[Path]:
    seen, files = set(), []
    for folder in PLANTED_DIRS:
        for path in sorted(folder.glob("*.py")) if folder.is_dir() else []:
            if path.name not in seen and not path.name.startswith("_"):
                seen.add(path.name)
                files.append(path)
    return files


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(f"planted_{path.stem}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def located(report, culprit: str, families) -> bool:
    """A warning or error names the culprit (or a module inside it) in one of the expected families."""
    for f in report.findings:
        if RANK[f.severity] < RANK["warning"] or (families and f.family not in families):
            continue
        if f.module == culprit or f.module.startswith(culprit + "."):
            return True
    return False


def run_planted() -> list[dict]:
    import ampaudit

    rows = []
    for path in planted_files():
        mod = _load(path)
        expect = getattr(mod, "EXPECT", {})
        culprit = expect.get("culprit")
        if culprit is None or expect.get("phase") == "training":
            # speed-only models have no module to locate; a training fault (state that loses its updates) shows in
            # no single pass, so check cannot see it: train --trace + report name it (tests/test_train_swamping.py)
            continue
        target = expect.get("target", {"device": "cpu", "dtype": "float16"})
        model = mod.build_model()
        inputs = mod.example_inputs()
        args, kwargs = ((), inputs) if isinstance(inputs, dict) else (tuple(inputs), {})
        row = {"model": path.stem, "culprit": culprit, "phase": expect.get("phase", "forward"),
               "target": f"{target['device']} {target['dtype']}", "static": False, "calibrate": False}
        try:
            rep = ampaudit.check(model, *args, **target, **kwargs)
            row["static"] = located(rep, culprit, expect.get("families"))
            # Backward too: of the mean of the outputs (example inputs carry no target for the file's loss_fn).
            rep = ampaudit.check(model, *args, **target, calibrate=True, **kwargs)
            row["calibrate"] = located(rep, culprit, None)
        except Exception as exc:  # noqa: BLE001 - a crash is a miss, reported with its reason
            row["error"] = f"{type(exc).__name__}: {exc}"[:200]
        rows.append(row)
    return rows


def planted_summary(rows: list[dict]) -> dict:
    out = {}
    for phase in ("forward", "backward", "all"):
        group = [r for r in rows if phase == "all" or r["phase"] == phase]
        if group:
            out[phase] = {"models": len(group), "static": sum(r["static"] for r in group),
                          "calibrate": sum(r["calibrate"] for r in group),
                          "missed_static": [r["model"] for r in group if not r["static"]],
                          "missed_calibrate": [r["model"] for r in group if not r["calibrate"]]}
    return out


# -- main --------------------------------------------------------------------------------------------------------

def parse_args(argv):
    from coverage import FAMILIES

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--planted-only", action="store_true", help="skip the corpus (no bench extra needed)")
    p.add_argument("--corpus-only", action="store_true", help="skip the planted models")
    p.add_argument("--calibrate", action="store_true", help="also calibrate every corpus model")
    p.add_argument("--families", default=",".join(FAMILIES))
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--models", default=None)
    p.add_argument("--timm-count", type=int, default=160)
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--resume", action="store_true", help="keep --json's rows from an earlier run; run the rest")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    args.families = [f.strip() for f in args.families.split(",") if f.strip()]
    return args


def _print_corpus(name: str, s: dict) -> None:
    print(f"\ncorpus ({name}), cuda float16: {s['completed']}/{s['models']} completed")
    share = s["share_exit1_precision"]
    print(f"  precision-family warnings+errors: {s['precision_alarms']} "
          f"({s['precision_alarms'] / max(1, s['completed']):.2f} per model)")
    print(f"  models exiting 1 for precision families: {s['models_exit1_precision']}"
          + (f" ({share:.1%}; target <= 5%)" if share is not None else ""))
    print(f"  measured-family (divergence, range, nonfinite) warnings+errors: {s['measured_alarms']}"
          + (f" in {', '.join(s['models_with_measured_alarms'])}" if s["models_with_measured_alarms"] else ""))
    print(f"  models exiting 1 for any family: {s['models_exit1_any']}")
    print(f"  report lines at 120 columns: median {s['median_lines']}, worst {s['max_lines']} "
          f"({s['max_lines_model']}); over 80: {s['over_80_lines']}")
    if s["by_rule"]:
        print("  by rule: " + ", ".join(f"{k} {v}" for k, v in s["by_rule"].items()))
    for n, model in s["worst_alarms"]:
        print(f"    {n:5d}  {model}")
    for line in s["failed"]:
        print(f"  incomplete: {line}")


def main(argv=None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    payload: dict = {"argv": sys.argv[1:]}
    ok = True
    if not args.corpus_only:
        rows = run_planted()
        summary = planted_summary(rows)
        payload["planted"] = {"rows": rows, "summary": summary}
        print("planted models (located at warning or above, on the culprit module):")
        for r in rows:
            print(f"  {r['model']:<28} {r['phase']:<8} {r['target']:<15} static {'yes' if r['static'] else 'NO ':<4}"
                  f" calibrate {'yes' if r['calibrate'] else 'NO'}" + (f"  ({r['error']})" if r.get("error") else ""))
        for phase, s in summary.items():
            print(f"  {phase}: static {s['static']}/{s['models']}, calibrate {s['calibrate']}/{s['models']}")
        ok = ok and summary.get("all", {}).get("calibrate") == summary.get("all", {}).get("models")
    if not args.planted_only:
        corpus = run_corpus(args)
        payload["corpus"] = corpus
        _print_corpus("static audit", corpus["audit"])
        if "calibrate" in corpus:
            _print_corpus("check --calibrate", corpus["calibrate"])
    print(f"\n{time.perf_counter() - start:.0f} s")
    if args.json:
        from coverage import write_json

        write_json(args.json, payload)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
