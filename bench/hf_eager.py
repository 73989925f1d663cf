"""Which transformers-all models build and run their eager forward, and why the others do not (no audit).

    OMP_NUM_THREADS=1 PYTHONPATH=$PWD .venv-bench/bin/python bench/hf_eager.py --json hf_eager.json
    .venv-bench/bin/python bench/hf_eager.py --models gptj,swin --compare hf_eager.json   # what changed

Only ``coverage_runner``'s eager stage (build on meta, else CPU, then the forward under no_grad), one model
after another in this process, each under ``--timeout`` seconds (SIGALRM): all 613 take a few minutes, where
``coverage.py`` runs every stage of every model. The reasons are grouped as ``coverage.py`` groups them.
``--compare`` names the models that run now and did not in an earlier ``--json``, and those that no longer run.
"""
from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


class _Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise _Timeout("timeout")


def eager_row(name: str, timeout: int) -> dict:
    """``{"model", "eager", "device", "seconds", "errors"}`` for one model, the shape ``coverage.py`` reads."""
    from coverage_runner import _eager, _quiet

    start = time.perf_counter()
    signal.alarm(timeout)
    try:
        with _quiet():
            _, result = _eager({"family": "transformers-all", "name": name})
    except Exception as exc:   # noqa: BLE001 - the timeout, or a build that escapes _eager
        result = {"ok": False, "error": f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"}
    finally:
        signal.alarm(0)
    return {"family": "transformers-all", "model": name, "eager": bool(result["ok"]),
            "device": result.get("device"), "seconds": round(time.perf_counter() - start, 2),
            "errors": {} if result["ok"] else {"eager": result["error"]}}


def compare(rows: list[dict], earlier: list[dict]) -> tuple[list[str], list[str]]:
    """(models that run now and did not, models that ran and no longer do), of those in both."""
    before = {r["model"]: r["eager"] for r in earlier}
    gained = [r["model"] for r in rows if r["eager"] and before.get(r["model"]) is False]
    lost = [r["model"] for r in rows if not r["eager"] and before.get(r["model"]) is True]
    return gained, lost


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default=None, help="comma-separated model types (default: all of transformers-all)")
    p.add_argument("--timeout", type=int, default=60, help="seconds per model (default 60)")
    p.add_argument("--json", type=Path, default=None, help="write the rows here")
    p.add_argument("--compare", type=Path, default=None, help="an earlier --json: what changed since")
    args = p.parse_args(argv)
    import torch

    import coverage
    from coverage_models import _hf_all

    torch.set_num_threads(1)
    signal.signal(signal.SIGALRM, _alarm)
    names = args.models.split(",") if args.models else _hf_all()[0]()
    rows = [eager_row(name, args.timeout) for name in names]
    if args.json:
        coverage.write_json(args.json, {"rows": rows})
    print(f"{sum(r['eager'] for r in rows)} of {len(rows)} models run their eager forward")
    for count, reason, models in coverage.build_failures(rows):
        print(f"  {count:3d}  {reason}: {', '.join(models[:6])}{' ...' if len(models) > 6 else ''}")
    if args.compare:
        gained, lost = compare(rows, json.loads(args.compare.read_text())["rows"])
        print(f"run now, not before ({len(gained)}): {','.join(gained)}")
        print(f"ran before, not now ({len(lost)}): {','.join(lost)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
