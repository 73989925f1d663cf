"""Step time of a training loop with ``ampaudit.watch`` against the same loop with no hooks.

    python bench/watch_overhead.py                              # samples/char_transformer.py, bf16 autocast
    python bench/watch_overhead.py --repeat 5                            # more runs, a steadier median
    python bench/watch_overhead.py --stats-every 1                       # statistics on every pass
    python bench/watch_overhead.py --target ../shared/planted/gelu_cube.py --steps 50
    python bench/watch_overhead.py --grad-divergence-every 1 --local-divergence-every 1   # every scope, every check

Seven loops train identical copies of the model (same weights, same batches, same optimizer):

  none        no hooks                                                        (the baseline)
  flag        watch(model, stats=False): the non-finite flag on every pass, nothing else
  stats       watch(model, every=50): the flag, plus per-module statistics on one pass in ``stats_every``
              (watch's default; ``--stats-every 1`` for every pass)
  divergence  watch(model, stats=False, divergence_every=50): the flag, plus the FP32 shadow every 50 steps
              (gradient and local scopes on watch's default share of the checks; the options below)
  both        watch(model, every=50, divergence_every=50): statistics plus divergence
  no_hist     watch(model, every=50, grad_hist=False): statistics without the log2|gradient| histograms
  no_prec     watch(model, every=50, precursors=False): statistics without the instability precursors

The loops take turns, ``--chunk`` steps at a time, so load from other processes on a shared machine falls on
all of them alike. The first ``--warmup`` steps of each loop are not timed (they include the watch's one-off
replay of the first step under the op-level locator, and the divergence check of step 0); the timed steps
then hold one divergence check per 50 steps exactly, so the ratio is the amortized cost. The default 400
steps hold checks 1-8 of a run: with watch's defaults one of them compares gradients and four re-run the
leaf modules, the same mix as in a long run. ``--repeat`` runs the whole comparison again on fresh copies;
the ratios reported are the medians of the runs (each run's ratios are printed too).

Times are CPU seconds of this process (``time.process_time``) with one torch thread by default: on a shared
machine wall time mostly measures the neighbours.

Targets: stats (the default schedule, precursors included) <= 1.05x and divergence <= 1.05x against ``none``.
Two more rows isolate what divergence
every 50 steps adds, amortized, to the same watch without it (<= 1.05x each): ``divergence/flag`` and
``both/stats``; and what the instability precursors add to the statistics (<= 1.05x): ``stats/no_prec``.
``flag`` (the per-pass non-finite check alone) is shown for reference, and so is ``stats/no_hist``:
what the gradient histograms (one pass per interval) add to the statistics.
Exit status 0 when every target passes, 1 otherwise.
"""
from __future__ import annotations

import argparse
import copy
import itertools
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ampaudit.loading import load_target
from ampaudit.runtime.watch import watch

TARGETS = {"stats": 1.05, "divergence": 1.05}
DIVERGENCE_ADDS = 1.05       # divergence on against the same watch without it
PRECURSORS_ADD = 1.05        # the instability precursors against the same statistics without them
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def batches(train_data, n: int) -> list:
    out = []
    for x, y in itertools.islice(train_data(), n):
        out.append((x if isinstance(x, tuple) else (x,), y))
    if len(out) < n:
        raise SystemExit(f"train_data() yielded {len(out)} batches, {n} needed")
    return out


class Loop:
    """One model copy, its optimizer and (optionally) a watch; ``run(batches)`` returns seconds spent.
    ``device_type``: the autocast's device (the model and batches already there); ``sync``: called before the
    clock is read (``torch.cuda.synchronize`` on a GPU, whose work is queued)."""

    def __init__(self, name: str, model: torch.nn.Module, make_optimizer, loss_fn, dtype: torch.dtype,
                 watch_kwargs: dict | None, *, device_type: str = "cpu", sync=None):
        self.name, self.model, self.loss_fn, self.dtype = name, model, loss_fn, dtype
        self.device_type, self.sync = device_type, sync
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
            with torch.autocast(self.device_type, dtype=self.dtype):
                out = self.model(*x)
            loss = self.loss_fn(out, y)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            self.opt.step()
            self.step += 1
        if self.sync is not None:
            self.sync()
        if timed:
            self.wall += time.perf_counter() - t0
            self.seconds += time.process_time() - c0
            self.timed_steps += len(chunk)

    def close(self) -> None:
        if self.watch is not None:
            self.watch.close()


def run_once(loaded, configs: dict, data: list, args, dtype) -> dict[str, float]:
    """One side-by-side run of every loop on fresh copies of the model: CPU seconds per timed step."""
    loops = [Loop(name, copy.deepcopy(loaded.model), loaded.hook("make_optimizer"), loaded.hook("loss_fn"), dtype,
                  kw) for name, kw in configs.items()]
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
    return {loop.name: loop.seconds / loop.timed_steps for loop in loops}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=str(ROOT / "samples" / "char_transformer.py"))
    ap.add_argument("--steps", type=int, default=400,
                    help="timed steps per loop (a multiple of divergence-every)")
    ap.add_argument("--repeat", type=int, default=3, help="side-by-side runs; the ratios reported are their median")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--chunk", type=int, default=5, help="steps per turn")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (0: leave torch's default)")
    ap.add_argument("--divergence-every", type=int, default=50)
    ap.add_argument("--grad-divergence-every", type=int, default=None,
                    help="watch(grad_divergence_every=...) in checks; default: watch's")
    ap.add_argument("--local-divergence-every", type=int, default=None,
                    help="watch(local_divergence_every=...) in checks; default: watch's")
    ap.add_argument("--composite-divergence-every", type=int, default=None,
                    help="watch(composite_divergence_every=...) in checks; default: watch's")
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
                                  ("local_divergence_every", args.local_divergence_every),
                                  ("composite_divergence_every", args.composite_divergence_every)) if v is not None}
    configs = {"none": None, "flag": {"stats": False}, "stats": {"every": 50, **sampling},
               "divergence": {"stats": False, "divergence_every": args.divergence_every, **schedule},
               "both": {"every": 50, "divergence_every": args.divergence_every, **sampling, **schedule},
               "no_hist": {"every": 50, "grad_hist": False, **sampling},
               "no_prec": {"every": 50, "precursors": False, **sampling}}
    div_checks = sum(1 for s in range(args.warmup, args.warmup + args.steps) if s % args.divergence_every == 0)
    print(f"target {loaded.display}  autocast cpu {args.dtype}  threads {torch.get_num_threads()}  "
          f"timed steps {args.steps} per loop (divergence checks in them: {div_checks})  repeats {args.repeat}")
    runs = [run_once(loaded, configs, data, args, dtype) for _ in range(args.repeat)]
    names = list(configs)
    # Ratios of each repeat (a repeat = every loop side by side on fresh model copies), then their median.
    ratios = {n: [r[n] / r["none"] for r in runs] for n in names}
    print(f"{'loop':<16}{'ms/step':>8}{'median':>9}{'target':>9}  result  ratios of the repeats")
    ok = True
    for name in names:
        ms = statistics.median(r[name] for r in runs) * 1e3
        ratio = statistics.median(ratios[name])
        limit = TARGETS.get(name)
        verdict = "" if limit is None else ("PASS" if ratio <= limit else "FAIL")
        ok &= verdict != "FAIL"
        shown = "" if limit is None else f"{limit:.2f}x"
        each = " ".join(f"{v:.3f}" for v in ratios[name])
        print(f"{name:<16}{ms:>8.2f}{ratio:>8.3f}x{shown:>9}  {verdict:<6}  {each}")
    for name, (num, den) in {"divergence/flag": ("divergence", "flag"), "both/stats": ("both", "stats"),
                             "stats/no_hist": ("stats", "no_hist"), "stats/no_prec": ("stats", "no_prec")}.items():
        each = [r[num] / r[den] for r in runs]
        ratio = statistics.median(each)
        limit = {"stats/no_hist": None, "stats/no_prec": PRECURSORS_ADD}.get(name, DIVERGENCE_ADDS)
        good = limit is None or ratio <= limit
        ok &= good
        verdict = "" if limit is None else "PASS" if good else "FAIL"
        shown = "" if limit is None else f"{limit:.2f}x"
        print(f"{name:<16}{'':>8}{ratio:>8.3f}x{shown:>9}  {verdict:<6}  " + " ".join(f"{v:.3f}" for v in each))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
