"""Own errors of a model whose activations sit in fp16's subnormals (timm's halonet50ts at random init): which
modules the attribution flags with and without the excuse for what rounding alone loses around a module
(rules/policy/settings.toml [attribution] rounding_explains).

    .venv-bench/bin/python bench/subnormal_tail.py [--model halonet50ts]

Prints each module flagged without the excuse: its own error, its inputs' rounding and its output's storage, in
fp16 unit roundoffs; then the modules still flagged with it.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="halonet50ts", help="a timm model name")
    args = p.parse_args()
    from coverage_tvops import import_torchvision

    import_torchvision()
    from coverage_models import build

    from ampaudit.runtime.attribution import culprits, rounding_around
    from ampaudit.runtime.compare import compare_to_fp32

    built = build({"family": "timm", "name": args.model}, "cpu")
    rows = {r["module"]: r for r in compare_to_fp32(built.model, built.args, built.kwargs or {},
                                                   dtype=torch.float16, device_type="cpu")}
    own = {name: r.get("local_rel_l2") for name, r in rows.items()}
    u = 2.0 ** -11

    def units(v):
        return "-" if v is None else f"{v / u:.1f}"

    print(f"{'module':40s} {'own u':>8s} {'inputs u':>9s} {'output u':>9s}")
    for c in culprits(own, torch.float16):
        r = rows[c.module]
        print(f"{c.module or '<top>':40s} {c.units:8.1f} {units(r.get('local_input_rel_l2')):>9s} "
              f"{units(r.get('local_output_rel_l2')):>9s}")
    kept = culprits(own, torch.float16, rounding={n: rounding_around(r) for n, r in rows.items()})
    print("flagged with the excuse:", ", ".join(c.module or "<top>" for c in kept) or "none")


if __name__ == "__main__":
    main()
