"""What each kind of pass of ``ampaudit.watch``'s statistics costs: unsampled, sampled, and the counting pass.

    python bench/watch_pass_cost.py                          # samples/char_transformer.py, bf16 autocast
    python bench/watch_pass_cost.py --steps 800 --stats-every 4 --precursors-every 4

Copies of the model train side by side, one step each in turn (same weights, same batches): one with no hooks,
one under ``watch(every=50)`` (the default schedule, precursors on) and one under ``watch(stats=False)`` (the
per-pass non-finite flag alone). Each step is timed (process CPU time, one torch thread) and set against the same
step of the loop without hooks; the median of those differences is printed per kind of pass: ``plain`` (not
sampled: the flag only), ``precursors`` (the instability precursors alone, on the passes between sampled ones that
``precursors_every`` picks), ``sampled`` (per-module statistics: one min/max read per module output and gradient) and
``counting`` (the first sampled pass of each interval: exact counts and the gradient histograms too), with each
kind's share of an interval. ``bench/watch_overhead.py`` gives the amortized ratio of the same loops.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from ampaudit.loading import load_target
from ampaudit.runtime.watch import watch
from watch_overhead import batches


def kind(step: int, every: int, stats_every: int, precursors_every: int) -> str:
    """The kind of pass ``step`` is, with one forward per step numbered from 0 by ``set_step``."""
    if step % stats_every:
        return "plain" if step % precursors_every else "precursors"
    return "counting" if step % every < stats_every else "sampled"


def timed_side_by_side(model, loss_fn, data, configs: dict, patches: dict | None = None) -> dict[str, list[float]]:
    """Train one copy of ``model`` per ``configs`` entry (``watch`` keyword arguments, None: no hooks), one step
    each in turn on the same batches under CPU bf16 autocast; each step's process CPU time per name. ``patches``:
    a context manager factory per name, entered around its steps."""
    models = {n: copy.deepcopy(model) for n in configs}
    opts = {n: torch.optim.AdamW(m.parameters()) for n, m in models.items()}
    watches = {n: watch(models[n], dtype=torch.bfloat16, **kw) if kw is not None else None
               for n, kw in configs.items()}
    seconds: dict[str, list[float]] = {n: [] for n in configs}
    try:
        for step, (x, y) in enumerate(data):
            for name in configs:
                mod, opt, w = models[name], opts[name], watches[name]
                patch = (patches or {}).get(name)
                with patch() if patch else contextlib.nullcontext():
                    c0 = time.process_time()
                    if w is not None:
                        w.set_step(step)
                    with torch.autocast("cpu", dtype=torch.bfloat16):
                        out = mod(*x)
                    loss = loss_fn(out, y)
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    opt.step()
                    seconds[name].append(time.process_time() - c0)
    finally:
        for w in watches.values():
            if w is not None:
                w.close()
    return seconds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=str(ROOT / "samples" / "char_transformer.py"))
    ap.add_argument("--steps", type=int, default=400, help="timed steps per loop")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--every", type=int, default=50)
    ap.add_argument("--stats-every", type=int, default=16, help="watch(stats_every=...), watch's default")
    ap.add_argument("--precursors-every", type=int, default=8, help="watch(precursors_every=...), watch's default")
    args = ap.parse_args()
    torch.set_num_threads(1)
    loaded = load_target(args.target)
    loss_fn = loaded.hook("loss_fn")
    data = batches(loaded.hook("train_data"), args.warmup + args.steps)
    configs = {"none": None, "stats": {"every": args.every, "stats_every": args.stats_every,
                                       "precursors_every": args.precursors_every},
               "flag": {"stats": False}}
    seconds = timed_side_by_side(loaded.model, loss_fn, data, configs)
    base = seconds["none"][args.warmup:]
    interval = statistics.median(base) * args.every * 1e3
    print(f"target {loaded.display}  {args.steps} timed steps, median {statistics.median(base) * 1e3:.2f} ms/step "
          f"without hooks; per {args.every}-step interval {interval:.0f} ms")
    for name in ("stats", "flag"):
        extra: dict[str, list[float]] = {}
        for i, (s, b) in enumerate(zip(seconds[name][args.warmup:], base), start=args.warmup):
            extra.setdefault(kind(i, args.every, args.stats_every, args.precursors_every), []).append((s - b) * 1e3)
        ratio = sum(seconds[name][args.warmup:]) / sum(base)
        parts = []
        # The flag does the same on every pass: its steps beside a sampled one only show that step's cache misses.
        for k in ("plain", "precursors", "sampled", "counting") if name == "stats" else ("plain",):
            if k in extra:
                ms, share = statistics.median(extra[k]), len(extra[k]) / args.steps * args.every
                parts.append(f"{k} +{ms:.2f} ms x{share:.1f}/interval = {ms * share:.0f} ms")
        print(f"{name:<6} {ratio:.3f}x  " + "; ".join(parts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
