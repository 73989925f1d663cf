"""What `ampaudit fix` costs: casts added by merged FP32 islands against wrapping each flagged op on its own, and
forward time of the fixed model against the unfixed one under autocast, side by side.

    python bench/fix.py                       # planted faults + samples, CPU fp16 autocast, 1 thread
    python bench/fix.py --dtype bfloat16 --reps 50 --threads 2 --json out.json
    python bench/fix.py --models ../shared/planted/mask_fill.py samples/char_transformer.py

Casts: ``islands`` counts the ``.float()`` nodes the fix inserted; ``per-op`` counts what wrapping each flagged op
alone needs, as the rules' fix text reads (``op(x.float()).to(x.dtype)``: an upcast per low-dtype input, a cast
back per output). Time: the fastest of ``--reps`` forwards of each model, the two alternating, under
``torch.no_grad()`` and ``torch.autocast("cpu", dtype)``, after warm-up, in CPU time of the one torch thread
(so other processes on a shared machine do not count; ``--threads`` above 1 switches to wall time); ``raises`` when the unfixed model cannot run under autocast
(the fault the fix removes). Target: fixed/unfixed at most 1.15x on every model that runs; exit 0 when met.

Numbers are for this machine's CPU autocast; on CUDA the fp32 islands compete with Tensor Core fp16 kernels, so
measure there before quoting a GPU ratio.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ampaudit.loading import load_target
from ampaudit.rewrite.api import fix

PLANTED = ROOT.parent / "shared" / "planted"
DEFAULT_MODELS = [PLANTED / f"{n}.py" for n in ("mask_fill", "mask_fill_crash", "gelu_cube", "cumsum_pool",
                                                 "bn_running_var")] + \
                 [ROOT / "samples" / f"{n}.py" for n in ("char_transformer", "resnet_bn")]
TARGET_RATIO = 1.15


def _clock():
    # With one torch thread every op runs on this thread, so its CPU time is the forward's cost even when other
    # processes share the cores (wall time then mostly measures the neighbours). More threads: wall time.
    return time.thread_time if torch.get_num_threads() == 1 else time.perf_counter


def time_pair(a, b, args, kwargs, dtype: torch.dtype, reps: int) -> tuple[float | None, float | None]:
    """Fastest forward (seconds) of ``a`` and of ``b`` under CPU autocast, timed alternately so that load from
    other processes hits both alike; None for a model whose forward raises. The minimum is the least disturbed
    run (as timeit reports), which is what a ratio between two kernels' costs needs on a shared machine."""
    runs = {}
    for key, model in (("a", a), ("b", b)):
        model.eval()
        try:
            with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
                for _ in range(3):
                    model(*args, **kwargs)
            runs[key] = model
        except RuntimeError:
            runs[key] = None
    times: dict[str, list[float]] = {"a": [], "b": []}
    clock = _clock()
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
        for _ in range(reps):
            for key, model in runs.items():
                if model is None:
                    continue
                t0 = clock()
                model(*args, **kwargs)
                times[key].append(clock() - t0)
    return tuple(min(times[k]) if runs[k] is not None else None for k in ("a", "b"))  # type: ignore[return-value]


def bench_one(path: Path, dtype_name: str, reps: int) -> dict:
    t = load_target(str(path))
    result = fix(t.model, *t.args, device="cpu", dtype=dtype_name, verify=False, **t.kwargs)
    b, a = time_pair(t.model, result.module, t.args, t.kwargs, getattr(torch, dtype_name), reps)
    rep = result.report
    return {"model": path.stem, "flagged_ops": rep.flagged_ops, "islands": len(rep.islands), "casts": rep.casts,
            "casts_per_op": rep.casts_per_op, "unfixed_ms": None if b is None else b * 1e3,
            "fixed_ms": None if a is None else a * 1e3, "ratio": None if (a is None or b is None) else a / b}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="*", type=Path, default=DEFAULT_MODELS)
    ap.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"))
    ap.add_argument("--reps", type=int, default=30, help="timed forwards per model and variant")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 keeps shared machines steady)")
    ap.add_argument("--json", type=Path, help="also write the rows as JSON")
    opts = ap.parse_args(argv)
    torch.set_num_threads(opts.threads)
    rows = [bench_one(p, opts.dtype, opts.reps) for p in opts.models if p.exists()]
    fmt = "{:<18} {:>7} {:>7} {:>14} {:>14} {:>11} {:>11} {:>7}"
    what = "thread CPU time" if opts.threads == 1 else "wall time"
    print(f"ampaudit fix: CPU {opts.dtype} autocast, {opts.threads} thread(s), fastest of {opts.reps} alternating "
          f"forwards ({what})")
    print(fmt.format("model", "flagged", "islands", "casts islands", "casts per-op", "unfixed ms", "fixed ms", "ratio"))
    for r in rows:
        ms = lambda v: "raises" if v is None else f"{v:.3f}"
        ratio = "n/a" if r["ratio"] is None else f"{r['ratio']:.2f}x"
        print(fmt.format(r["model"], r["flagged_ops"], r["islands"], r["casts"], r["casts_per_op"],
                         ms(r["unfixed_ms"]), ms(r["fixed_ms"]), ratio))
    ratios = [r["ratio"] for r in rows if r["ratio"] is not None]
    total_i, total_p = sum(r["casts"] for r in rows), sum(r["casts_per_op"] for r in rows)
    print(f"casts: {total_i} with merged islands vs {total_p} wrapping each flagged op alone "
          f"({total_p / max(total_i, 1):.1f}x fewer)")
    ok = all(x <= TARGET_RATIO for x in ratios)
    if ratios:
        gmean = statistics.geometric_mean(ratios)
        print(f"forward time fixed/unfixed: geometric mean {gmean:.2f}x, worst {max(ratios):.2f}x "
              f"(target <= {TARGET_RATIO}x): {'met' if ok else 'NOT met'}")
    if opts.json:
        opts.json.write_text(json.dumps({"dtype": opts.dtype, "threads": opts.threads, "rows": rows}, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
