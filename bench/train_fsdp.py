"""FSDP2 under `ampaudit.Trainer` on 2 gloo ranks: step time against a hand-written fully_shard loop with the same
settings, and peak memory per rank of FSDP against DDP.

    python bench/train_fsdp.py                      # both measurements (launches torchrun itself)
    python bench/train_fsdp.py --only time --rounds 9 --steps 30
    python bench/train_fsdp.py --only memory --width 1024 --depth 8

Time: each rank trains the block model of tests/assets/train_blocks.py (fully_shard per block and the root,
MixedPrecisionPolicy(bf16, reduce fp32), bf16 autocast, clip_grad_norm_ 1.0, AdamW, one all-reduced loss per step)
in alternating rounds, trainer and hand loop; rank 0 reports CPU time per step (min over rounds: the least disturbed
estimate on a shared machine, as bench/train_overhead.py explains) and wall time. Target: at most 1.03x.
Memory: one torchrun each for `--fsdp` and DDP training a wider model; each rank reports its peak resident set
(VmHWM) above what it held before building the model, with glibc told to return large freed blocks. Parameters, gradients and AdamW state dominate, so FSDP
should need about half of DDP's per rank on 2 ranks (plus the gathered blocks).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "assets"))
sys.path.insert(0, str(ROOT / "bench"))        # train_overhead's rounds, train_memory's /proc reader
TARGET = 1.03


def _vm(key: str) -> int:
    from train_memory import _status_kib

    return _status_kib(key) * 1024


def _model(width: int, depth: int):
    import train_blocks

    torch.manual_seed(0)
    return train_blocks.BlockNet(width=width, depth=depth)


def _batches(width_in: int = 16, batch: int = 8):
    g = torch.Generator().manual_seed(5)
    w = torch.randn(width_in, 1, generator=g)
    while True:
        x = torch.randn(batch, width_in, generator=g)
        yield x, torch.sin(x @ w)


def _loss(output, target):
    return ((output.float() - target) ** 2).mean()


def hand_loop(steps: int, width: int, depth: int) -> tuple[float, float]:
    """fully_shard written out by hand. Returns (wall, CPU) seconds per optimizer step."""
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import DTensor

    rank, world = dist.get_rank(), dist.get_world_size()
    model = _model(width, depth)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = _batches()
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        for j in range(world):          # this rank's share of the global window, as the trainer reads it
            batch = next(data)
            if j == rank:
                x, y = batch
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = _loss(model(x), y)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        opt.step()
        opt.zero_grad(set_to_none=True)
        total = loss.detach().float().reshape(1)
        dist.all_reduce(total)
        float(total)
    return (time.perf_counter() - start) / steps, (time.process_time() - cpu) / steps


def trainer_loop(steps: int, width: int, depth: int, fsdp: bool = True) -> tuple[float, float]:
    from ampaudit.train import Trainer

    data = _batches()
    trainer = Trainer(_model(width, depth), _loss, lambda: data, dtype="bfloat16", fsdp=fsdp, clip_norm=1.0,
                      optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3), handle_signals=False, preflight=False)
    start, cpu = time.perf_counter(), time.process_time()
    trainer.fit(steps=steps)
    elapsed = (time.perf_counter() - start) / steps, (time.process_time() - cpu) / steps
    trainer.close()
    return elapsed


def worker_time(args: argparse.Namespace) -> dict:
    import torch.distributed as dist

    from train_overhead import alternate

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rows = alternate({"hand-written": lambda n: hand_loop(n, args.width, args.depth),
                      "trainer": lambda n: trainer_loop(n, args.width, args.depth)}, args.rounds, args.steps)
    dist.destroy_process_group()
    return rows


def worker_memory(args: argparse.Namespace) -> dict:
    """Peak resident set while training, and what stays resident once trained (parameters, gradients freed to
    None, optimizer state), both above the process's footprint before the model was built."""
    from ampaudit.train import Trainer

    torch.set_num_threads(1)
    before = _vm("VmRSS")
    data = _batches()
    trainer = Trainer(_model(args.mem_width, args.mem_depth), _loss, lambda: data, dtype="bfloat16",
                      fsdp=args.mode == "fsdp", clip_norm=1.0, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3),
                      handle_signals=False, preflight=False)
    trainer.fit(steps=args.steps)
    result = {"peak_above_start": _vm("VmHWM") - before, "held_after": _vm("VmRSS") - before}
    trainer.close()
    return result


def _launch(*worker_args: str) -> list[dict]:
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"ampaudit-bench-fsdp-{os.getpid()}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", __file__,
           "--worker", *worker_args, "--out", str(out)]
    # Large blocks from mmap, returned to the OS when freed: otherwise glibc keeps freed heap and the resident
    # set measures fragmentation, growing step after step in both modes.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "MALLOC_MMAP_THRESHOLD_": "131072"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"torchrun failed:\n{done.stderr[-3000:]}")
    results = [json.loads(Path(f"{out}.{r}").read_text()) for r in (0, 1)]
    for r in (0, 1):
        Path(f"{out}.{r}").unlink()
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", choices=["time", "memory"], default=None)
    ap.add_argument("--steps", type=int, default=30, help="optimizer steps per round (memory: steps trained)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--mem-width", type=int, default=1024)
    ap.add_argument("--mem-depth", type=int, default=6)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--worker", choices=["time", "memory"], default=None, help=argparse.SUPPRESS)
    ap.add_argument("--mode", choices=["fsdp", "ddp"], default="fsdp", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        result = worker_time(args) if args.worker == "time" else worker_memory(args)
        Path(f"{args.out}.{os.environ['RANK']}").write_text(json.dumps(result))
        return 0
    report, ok = {}, True
    common = ["--steps", str(args.steps), "--rounds", str(args.rounds), "--width", str(args.width),
              "--depth", str(args.depth), "--mem-width", str(args.mem_width), "--mem-depth", str(args.mem_depth)]
    if args.only in (None, "time"):
        rows = _launch("time", *common)[0]
        hand, mine = rows["hand-written"], rows["trainer"]
        ratio = min(mine["cpu"]) / min(hand["cpu"])
        wall = statistics.median(mine["wall"]) / statistics.median(hand["wall"])
        ok = ratio <= TARGET
        print(f"FSDP 2 ranks, width {args.width} depth {args.depth}, bf16, {args.steps} steps x {args.rounds} "
              f"rounds: ms/step CPU min hand {min(hand['cpu']) * 1e3:.2f} trainer {min(mine['cpu']) * 1e3:.2f} "
              f"ratio {ratio:.3f}x (target <= {TARGET}x) {'PASS' if ok else 'MISS'}; wall median ratio {wall:.3f}x")
        report["time"] = {"rows": rows, "ratio_cpu_min": ratio, "ratio_wall_median": wall}
    if args.only in (None, "memory"):
        runs = {mode: _launch("memory", "--mode", mode, *common) for mode in ("ddp", "fsdp")}
        n = sum(p.numel() for p in _model(args.mem_width, args.mem_depth).parameters())
        report["memory"] = {"parameters": n, **runs}
        for key, what in (("peak_above_start", "peak while training"), ("held_after", "resident once trained")):
            ddp, fsdp = (max(r[key] for r in runs[m]) for m in ("ddp", "fsdp"))
            print(f"{what}, per rank (worst of 2), {n / 1e6:.1f}M parameters, AdamW: DDP {ddp / 2**20:.0f} MiB, "
                  f"FSDP {fsdp / 2**20:.0f} MiB, FSDP / DDP {fsdp / ddp:.2f}x")
            report["memory"][key + "_ratio"] = fsdp / ddp
    if args.json:
        args.json.write_text(json.dumps(report))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
