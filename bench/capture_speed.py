"""What `ampaudit check` costs beside the bare capture it falls back on, per model, in separate processes.

    python bench/capture_speed.py --families torchvision-det transformers --runs 3 --markdown
    python bench/capture_speed.py --families timm --captures export          # only the export-captured timm models
    python bench/capture_speed.py --models t5 llama --families transformers --runs 1
    python bench/capture_speed.py --families torchvision-det --runs 0 --findings after.json --compare before.json

For each model of bench/coverage_models.py's corpus a probe process builds it (meta first, CPU where the forward
fails there, detection on CPU) and runs ``ampaudit.check`` once: that says which capture check used and what it
found. Then ``--runs`` pairs of processes, alternately in the order check/baseline and baseline/check:

  check     build the model, ``ampaudit.check(model, *args, **kwargs)``
  baseline  build the model, then what the capture check used does alone: ``torch.export.export(..., strict=False)``
            for an export capture, one eager forward under no_grad for a dispatch capture (export cannot capture
            those), ``torch.fx.symbolic_trace`` for an fx capture

Each child reports the process (CPU) time of build + its one call, ``time.process_time``, with torch on one thread:
imports are the same in both and left out, and CPU time stands still while other processes share the cores. The
ratio is check/baseline within each pair, and each model's figure is the median over its pairs.

``--findings FILE`` writes each model's findings (rule, module, file, line, severity, message) from the probe;
``--compare FILE`` compares them with an earlier such file and exits 1 on any difference: a speed change keeps
every finding. Needs the ``bench`` extra (see bench/coverage.py for its venv).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

BASELINE = {"export": "export", "dispatch": "eager", "fx": "fx"}
CHILD_LIMIT = 600.0


# -- in a child process ------------------------------------------------------------------------------------------

def _import_libraries(family: str) -> None:
    from coverage_runner import _preload, _quiet

    with _quiet():
        _preload((family,))


def _built(spec: dict, device: str | None):
    """Build ``spec`` on ``device``, or (None) on the first device whose eager forward runs."""
    import torch
    from coverage_models import build, devices_for

    if device is not None:
        return build(spec, device)
    errors = []
    for dev in devices_for(spec):
        try:
            built = build(spec, dev)
            with torch.no_grad():
                built.model(*built.args, **built.kwargs)
            return built
        except Exception as exc:   # noqa: BLE001 - the next device is tried; all failing is reported
            errors.append(f"{dev}: {type(exc).__name__}: {str(exc)[:120]}")
    raise RuntimeError("; ".join(errors))


def _findings(report) -> list[dict]:
    rows = []
    for f in report.findings:
        loc = f.location or {}
        rows.append({"rule": f.rule, "module": f.module, "file": Path(loc.get("file") or "").name,
                     "line": loc.get("line"), "severity": f.severity, "message": f.message})
    return sorted(rows, key=lambda r: json.dumps(r, sort_keys=True))


def _run(mode: str, built) -> dict:
    import torch

    if mode == "check":
        import ampaudit

        report = ampaudit.check(built.model, *built.args, **built.kwargs)
        return {"capture": report.capture, "findings": _findings(report), "nodes": report.nodes}
    if mode == "export":
        torch.export.export(built.model, tuple(built.args), dict(built.kwargs), strict=False)
    elif mode == "eager":
        with torch.no_grad():
            built.model(*built.args, **built.kwargs)
    elif mode == "fx":
        torch.fx.symbolic_trace(built.model)
    return {}


def child(mode: str, family: str, name: str, device: str | None) -> dict:
    """One measurement: build + ``mode``'s call, in CPU seconds (``probe`` also picks the device)."""
    import torch

    from coverage_runner import _quiet

    torch.set_num_threads(1)
    _import_libraries(family)
    spec = {"family": family, "name": name}
    with _quiet():
        if mode == "probe":
            built = _built(spec, None)
            start, wall = time.process_time(), time.perf_counter()
            out = _run("check", built)
        else:
            start, wall = time.process_time(), time.perf_counter()
            built = _built(spec, device)
            out = _run(mode, built)
    return {"seconds": time.process_time() - start, "wall": time.perf_counter() - wall, "device": built.device, **out}


# -- in the parent -----------------------------------------------------------------------------------------------

def _spawn(mode: str, spec: dict, device: str | None) -> dict:
    cmd = [sys.executable, __file__, "--child", mode, spec["family"], spec["name"], device or "-"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=CHILD_LIMIT, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"timeout after {CHILD_LIMIT:.0f} s"}
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode or not lines:
        return {"error": (done.stderr.strip().splitlines() or ["no output"])[-1][:300]}
    return json.loads(lines[-1])


def measure(spec: dict, runs: int, captures: set[str] | None) -> dict:
    """The probe, then ``runs`` alternating check/baseline pairs; one row for the model."""
    row = {"family": spec["family"], "model": spec["name"]}
    probe = _spawn("probe", spec, None)
    if "error" in probe:
        return {**row, "error": probe["error"]}
    row.update(capture=probe["capture"], device=probe["device"], findings=probe["findings"], nodes=probe["nodes"])
    if captures and probe["capture"] not in captures:
        return {**row, "skipped": True}
    baseline = BASELINE[probe["capture"]]
    checks, bases, ratios = [], [], []
    for i in range(runs):
        order = ("check", baseline) if i % 2 == 0 else (baseline, "check")
        got = {mode: _spawn(mode, spec, probe["device"]) for mode in order}
        if any("error" in g for g in got.values()):
            return {**row, "error": next(g["error"] for g in got.values() if "error" in g)}
        checks.append(got["check"]["seconds"])
        bases.append(got[baseline]["seconds"])
        ratios.append(checks[-1] / max(bases[-1], 1e-9))
    if runs:
        row.update(baseline=baseline, check_s=statistics.median(checks), baseline_s=statistics.median(bases),
                   ratio=statistics.median(ratios), check_runs=checks, baseline_runs=bases)
    return row


def family_table(rows: list[dict]) -> list[str]:
    """Markdown: per family and capture, models, median and worst check time, and the median/worst ratio."""
    lines = ["| family | capture | models | median check | worst check | median ratio | worst ratio | baseline |",
             "|---|---|---|---|---|---|---|---|"]
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if "check_s" in r:
            groups.setdefault((r["family"], r["capture"]), []).append(r)
    for (family, capture), rs in sorted(groups.items()):
        times, ratios = [r["check_s"] for r in rs], [r["ratio"] for r in rs]
        worst = max(rs, key=lambda r: r["check_s"])
        lines.append(f"| {family} | {capture} | {len(rs)} | {statistics.median(times):.2f} s | "
                     f"{worst['check_s']:.2f} s ({worst['model']}) | {statistics.median(ratios):.2f}x | "
                     f"{max(ratios):.2f}x | {BASELINE[capture]} |")
    return lines


def compare(rows: list[dict], before_path: Path) -> list[str]:
    """The models whose findings differ from ``before_path``'s (a ``--findings`` file)."""
    before = {(r["family"], r["model"]): r.get("findings") for r in json.loads(before_path.read_text())}
    diffs = []
    for r in rows:
        key = (r["family"], r["model"])
        if key in before and before[key] != r.get("findings"):
            old, new = before[key] or [], r.get("findings") or []
            lost = [f for f in old if f not in new]
            gained = [f for f in new if f not in old]
            diffs.append(f"{r['model']}: {len(lost)} finding(s) lost, {len(gained)} gained "
                         f"(first: {(lost or gained)[0] if lost or gained else r.get('error')})")
    return diffs


def _write(args, rows: list[dict]) -> None:
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    if args.findings:
        args.findings.write_text(json.dumps([{k: r.get(k) for k in ("family", "model", "capture", "findings")}
                                             for r in rows], indent=1))


def _specs(args) -> list[dict]:
    from coverage_models import list_models

    specs = list_models(args.families, timm_count=args.timm_count)
    if args.models:
        specs = [s for s in specs if s["name"] in args.models]
    return specs[: args.limit] if args.limit else specs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--families", nargs="+", default=["torchvision-det", "transformers"])
    parser.add_argument("--models", nargs="*", help="only these model names")
    parser.add_argument("--captures", nargs="*", help="time only models captured by these (export, dispatch, fx)")
    parser.add_argument("--runs", type=int, default=3, help="alternating check/baseline pairs per model")
    parser.add_argument("--timm-count", type=int, default=160)
    parser.add_argument("--limit", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write every row here")
    parser.add_argument("--findings", type=Path, help="write each model's findings here")
    parser.add_argument("--compare", type=Path, help="compare findings with this --findings file; exit 1 on a change")
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--child", nargs=4, metavar=("MODE", "FAMILY", "NAME", "DEVICE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        mode, family, name, device = args.child
        print(json.dumps(child(mode, family, name, None if device == "-" else device)), flush=True)
        return 0
    rows = []
    for spec in _specs(args):
        row = measure(spec, args.runs, set(args.captures) if args.captures else None)
        rows.append(row)
        shown = (f"{row['capture']:8s} check {row['check_s']:6.2f} s  {row['baseline']} {row['baseline_s']:6.2f} s  "
                 f"ratio {row['ratio']:.2f}x" if "check_s" in row else row.get("error") or row.get("capture"))
        print(f"{spec['family']:16s} {spec['name']:40s} {shown}", flush=True)
        _write(args, rows)      # after every model: a long run stopped early keeps what it measured
    if args.markdown:
        print("\n".join(family_table(rows)))
    status = 0
    if args.compare:
        diffs = compare(rows, args.compare)
        print("\n".join(diffs) if diffs else f"findings identical to {args.compare} on {len(rows)} model(s)")
        status = 1 if diffs else 0
    return status


if __name__ == "__main__":
    sys.exit(main())
