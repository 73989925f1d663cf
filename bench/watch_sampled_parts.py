"""What a sampled statistics pass of ``ampaudit.watch`` spends its time on: the precursors, the extremes' reads, the rest.

    python bench/watch_sampled_parts.py                      # samples/char_transformer.py, bf16 autocast, 200 steps
    python bench/watch_sampled_parts.py --steps 300

Copies of the model train side by side, one step each in turn (same weights, same batches), each step timed
(process CPU time, one torch thread) against the same step of the copy without hooks; the median of those
differences is printed per loop, over the steps that are neither the first ones nor an interval's counting pass:

  sampled    watch(every=50, stats_every=1): every pass sampled (statistics and precursors)
  no_prec    the same without the precursors
  no_reads   no_prec with the statistics' min/max reductions replaced by a constant (what is left: hooks, Python)
  flag       watch(stats=False): the per-pass non-finite flag alone

``sampled - no_prec`` is what the precursors cost per sampled pass, ``no_prec - no_reads`` reading the extremes of
every module output and gradient. ``bench/watch_pass_cost.py`` gives the cost of each kind of pass of the default
schedule.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from ampaudit.loading import load_target
from ampaudit.runtime import stats as stats_module
from watch_overhead import batches
from watch_pass_cost import timed_side_by_side

_ZERO = torch.zeros(())


@contextlib.contextmanager
def no_reads():
    """The statistics' extremes replaced by a constant (values are wrong: for timing only)."""
    kept = stats_module.extremes
    stats_module.extremes = lambda t: (_ZERO, _ZERO)
    try:
        yield
    finally:
        stats_module.extremes = kept


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=str(ROOT / "samples" / "char_transformer.py"))
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    torch.set_num_threads(1)
    loaded = load_target(args.target)
    loss_fn = loaded.hook("loss_fn")
    data = batches(loaded.hook("train_data"), args.steps)
    sampled = {"every": 50, "stats_every": 1}
    configs = {"none": (None, None), "sampled": (sampled, None), "no_prec": ({**sampled, "precursors": False}, None),
               "no_reads": ({**sampled, "precursors": False}, no_reads), "flag": ({"stats": False}, None)}
    seconds = timed_side_by_side(loaded.model, loss_fn, data, {n: kw for n, (kw, _) in configs.items()},
                                 {n: patch for n, (_, patch) in configs.items() if patch})
    keep = [i for i in range(10, args.steps) if i % 50]          # not the counting passes
    base = [seconds["none"][i] for i in keep]
    print(f"target {loaded.display}  {len(keep)} steps compared, median {statistics.median(base) * 1e3:.2f} ms/step "
          f"without hooks")
    for name in list(configs)[1:]:
        extra = statistics.median((seconds[name][i] - seconds["none"][i]) * 1e3 for i in keep)
        print(f"{name:<10} +{extra:.2f} ms per pass")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
