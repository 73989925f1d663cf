"""What one divergence check of ``ampaudit.watch`` costs, by scope, on a training step.

    python bench/watch_check_cost.py                        # samples/char_transformer.py, bf16 autocast
    python bench/watch_check_cost.py --target ../shared/planted/gelu_cube.py

Two copies of the model train side by side, step by step: one under ``watch(stats=False)`` (the per-pass flag
only), one under ``watch(stats=False, divergence_every=5)`` with a single scope set: ``global`` (no local
re-runs, no gradients), ``local`` (global + the leaves' own errors), ``composite`` (global + every module's own
error: the composites re-run with their children in FP32) or ``grad`` (all of them and the FP32 backward). The extra CPU time of the second
loop, divided by its number of checks, is the cost of one check; a third variant, ``fp32``, replaces the check
by a bare FP32 forward of the same batch at the same point (after backward, before the optimizer step) for
comparison. Each figure is the median of ``--repeat`` runs.

The last line times one Linear layer of the model's MLP shape in FP32 and under bf16 autocast: on CPUs with
bf16 instructions the FP32 shadow's matrix multiplies run several times slower than the training step's.
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

# (grad_divergence_every, local_divergence_every, composite_divergence_every) of each variant
SCOPES = {"global": (None, None, None), "local": (None, 1, None), "composite": (None, 1, 1), "grad": (1, 1, 1)}
EVERY = 5


def _step(model, opt, loss_fn, w, step: int, batch, dtype, after_backward=None) -> None:
    x, y = batch
    w.set_step(step)
    with torch.autocast("cpu", dtype=dtype):
        out = model(*x)
    loss = loss_fn(out, y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if after_backward is not None:
        after_backward()
    opt.step()


def check_cost(loaded, data: list, variant: str, dtype, steps: int) -> float:
    """Extra CPU ms per check of ``variant`` against the flag-only loop (one side-by-side run)."""
    base, probe = copy.deepcopy(loaded.model), copy.deepcopy(loaded.model)
    make_opt = loaded.hook("make_optimizer") or (lambda params: torch.optim.AdamW(params))
    opts = make_opt(base.parameters()), make_opt(probe.parameters())
    loss_fn = loaded.hook("loss_fn")
    if variant == "fp32":
        watches = (watch(base, dtype=dtype, stats=False), watch(probe, dtype=dtype, stats=False))
    else:
        grad_every, local_every, composite_every = SCOPES[variant]
        watches = (watch(base, dtype=dtype, stats=False),
                   watch(probe, dtype=dtype, stats=False, divergence_every=EVERY,
                         grad_divergence_every=grad_every, local_divergence_every=local_every,
                         composite_divergence_every=composite_every))
    spent, checks = [0.0, 0.0], 0
    try:
        for i in range(steps):
            batch = data[i % len(data)]
            extra = None
            if variant == "fp32" and i % EVERY == 0:
                def extra(b=batch):
                    with torch.no_grad():
                        probe(*b[0])
            for k, (model, opt, w) in enumerate(zip((base, probe), opts, watches)):
                c0 = time.process_time()
                _step(model, opt, loss_fn, w, i, batch, dtype, extra if k == 1 else None)
                if i >= 2 * EVERY:
                    spent[k] += time.process_time() - c0
            if i >= 2 * EVERY and i % EVERY == 0:
                checks += 1
    finally:
        for w in watches:
            w.close()
    return (spent[1] - spent[0]) / checks * 1e3


def linear_ms(width: int, rows: int, dtype) -> tuple[float, float]:
    """(fp32 us, autocast us) of one ``width -> 4*width`` Linear on ``rows`` rows."""
    layer, x = torch.nn.Linear(width, 4 * width), torch.randn(rows, width)
    out = []
    for amp in (False, True):
        with torch.no_grad(), torch.autocast("cpu", dtype=dtype, enabled=amp):
            for _ in range(20):
                layer(x)
            c0 = time.process_time()
            for _ in range(200):
                layer(x)
        out.append((time.process_time() - c0) / 200 * 1e6)
    return out[0], out[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=str(ROOT / "samples" / "char_transformer.py"))
    ap.add_argument("--steps", type=int, default=300, help="steps per run (one check every 5)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = torch.bfloat16
    loaded = load_target(args.target)
    if loaded.hook("train_data") is None or loaded.hook("loss_fn") is None:
        raise SystemExit(f"{args.target} needs train_data() and loss_fn() for this benchmark")
    data = [(x if isinstance(x, tuple) else (x,), y) for x, y in itertools.islice(loaded.hook("train_data")(), 40)]
    print(f"target {loaded.display}  autocast cpu bfloat16  threads {torch.get_num_threads()}  "
          f"{args.steps} steps per run, {args.repeat} runs")
    print(f"{'check':<10}{'extra ms':>10}  runs")
    for variant in ("global", "local", "composite", "grad", "fp32"):
        runs = [check_cost(loaded, data, variant, dtype, args.steps) for _ in range(args.repeat)]
        label = variant if variant != "fp32" else "fp32 fwd"
        print(f"{label:<10}{statistics.median(runs):>10.2f}  " + " ".join(f"{r:.2f}" for r in runs))
    fp32, low = linear_ms(64, 1024, dtype)
    print(f"Linear 64->256 on 1024 rows: fp32 {fp32:.0f} us, bf16 autocast {low:.0f} us ({fp32 / low:.1f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
