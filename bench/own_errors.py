"""Each model's own errors under CPU autocast, and the modules the verdict flags (ampaudit.runtime.attribution).

    python bench/own_errors.py                                # samples/, tests/assets/clean/, tests/planted/
    python bench/own_errors.py tests/planted/silu_one_minus_sigmoid.py --dtype bfloat16

One ``compare_to_fp32`` per model file on its ``example_inputs()`` (every module's own error, composites with their
children in FP32), the dtype from the file's ``EXPECT["target"]`` (else ``--dtype``). Per model: how many modules
have a nonzero own error (the peers of the relative line), their median, the largest own error of a module that
is not flagged, and the culprits with the line each crossed. The relative line's numbers in
rules/policy/settings.toml [attribution] were chosen from this table: clean models must stay far under them.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ampaudit.loading import load_target
from ampaudit.runtime.attribution import culprits, peer_median
from ampaudit.runtime.compare import compare_to_fp32

DEFAULT = ["samples/*.py", "tests/assets/clean/*.py", "tests/planted/*.py"]


def own_errors(path: str, default: str) -> tuple[str, dict[str, float | None]]:
    loaded = load_target(path)
    dtype = (loaded.namespace.get("EXPECT") or {}).get("target", {}).get("dtype", default)
    rows = compare_to_fp32(loaded.model, loaded.args, loaded.kwargs, dtype=getattr(torch, dtype))
    return dtype, {r["module"]: r.get("local_rel_l2") for r in rows}


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="*")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    args = ap.parse_args()
    torch.set_num_threads(1)
    files = args.files or sorted(str(p) for pattern in DEFAULT for p in ROOT.glob(pattern))
    print(f"{'model':<32}{'dtype':<10}{'peers':>6}{'median':>9}{'max ok':>9}  culprits (rule, own error)")
    for path in files:
        try:
            dtype, own = own_errors(path, args.dtype)
        except Exception as exc:  # noqa: BLE001 - a model whose autocast forward raises has no own errors
            print(f"{Path(path).name:<32}{type(exc).__name__}: {str(exc).splitlines()[0][:60]}")
            continue
        found = culprits(own, dtype)
        median, peers = peer_median(own)
        named = {c.module for c in found}
        ok = max((v for k, v in own.items() if v is not None and k not in named and v == v), default=None)
        shown = ", ".join(f"{c.module or '<top>'} ({c.rule}, {c.rel_l2:.3g})" for c in found) or "-"
        print(f"{Path(path).name:<32}{dtype:<10}{peers:>6}{_num(median):>9}{_num(ok):>9}  {shown}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
