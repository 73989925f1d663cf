"""Coverage of `ampaudit.check` over real model zoos, beside plain torch.fx and torch.export.

    python bench/coverage.py                                   # every family (see BENCHMARKS.md for the time)
    python bench/coverage.py --families torchvision-cls --limit 3 --workers 1     # a smoke run
    python bench/coverage.py --json rows.json --markdown       # per-model rows, and tables for BENCHMARKS.md
    python bench/coverage.py --calibrate                       # also check --calibrate on every model
    python bench/coverage.py --families transformers-all --shard 1/4 --calibrate-only   # a chunk, calibration only

Families: all torchvision classification models, every torchvision detection, segmentation, video and optical-flow
model, the ``--timm-count`` smallest-sounding timm models taken round-robin over timm's modules (one architecture
each before any gets a second), tiny random-init configs of 22 transformers architectures, every other
transformers base model from its own default config shrunk by name (``transformers-all``, coverage_hf.py), and
seven diffusers backbones from tiny configs (coverage_diffusers.py). Nothing is downloaded. Models whose eager
forward does not run are listed grouped by reason.

For each model a worker process runs the stages of ``coverage_runner`` (eager forward, plain fx trace, plain
torch.export, ``ampaudit.check`` with capture_mode="auto"), each under ``--timeout`` seconds. A *complete
audit* is a check that returns a Report on a model whose eager forward runs; shares are over those models.
Exit status 0 when every such model got a complete audit, 1 otherwise.

Needs the ``bench`` extra, with torch pinned so pip picks the torchvision built for it. PyPI's torchvision is a
CUDA build, which breaks ``import transformers`` beside a ``+cpu`` torch, so there use a venv of its own
(``coverage_tvops`` supplies the ops its extension would have):

    python -m venv --system-site-packages .venv-bench
    .venv-bench/bin/pip install -e '.[bench]' torch==2.13.0          # torchvision 0.28.0, timm, transformers
    .venv-bench/bin/python bench/coverage.py --workers 2 --timeout 90 --json coverage.json --markdown
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from coverage_models import FAMILIES  # noqa: E402
from coverage_runner import STAGES, run_all  # noqa: E402

CAPTURES = ("fx", "export", "dispatch")
COLUMNS = ("family", "models", "eager ok", "fx", "export", "ampaudit", "captures used")


def share(rows: list[dict], stage: str) -> tuple[int, int]:
    """(models whose ``stage`` succeeded, models whose eager forward ran)."""
    base = [r for r in rows if r["eager"]]
    return sum(1 for r in base if r[stage]), len(base)


def _pct(hit: int, total: int) -> str:
    return f"{100.0 * hit / total:.1f}% ({hit}/{total})" if total else "-"


def family_table(rows: list[dict]) -> list[list[str]]:
    """One line per family and a total: models, eager ok, fx / export / ampaudit shares, captures used."""
    lines = []
    groups = [(f, [r for r in rows if r["family"] == f]) for f in FAMILIES]
    for name, group in [g for g in groups if g[1]] + [("all", rows)]:
        used = {c: sum(1 for r in group if r["eager"] and r["capture"] == c) for c in CAPTURES}
        lines.append([name, str(len(group)), str(share(group, "eager")[0]),
                      _pct(*share(group, "fx")), _pct(*share(group, "export")), _pct(*share(group, "ampaudit")),
                      ", ".join(f"{c} {n}" for c, n in used.items() if n) or "-"])
    return lines


def capture_table(rows: list[dict]) -> list[list[str]]:
    """One line per capture mode auto chose: audits, share of eager-ok models, median and max check seconds."""
    base = [r for r in rows if r["eager"]]
    lines = []
    for c in CAPTURES:
        used = [r for r in base if r["ampaudit"] and r["capture"] == c]
        secs = [r["seconds"].get("ampaudit", 0.0) for r in used]
        lines.append([c, str(len(used)), _pct(len(used), len(base)),
                      f"{statistics.median(secs):.2f}" if secs else "-", f"{max(secs):.2f}" if secs else "-",
                      ", ".join(sorted({r["family"] for r in used})) or "-"])
    return lines


PRECISION = ("sensitive-op", "normalization", "constant")   # bench/accuracy.py's: false alarms on these models
TIMING_COLUMNS = ("family", "audited", "median check s", "worst check s", "median x export", "worst x export",
                  "precision alarms", "calibrated", "median / worst calibrate s")


def bare_ratio(row: dict) -> float | None:
    """check's seconds over plain torch.export's on the same model (None where export failed). Against export, not
    fx: a plain fx trace runs nothing, while every check propagates shapes as export does."""
    bare = row["seconds"].get("export") if row.get("export") else None
    return row["seconds"]["ampaudit"] / bare if bare else None


def precision_alarms(row: dict, stage: str = "check") -> int:
    """Warnings and errors of the precision families in one row's ``stage`` (check or calibrate)."""
    counts = ((row.get("detail") or {}).get(stage) or {}).get("counts") or {}
    return sum(n for key, n in counts.items()
               if key.split("|")[1] in PRECISION and key.split("|")[2] in ("warning", "error"))


def timing_table(rows: list[dict]) -> list[list[str]]:
    """Per family: audited of eager-ok, median and worst check seconds and as a ratio to the bare capture,
    precision-family warnings and errors (static, then calibrated), how many calibrations completed and their
    median and worst seconds (check --calibrate, whole)."""
    lines = []
    groups = [(f, [r for r in rows if r["family"] == f]) for f in FAMILIES]
    for name, group in [g for g in groups if g[1]] + [("all", rows)]:
        done = [r for r in group if r["eager"] and r["ampaudit"]]
        secs = sorted(r["seconds"]["ampaudit"] for r in done)
        ratios = sorted(x for x in map(bare_ratio, done) if x is not None)
        calibrated = [r for r in group if r["eager"] and (r.get("detail") or {}).get("calibrate")]
        tried = [r for r in group if r["eager"] and r.get("calibrate") is not None]
        static_alarms = sum(precision_alarms(r) for r in done)
        cal_alarms = sum(precision_alarms(r, "calibrate") for r in calibrated)
        cal_secs = sorted(r["seconds"]["calibrate"] for r in calibrated if "calibrate" in r["seconds"])
        lines.append([name, _pct(*share(group, "ampaudit")),
                      f"{statistics.median(secs):.2f}" if secs else "-", f"{secs[-1]:.2f}" if secs else "-",
                      f"{statistics.median(ratios):.2f}" if ratios else "-", f"{ratios[-1]:.2f}" if ratios else "-",
                      f"{static_alarms}" + (f" / {cal_alarms}" if tried else ""),
                      f"{len(calibrated)}/{len(tried)}" if tried else "-",
                      f"{statistics.median(cal_secs):.1f} / {cal_secs[-1]:.1f}" if cal_secs else "-"])
    return lines


CPU_COLUMNS = ("family", "timed", "median check CPU s", "worst check CPU s", "over 10 CPU s",
               "median / worst calibrate CPU s")


def cpu_table(rows: list[dict]) -> list[list[str]]:
    """Per family, the CPU seconds (every thread of the worker) of each completed check and calibration: the
    numbers that hold on a loaded machine, where wall seconds grow with the load. Checks over 10 s are named."""
    lines = []
    groups = [(f, [r for r in rows if r["family"] == f]) for f in FAMILIES]
    for name, group in [g for g in groups if g[1]] + [("all", rows)]:
        timed = sorted(((r["cpu"]["ampaudit"], r["model"]) for r in group
                        if r["eager"] and r["ampaudit"] and "ampaudit" in r.get("cpu", {})), reverse=True)
        cal = sorted(r["cpu"]["calibrate"] for r in group
                     if (r.get("detail") or {}).get("calibrate") and "calibrate" in r.get("cpu", {}))
        if not timed and not cal:
            continue
        secs = [t for t, _ in timed]
        slow = [f"{m} {t:.1f}" for t, m in timed if t > 10.0]
        lines.append([name, str(len(timed)), f"{statistics.median(secs):.2f}" if secs else "-",
                      f"{secs[0]:.2f} ({timed[0][1]})" if secs else "-",
                      (", ".join(slow[:4]) + (f" +{len(slow) - 4}" if len(slow) > 4 else "")) or "none",
                      f"{statistics.median(cal):.1f} / {cal[-1]:.1f}" if cal else "-"])
    return lines


def _reason(error: str) -> str:
    """An eager error with its model-specific parts (numbers, quoted names, shapes) blanked, to group by."""
    last = error.split(" | ")[-1].split(": ", 1)[-1]        # the CPU attempt's, without the device prefix
    last = re.sub(r"'[^']*'|\"[^\"]*\"", "'_'", last)
    last = re.sub(r"\b\w+\.forward\(\)", "forward()", last)     # one group for every model missing an input
    last = re.sub(r"\d+", "N", last)
    return " ".join(last.split())[:110]


def build_failures(rows: list[dict]) -> list[tuple[int, str, list[str]]]:
    """Models whose eager forward did not run, grouped by reason: (count, reason, models), most common first."""
    groups: dict[str, list[str]] = {}
    for r in rows:
        if r["eager"] is False:
            groups.setdefault(_reason(r["errors"].get("eager", "?")), []).append(r["model"])
    return sorted(((len(v), k, v) for k, v in groups.items()), key=lambda g: (-g[0], g[1]))


CAPTURE_COLUMNS = ("capture", "audits", "share of eager-ok", "median check s", "max check s", "families")


def render(header: tuple[str, ...], lines: list[list[str]], markdown: bool) -> str:
    if markdown:
        out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        out += ["| " + " | ".join(line) + " |" for line in lines]
        return "\n".join(out)
    widths = [max(len(str(x)) for x in col) for col in zip(header, *lines)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([fmt.format(*header), fmt.format(*("-" * w for w in widths))] + [fmt.format(*l) for l in lines])


def failures(rows: list[dict]) -> list[str]:
    """Models whose eager forward runs but whose audit did not complete, with the error."""
    return [f"{r['family']}/{r['model']}: {r['errors'].get('ampaudit', 'not run')}"
            for r in rows if r["eager"] and not r["ampaudit"]]


def write_json(path: Path, payload: dict) -> None:
    # Atomic: a killed run leaves the previous file, never half of one.
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(payload, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for pkg in ("torch", "torchvision", "timm", "transformers", "diffusers"):
        try:
            found[pkg] = version(pkg)
        except PackageNotFoundError:
            found[pkg] = None
    return found


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--families", default=",".join(FAMILIES),
                   help=f"comma-separated subset of: {', '.join(FAMILIES)}")
    p.add_argument("--limit", type=int, default=None, help="at most N models per family (smoke runs)")
    p.add_argument("--models", default=None, help="comma-separated model names: run only these")
    p.add_argument("--merge", type=Path, nargs="+", default=None,
                   help="run nothing: print the tables of these --json files (chunks, a later calibration pass)")
    p.add_argument("--shard", default=None, help="I/N: run only every N-th model of the selection, from the I-th (chunks of a long run)")
    p.add_argument("--timm-count", type=int, default=160, help="how many timm models (default 160)")
    p.add_argument("--timeout", type=float, default=90.0, help="seconds per stage of one model (default 90)")
    p.add_argument("--workers", type=int, default=1, help="worker processes (default 1)")
    p.add_argument("--json", type=Path, default=None, help="write the per-model rows here")
    p.add_argument("--markdown", action="store_true", help="print the tables as markdown (for BENCHMARKS.md)")
    p.add_argument("--quiet", action="store_true", help="no line per model while running")
    p.add_argument("--calibrate", action="store_true",
                   help="also run check --calibrate (real weights, forward and backward) on every model")
    p.add_argument("--calibrate-only", action="store_true",
                   help="only the eager forward and check --calibrate (a second pass after a static one)")
    args = p.parse_args(argv)
    args.families = [f.strip() for f in args.families.split(",") if f.strip()]
    unknown = [f for f in args.families if f not in FAMILIES]
    if unknown:
        p.error(f"unknown family {', '.join(unknown)}; use some of {', '.join(FAMILIES)}")
    if args.timeout <= 0 or args.workers < 1:
        p.error("--timeout must be positive and --workers at least 1")
    return args


def select(args: argparse.Namespace) -> list[dict]:
    from coverage_models import list_models

    specs = []
    for family in args.families:
        try:
            found = list_models([family], timm_count=args.timm_count)
        except ImportError as exc:
            print(f"error: the {family} family needs {exc.name or 'its library'}: "
                  "pip install -e '.[bench]' torch==<the installed torch>", file=sys.stderr)
            raise SystemExit(2) from None
        if args.models:
            wanted = {m.strip() for m in args.models.split(",")}
            found = [s for s in found if s["name"] in wanted]
        specs.extend(found[: args.limit] if args.limit is not None else found)
    if getattr(args, "shard", None):
        index, count = (int(x) for x in args.shard.split("/"))
        specs = specs[index - 1::count]
    return specs


def _progress(done: list, total: int, quiet: bool, json_path: Path | None, meta: dict):
    def on_row(row: dict) -> None:
        done.append(row)
        if json_path is not None:   # rows so far, so a run stopped halfway still leaves its numbers
            write_json(json_path, {"meta": {**meta, "partial": True}, "rows": done})
        if quiet:
            return
        marks = " ".join(f"{s}={'-' if row[s] is None else 'ok' if row[s] else 'FAIL'}" for s in STAGES)
        extra = f" capture={row['capture']}" if row["capture"] else ""
        err = row["errors"].get("ampaudit") or (row["errors"].get("eager") if not row["eager"] else "")
        print(f"[{len(done)}/{total}] {row['family']}/{row['model']}: {marks}{extra}"
              + (f"  ({err[:120]})" if err else ""), flush=True)
    return on_row


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.merge:
        rows = merge(args.merge)
        first = json.loads(args.merge[0].read_text()).get("meta", {}).get("versions")
        return summarize(rows, markdown=args.markdown, head=f"{len(rows)} models from {len(args.merge)} run(s)",
                         found=first)
    start = time.perf_counter()
    specs = select(args)
    if not specs:
        print("no models selected", file=sys.stderr)
        return 2
    done: list[dict] = []
    meta = {"versions": versions(), "families": args.families, "limit": args.limit, "timm_count": args.timm_count,
            "timeout": args.timeout, "workers": args.workers, "argv": sys.argv[1:]}
    args.calibrate = args.calibrate or args.calibrate_only
    stages = ("eager", "calibrate") if args.calibrate_only else STAGES + (("calibrate",) if args.calibrate else ())
    rows = run_all(specs, workers=args.workers, timeout=args.timeout, stages=stages,
                   on_row=_progress(done, len(specs), args.quiet, args.json, meta))
    wall = time.perf_counter() - start
    meta["wall_s"] = round(wall, 1)
    if args.json:
        write_json(args.json, {"meta": meta, "rows": rows})
    return summarize(rows, markdown=args.markdown, head=f"{len(rows)} models in {wall:.0f} s", found=meta["versions"])


def merge(paths: list[Path]) -> list[dict]:
    """The rows of several runs' JSON as one list: a later run's stages (a --calibrate-only pass, a re-run of a few
    models) update the earlier row of the same model."""
    rows: dict[tuple[str, str], dict] = {}
    for path in paths:
        for row in json.loads(path.read_text())["rows"]:
            key = (row["family"], row["model"])
            if key not in rows:
                rows[key] = row
                continue
            old = rows[key]
            for stage in (*STAGES, "calibrate"):
                if row.get(stage) is not None:
                    old[stage] = row[stage]
                    for part in ("seconds", "cpu", "errors"):
                        if stage in row.get(part, {}):
                            old.setdefault(part, {})[stage] = row[part][stage]
                        elif stage != "eager":
                            old.get(part, {}).pop(stage, None)
            old.setdefault("detail", {}).update(row.get("detail") or {})
            if row.get("capture"):
                old["capture"] = row["capture"]
    return list(rows.values())


def summarize(rows: list[dict], *, markdown: bool, head: str, found: dict | None = None) -> int:
    """Print the tables, what did not run and every kept alarm; 1 when an audit or a calibration it tried failed."""
    static = any(r.get("ampaudit") is not None for r in rows)
    print()
    print(render(COLUMNS, family_table(rows), markdown))
    print()
    print(render(CAPTURE_COLUMNS, capture_table(rows), markdown))
    if static:
        print()
        print(render(TIMING_COLUMNS, timing_table(rows), markdown))
    if cpu_table(rows):
        print()
        print(render(CPU_COLUMNS, cpu_table(rows), markdown))
    failed = build_failures(rows)
    if failed:
        print(f"\n{sum(g[0] for g in failed)} model(s) whose eager forward did not run, by reason:")
        for count, reason, models in failed:
            print(f"  {count:4d}  {reason}: {', '.join(models[:6])}" + (" ..." if len(models) > 6 else ""))
    bad = failures(rows) if static else []
    print()
    print(f"{head}; shares are of models whose eager forward runs; "
          + ", ".join(f"{k} {v}" for k, v in (found or versions()).items()))
    partial = [f"{r['family']}/{r['model']}" for r in rows if r["ampaudit"]
               and any(n.startswith("shapes unknown") for n in r["notes"])]
    if partial:
        print(f"{len(partial)} complete audit(s) with nodes of unknown shape: {', '.join(partial)}")
    for line in bad:
        print(f"incomplete audit: {line}")
    for r in rows:
        for stage, detail in (r.get("detail") or {}).items():
            for alarm in detail.get("alarms") or []:
                print(f"alarm ({stage}): {r['family']}/{r['model']}: {alarm}")
    tried = [r for r in rows if r["eager"] and r.get("calibrate") is not None]
    if tried:
        calibrated = [r for r in tried if (r.get("detail") or {}).get("calibrate")]
        print(f"check --calibrate completed on {len(calibrated)}/{len(tried)} models")
        for r in tried:
            if r not in calibrated:
                print(f"incomplete calibration: {r['family']}/{r['model']}: {r['errors'].get('calibrate', 'not run')}")
        bad = bad or len(calibrated) < len(tried)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
