"""Step time of a training loop with ``ampaudit.watch`` against the same loop with no hooks.

    python bench/watch_overhead.py                              # samples/char_transformer.py, bf16 autocast
    python bench/watch_overhead.py --steps 200 --chunk 5                 # the numbers quoted in watch.py
    python bench/watch_overhead.py --stats-every 1                       # statistics on every pass
    python bench/watch_overhead.py --target ../shared/planted/gelu_cube.py --steps 50
    python bench/watch_overhead.py --grad-divergence-every 1 --local-divergence-every 1   # every scope, every check

Four loops train identical copies of the model (same weights, same batches, same optimizer):

  none        no hooks                                                        (the baseline)
  stats       watch(model, every=50): the non-finite flag on every pass, per-module statistics on one pass
              in ``stats_every`` (watch's default; ``--stats-every 1`` for every pass)
  divergence  watch(model, stats=False, divergence_every=50): FP32 shadow every 50 steps, no statistics
              (gradient and local scopes on watch's default share of the checks; the options below)
  both        watch(model, every=50, divergence_every=50): statistics plus divergence

The loops take turns, ``--chunk`` steps at a time, so load from other processes on a shared machine falls on
all of them alike. The first ``--warmup`` steps of each loop are not timed (they include the watch's one-off
replay of the first step under the op-level locator, and the divergence check of step 0); the timed steps
then hold one divergence check per 50 steps exactly, so the ratio is the amortized cost. With ``--steps 200``
they are checks 1-4 of the run: with watch's defaults one of them compares gradients and two re-run the
leaf modules, the same mix as in a long run.

Times are CPU seconds of this process (``time.process_time``) with one torch thread by default: on a shared
machine wall time mostly measures the neighbours. Wall time is printed beside them.

Targets (ratios to ``none``): stats <= 1.10x; divergence every 50 <= 1.05x amortized. ``both`` is shown
with its ratio to ``none`` and to ``stats`` (the divergence cost on top of statistics, also <= 1.05x).
Exit status 0 when every target passes, 1 otherwise.
"""
from __future__ import annotations

import argparse
import copy
import itertools
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ampaudit.loading import load_target
from ampaudit.runtime.watch import watch

TARGETS = {"stats": 1.10, "divergence": 1.05}
BOTH_OVER_STATS = 1.05
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def batches(train_data, n: int) -> list:
    out = []
    for x, y in itertools.islice(train_data(), n):
        out.append((x if isinstance(x, tuple) else (x,), y))
    if len(out) < n:
        raise SystemExit(f"train_data() yielded {len(out)} batches, {n} needed")
    return out


class Loop:
    """One model copy, its optimizer and (optionally) a watch; ``run(batches)`` returns seconds spent."""

    def __init__(self, name: str, model: torch.nn.Module, make_optimizer, loss_fn, dtype: torch.dtype,
                 watch_kwargs: dict | None):
        self.name, self.model, self.loss_fn, self.dtype = name, model, loss_fn, dtype
        self.opt = make_optimizer(model.parameters()) if make_optimizer else torch.optim.AdamW(model.parameters())
        self.watch = watch(model, dtype=dtype, **watch_kwargs) if watch_kwargs is not None else None
        self.step = 0
        self.seconds = 0.0        # CPU time of this process: what the ratios use
        self.wall = 0.0
        self.timed_steps = 0

    def run(self, chunk: list, timed: bool) -> None:
        t0, c0 = time.perf_counter(), time.process_time()
        for x, y in chunk:
            if self.watch is not None:
                self.watch.set_step(self.step)
            with torch.autocast("cpu", dtype=self.dtype):
                out = self.model(*x)
            loss = self.loss_fn(out, y)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            self.opt.step()
            self.step += 1
        if timed:
            self.wall += time.perf_counter() - t0
            self.seconds += time.process_time() - c0
            self.timed_steps += len(chunk)

    def close(self) -> None:
        if self.watch is not None:
            self.watch.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=str(ROOT / "samples" / "char_transformer.py"))
    ap.add_argument("--steps", type=int, default=100, help="timed steps per loop (a multiple of 50)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--chunk", type=int, default=10, help="steps per turn")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (0: leave torch's default)")
    ap.add_argument("--divergence-every", type=int, default=50)
    ap.add_argument("--grad-divergence-every", type=int, default=None,
                    help="watch(grad_divergence_every=...) in checks; default: watch's")
    ap.add_argument("--local-divergence-every", type=int, default=None,
                    help="watch(local_divergence_every=...) in checks; default: watch's")
    ap.add_argument("--stats-every", type=int, default=None, help="watch(stats_every=...); default: watch's")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    loaded = load_target(args.target)
    train_data, loss_fn = loaded.hook("train_data"), loaded.hook("loss_fn")
    if train_data is None or loss_fn is None:
        raise SystemExit(f"{args.target} needs train_data() and loss_fn() for this benchmark")
    data = batches(train_data, args.warmup + args.steps)
    sampling = {} if args.stats_every is None else {"stats_every": args.stats_every}
    schedule = {k: v for k, v in (("grad_divergence_every", args.grad_divergence_every),
                                  ("local_divergence_every", args.local_divergence_every)) if v is not None}
    configs = {"none": None, "stats": {"every": 50, **sampling},
               "divergence": {"stats": False, "divergence_every": args.divergence_every, **schedule},
               "both": {"every": 50, "divergence_every": args.divergence_every, **sampling, **schedule}}
    loops = [Loop(name, copy.deepcopy(loaded.model), loaded.hook("make_optimizer"), loss_fn, dtype, kw)
             for name, kw in configs.items()]
    try:
        for loop in loops:
            loop.run(data[: args.warmup], timed=False)
        timed = data[args.warmup:]
        for start in range(0, len(timed), args.chunk):
            for loop in loops:
                loop.run(timed[start:start + args.chunk], timed=True)
    finally:
        for loop in loops:
            loop.close()
    base = loops[0].seconds / loops[0].timed_steps
    div_checks = sum(1 for s in range(args.warmup, args.warmup + args.steps) if s % args.divergence_every == 0)
    print(f"target {loaded.display}  autocast cpu {args.dtype}  threads {torch.get_num_threads()}  "
          f"timed steps {args.steps} per loop (divergence checks in them: {div_checks})")
    print(f"{'loop':<12}{'ms/step':>10}{'wall ms':>10}{'ratio':>9}{'target':>9}  result")
    ok = True
    for loop in loops:
        ms = loop.seconds / loop.timed_steps * 1e3
        ratio = loop.seconds / loop.timed_steps / base
        limit = TARGETS.get(loop.name)
        verdict = "" if limit is None else ("PASS" if ratio <= limit else "FAIL")
        extra = ""
        if loop.name == "both":
            over_stats = loop.seconds / loop.timed_steps / (loops[1].seconds / loops[1].timed_steps)
            good = over_stats <= BOTH_OVER_STATS
            verdict = "PASS" if good else "FAIL"
            ok &= good
            extra = f"  ({over_stats:.3f}x of stats; target {BOTH_OVER_STATS:.2f}x)"
        ok &= verdict != "FAIL"
        shown = "" if limit is None else f"{limit:.2f}x"
        wall = loop.wall / loop.timed_steps * 1e3
        print(f"{loop.name:<12}{ms:>10.2f}{wall:>10.2f}{ratio:>8.3f}x{shown:>9}  {verdict}{extra}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
