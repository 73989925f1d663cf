"""Peak memory of FP32, O1 and O2 training of the sample transformer (samples/char_transformer.py), side by side,
and of O1 and O2 with activation checkpointing of its blocks (``--checkpoint-activations auto``).

    python bench/train_memory.py                          # fp16 O1/O2 against FP32, 3 steps each
    python bench/train_memory.py --dtype bfloat16
    python bench/train_memory.py --d-model 256 --layers 4 --batch 32 --block 128 --json out.json

Each row runs in a fresh child process. The child builds the model, resets the kernel's peak-RSS mark
(``/proc/self/clear_refs``), trains ``--steps`` optimizer steps with ``ampaudit.Trainer`` and reads the new peak
(``VmHWM``): the row's number is that peak minus the RSS just before the model was built, i.e. weights, gradients,
optimizer state, master weights, activations and kernel workspace of training alone (a warm-up on a miniature
of the model first pages in kernel code and the runtime's one-time buffers, which are not training memory). glibc is told to serve every
allocation over 64 KiB with mmap (``MALLOC_MMAP_THRESHOLD_``) so freed tensors leave RSS at once and the peak is
the peak of live memory, not of the allocator's cache. The static part (parameters + gradients + AdamW state +
masters, computed from the model) is printed beside it; the rest is activations and temporaries.

Checkpointing keeps each block's input and recomputes the rest in backward: the "+ckpt" rows differ from the rows
without it only in the activations (the static part is the same), at the cost of one more forward of every block.

Target: O2 peak at most 0.75x FP32. Exit status 1 when it is missed.
"""
from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET_O2 = 0.75
CONFIGS = (("FP32", "O1", "float32", None), ("O1", "O1", None, None), ("O2", "O2", None, None),
           ("O1+ckpt", "O1", None, "auto"), ("O2+ckpt", "O2", None, "auto"))


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def child(args: argparse.Namespace) -> dict:
    import torch

    sys.path.insert(0, str(ROOT))
    from ampaudit.train import Trainer

    torch.set_num_threads(args.threads)
    spec = importlib.util.spec_from_file_location("_bench_char", ROOT / "samples" / "char_transformer.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.load_text()
    # Warm-up on a miniature of the same model: pages in the kernels' code and the runtime's one-time buffers
    # (thread pools, oneDNN), which would otherwise count as ~100 MiB of "training memory" in every row.
    mod.BATCH, mod.BLOCK = 2, 16
    # (Two blocks when checkpointing, so the warm-up checkpoints too: "auto" needs a block that repeats.)
    mini = mod.CharTransformer(len(mod.vocabulary()), 16, 2, 2 if args.child_ckpt else 1, 16)
    Trainer(mini, mod.loss_fn, mod.train_data, optimizer=mod.make_optimizer, dtype=args.child_dtype,
            opt_level=args.child_level, clip_norm=1.0, handle_signals=False,
            checkpoint_activations=args.child_ckpt or None).fit(steps=2)
    del mini
    gc.collect()
    mod.BATCH, mod.BLOCK = args.batch, args.block
    before = _status_kib("VmRSS")
    torch.manual_seed(0)
    model = mod.CharTransformer(len(mod.vocabulary()), args.d_model, args.heads, args.layers, args.block)
    n_params = sum(p.numel() for p in model.parameters())
    trainer = Trainer(model, mod.loss_fn, mod.train_data, optimizer=mod.make_optimizer, dtype=args.child_dtype,
                      opt_level=args.child_level, clip_norm=1.0, handle_signals=False,
                      checkpoint_activations=args.child_ckpt or None)
    Path("/proc/self/clear_refs").write_text("5")    # peak RSS := current RSS
    result = trainer.fit(steps=args.steps)
    peak = _status_kib("VmHWM")
    low = 2 if args.child_dtype != "float32" else 4
    # weights + grads (+ fp32 masters and their grads under O2) + AdamW's two fp32 moments
    static = n_params * ((low + low + 4 + 4 + 8) if args.child_level == "O2" else (4 + 4 + 8))
    return {"peak_mib": (peak - before) / 1024, "static_mib": static / 2**20, "params": n_params,
            "loss": result.loss}


def run_child(args: argparse.Namespace, level: str, dtype: str, ckpt: str | None = None) -> dict:
    cmd = [sys.executable, __file__, "--child-level", level, "--child-dtype", dtype, "--child-ckpt", ckpt or ""]
    for flag in ("steps", "d_model", "heads", "layers", "batch", "block", "threads"):
        cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"child {level} {dtype} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--child-level", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-dtype", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-ckpt", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child_level:
        print(json.dumps(child(args)))
        return 0
    rows = {name: run_child(args, level, dtype or args.dtype, ckpt) for name, level, dtype, ckpt in CONFIGS}
    base = rows["FP32"]["peak_mib"]
    print(f"sample transformer: d_model={args.d_model} layers={args.layers} heads={args.heads} batch={args.batch} "
          f"block={args.block} ({rows['FP32']['params'] / 1e6:.2f}M params), low dtype {args.dtype}, "
          f"{args.steps} steps, AdamW, clip 1.0, {args.threads} threads")
    print(f"{'run':<9}{'peak MiB':>10}{'vs FP32':>9}{'static MiB':>12}{'other MiB':>11}")
    for name, row in rows.items():
        print(f"{name:<9}{row['peak_mib']:>10.1f}{row['peak_mib'] / base:>8.2f}x{row['static_mib']:>12.1f}"
              f"{row['peak_mib'] - row['static_mib']:>11.1f}")
    ratio = rows["O2"]["peak_mib"] / base
    print(f"O2 / FP32: {ratio:.2f}x (target <= {TARGET_O2}x) {'PASS' if ratio <= TARGET_O2 else 'MISS'}; "
          f"O1 / FP32: {rows['O1']['peak_mib'] / base:.2f}x")
    for level in ("O1", "O2"):
        with_ckpt, without = rows[f"{level}+ckpt"]["peak_mib"], rows[level]["peak_mib"]
        print(f"activation checkpointing, {level}: {without:.1f} -> {with_ckpt:.1f} MiB ({with_ckpt / without:.2f}x)")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}))
    return 0 if ratio <= TARGET_O2 else 1


if __name__ == "__main__":
    sys.exit(main())
