"""What the decision part of a divergence check costs (``ampaudit.runtime.decision_record``), against one bf16
forward of the same batch.

    python bench/decision_check_cost.py                                  # the sample transformer and the MoE router
    python bench/decision_check_cost.py samples/char_transformer.py --repeat 11

Per model file: the median over ``--repeat`` runs (one thread, CPU, bf16 autocast, no grad) of a plain autocast
forward, and of :func:`~ampaudit.runtime.decision_record.measure_decisions`: the autocast forward under the
recording dispatch mode, then, only when it made a decision on floating values, the FP32 forward that is compared
with it. A watched model whose first check makes no such decision is not measured again.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ampaudit.loading import load_target
from ampaudit.runtime.decision_record import measure_decisions

DEFAULT = ("samples/char_transformer.py", "tests/planted/moe_router_bf16.py")


def _median_ms(fn, repeat: int) -> float:
    fn()                                   # warm-up
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("targets", nargs="*", default=list(DEFAULT))
    p.add_argument("--repeat", type=int, default=7)
    args = p.parse_args()
    torch.set_num_threads(1)
    for path in args.targets:
        t = load_target(str(ROOT / path) if not Path(path).is_absolute() else path)
        model, a, kw = t.model.train(), t.args, t.kwargs

        def forward() -> None:
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
                model(*a, **kw)

        def decisions() -> None:
            measure_decisions(model, a, kw, device_type="cpu", dtype=torch.bfloat16)

        rows = measure_decisions(model, a, kw, device_type="cpu", dtype=torch.bfloat16)
        fwd, dec = _median_ms(forward, args.repeat), _median_ms(decisions, args.repeat)
        sites = ", ".join(f"{r['module'] or '<top>'} {r['op']} {r['share_flipped']:.1%}" for r in rows) or "none"
        print(f"{path}: bf16 forward {fwd:.1f} ms, decision check {dec:.1f} ms ({dec / fwd:.2f}x); sites: {sites}")


if __name__ == "__main__":
    main()
