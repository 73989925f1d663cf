"""How tall is the terminal report (120 columns) of the corpus's tallest models, static and ``--calibrate``?

    .venv-bench/bin/python bench/report_height.py --cache reports/            # audit, keep each Report, count lines
    python bench/report_height.py --cache reports/ --render-only              # re-count from the kept Reports
    python bench/report_height.py --cache reports/ --render-only --show maskrcnn_resnet50_fpn:calibrate

The models are the detection family (bench/coverage_models.py's torchvision-det) and the timm models whose
calibrated reports were the tallest in the corpus run (BENCHMARKS.md). Each is audited the way
bench/coverage_runner.py audits it (static: built on meta where that works; calibrated: real weights on CPU), and
its lines are coverage_runner.verdict()'s, the count bench/accuracy.py reports. ``--cache`` keeps every Report as
a pickle, so a change to the console alone is measured without auditing again (``--render-only``): the findings
are the same ones, only the rendering differs.
"""
from __future__ import annotations

import argparse
import pickle
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

# The timm models of the corpus whose calibrated reports were tallest (the corpus run of BENCHMARKS.md).
TALL_TIMM = ("swiftformer_xs", "csatv2", "repghostnet_058", "mvitv2_tiny", "csatv2_21m")
STAGES = ("audit", "calibrate")


def _specs(families: list[str]) -> list[dict]:
    from coverage_models import list_models

    specs = list_models(["torchvision-det"]) if "torchvision-det" in families else []
    return specs + ([{"family": "timm", "name": n} for n in TALL_TIMM] if "timm" in families else [])


def _built(spec: dict, stage: str):
    import torch
    from coverage_models import build, devices_for

    devices = ("cpu",) if stage == "calibrate" else devices_for(spec)
    for device in devices:
        try:
            built = build(spec, device)
            with torch.no_grad():
                built.model(*built.args, **built.kwargs)
            return built
        except Exception:
            if device == devices[-1]:
                raise
    raise AssertionError("unreachable")


def audit(spec: dict, stage: str):
    import ampaudit

    built = _built(spec, stage)
    return ampaudit.check(built.model, *built.args, calibrate=stage == "calibrate", **built.kwargs)


def lines(report) -> int:
    from coverage_runner import verdict

    return verdict(report)["lines"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache", type=Path, required=True, help="folder of the kept Reports (NAME.STAGE.pkl)")
    ap.add_argument("--render-only", action="store_true", help="count lines of the kept Reports, audit nothing")
    ap.add_argument("--families", default="torchvision-det,timm", help="torchvision-det and/or timm")
    ap.add_argument("--stages", default=",".join(STAGES), help="audit (static) and/or calibrate")
    ap.add_argument("--models", default=None, help="comma-separated names: only these (default: all)")
    ap.add_argument("--show", default=None, help="NAME:STAGE: print that report at 120 columns")
    args = ap.parse_args(argv)
    if args.show:
        from rich.console import Console

        from ampaudit.report.console import render_report

        render_report(pickle.loads((args.cache / f"{args.show.replace(':', '.')}.pkl").read_bytes()),
                      Console(width=120, color_system=None))
        return 0
    args.cache.mkdir(parents=True, exist_ok=True)
    import torch

    torch.set_num_threads(1)
    if not args.render_only:
        from coverage_tvops import import_torchvision

        import_torchvision()
    stages = args.stages.split(",")
    print(f"| model | {' | '.join(f'{s} lines' for s in stages)} |")
    print(f"|---|{'---|' * len(stages)}")
    names = [s["name"] for s in _specs(args.families.split(","))] if not args.render_only else \
        sorted({p.name.split(".")[0] for p in args.cache.glob("*.pkl")})
    if args.models:
        names = [n for n in args.models.split(",") if n in names]
    for name in names:
        cells = []
        for stage in stages:
            path = args.cache / f"{name}.{stage}.pkl"
            if not args.render_only:
                spec = next(s for s in _specs(args.families.split(",")) if s["name"] == name)
                start = time.perf_counter()
                path.write_bytes(pickle.dumps(audit(spec, stage)))
                print(f"  ({name} {stage}: {time.perf_counter() - start:.0f} s)", file=sys.stderr, flush=True)
            cells.append(str(lines(pickle.loads(path.read_bytes()))) if path.exists() else "-")
        print(f"| {name} | {' | '.join(cells)} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
