"""Does AMP207 (an op raising on the mixed dtypes autocast hands it) stay silent on real models that run under
autocast, on both targets? The static audit of every corpus model (bench/coverage.py's lists) under cuda float16
and cpu bfloat16, one process:

    .venv-bench/bin/python bench/mixed_dtype_scan.py --json scan.jsonl        # resumable: models in the file skip
    .venv-bench/bin/python bench/mixed_dtype_scan.py --families timm --limit 10

Prints per target the models with AMP207 findings and the audits that failed (an InputError there would be a
model refused as "inputs do not fit", the other false verdict this rule's engine could give).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
TARGETS = (("cuda", "float16"), ("cpu", "bfloat16"))


def scan(spec: dict) -> dict:
    import ampaudit
    from coverage_models import build, devices_for

    row: dict = {"model": f"{spec['family']}/{spec['name']}"}
    built = None
    for device in devices_for(spec):
        try:
            built = build(spec, device)
            built.model(*built.args, **built.kwargs)
            break
        except Exception as exc:  # noqa: BLE001 - a model that does not build is skipped, as in coverage.py
            built, row["build"] = None, str(exc)[:100]
    if built is None:
        row["skip"] = True
        return row
    for device, dtype in TARGETS:
        key, start = f"{device}:{dtype}", time.perf_counter()
        try:
            report = ampaudit.check(built.model, *built.args, device=device, dtype=dtype, **built.kwargs)
            row[key] = [(f.rule, f.severity, f.message[:120]) for f in report.findings if f.rule == "AMP207"]
        except Exception as exc:  # noqa: BLE001 - recorded, not raised: the scan counts failed audits
            row[key] = f"{type(exc).__name__}: {str(exc)[:200]}"
        row[f"{key}_s"] = round(time.perf_counter() - start, 1)
    return row


def main(argv=None) -> int:
    from coverage_models import FAMILIES, list_models

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--families", default=",".join(FAMILIES))
    p.add_argument("--limit", type=int, default=None, help="at most N models per family")
    p.add_argument("--json", type=Path, default=Path("mixed_dtype_scan.jsonl"))
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    torch.set_num_threads(1)
    done = {}
    if args.json.is_file():
        done = {r["model"]: r for r in map(json.loads, args.json.read_text().splitlines()) if r}
    specs = []
    for family in args.families.split(","):
        specs += list_models([family], timm_count=160)[: args.limit]
    with open(args.json, "a") as out:
        for spec in specs:
            if f"{spec['family']}/{spec['name']}" in done:
                continue
            row = scan(spec)
            done[row["model"]] = row
            out.write(json.dumps(row) + "\n")
            out.flush()
    rows = [done[f"{s['family']}/{s['name']}"] for s in specs]
    print(f"{len(rows)} models, {sum(bool(r.get('skip')) for r in rows)} not built")
    for device, dtype in TARGETS:
        key = f"{device}:{dtype}"
        hits = [r["model"] for r in rows if isinstance(r.get(key), list) and r[key]]
        failed = [f"{r['model']} ({r[key][:60]})" for r in rows if isinstance(r.get(key), str)]
        print(f"{device} {dtype}: AMP207 on {len(hits)} model(s) {hits}; audit failed on {len(failed)} {failed}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
