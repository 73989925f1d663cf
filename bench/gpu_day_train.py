"""bench/gpu_day.py's training parts: the trainer's speed and memory against a hand-written loop, and watch's
cost, on the sample transformer scaled up to fill a GPU step.

    trainer_speed(record, part_budget, dev, cfg)   # FP32, fp16 O1, bf16 O1, bf16 O2: tokens/s and peak memory
    watch_cost(record, part_budget, dev, cfg)      # watch(statistics), watch(divergence every 50) vs no hooks

The rounds alternate (bench/train_overhead.py's ``alternate``; bench/watch_overhead.py's ``Loop`` in turns), so
clock or thermal drift falls on every loop alike. Wall time, after the device's queue is drained, is what a GPU
step costs.
"""
from __future__ import annotations

import contextlib
import gc
import itertools
import statistics
import time
from types import SimpleNamespace
from typing import Callable, Iterator

import torch

from gpu_day_device import Device
from gpu_day_record import PartBudget, Record
from train_overhead import alternate, load_model_file
from watch_overhead import Loop

# The sample transformer scaled to fill a GPU step: 151.8M parameters and 8192 tokens a step, so 6 * params *
# tokens = 7.5 TFLOP (attention besides), 7.5 ms at the H200's dense bf16 peak in rules/policy/gpus.toml and a
# few times that at a realistic efficiency; each figure's note gives the step time measured. ``tiny`` runs the
# same code in seconds on a CPU.
SHAPES = {"gpu": dict(d_model=1024, n_head=16, n_layer=12, block=512, batch=16),
          "tiny": dict(d_model=32, n_head=2, n_layer=1, block=16, batch=4)}
VOCAB = 64                 # the sonnets' 58 characters, padded to the Tensor Core grid
# name -> (dtype, opt level, TF32 GEMMs). FP32 is the baseline as torch ships it (TF32 off for matmuls);
# "fp32 tf32" last, the FP32 many recipes turn on (torch.backends.cuda.matmul.allow_tf32 = True).
CONFIGS = {"fp32": (torch.float32, "O1", False), "fp16 O1": (torch.float16, "O1", False),
           "bf16 O1": (torch.bfloat16, "O1", False), "bf16 O2": (torch.bfloat16, "O2", False),
           "fp32 tf32": (torch.float32, "O1", True)}


def workload(shape: dict, seed: int = 0) -> SimpleNamespace:
    """samples/char_transformer.py's model, loss and optimizer at ``shape``, with its text cut to that block."""
    ct = load_model_file("transformer")
    text = ct.encode(ct.load_text())

    def build_model():
        torch.manual_seed(seed)
        return ct.CharTransformer(VOCAB, d_model=shape["d_model"], n_head=shape["n_head"],
                                  n_layer=shape["n_layer"], block=shape["block"])

    def train_data():
        g = torch.Generator().manual_seed(seed + 2)
        offsets = torch.arange(shape["block"])
        while True:
            window = torch.randint(0, len(text) - shape["block"] - 1, (shape["batch"], 1), generator=g) + offsets
            yield text[window], text[window + 1]

    return SimpleNamespace(build_model=build_model, train_data=train_data, loss_fn=ct.loss_fn,
                           make_optimizer=ct.make_optimizer, tokens=shape["batch"] * shape["block"])


def hand_loop(wl: SimpleNamespace, dev: Device, dtype: torch.dtype, opt_level: str, steps: int,
              clip: float = 1.0) -> tuple[float, float]:
    """The canonical AMP loop written out (bench/train_overhead.py's order); O2 keeps FP32 master weights
    beside the low-precision model, as apex did. (wall, CPU) seconds per step."""
    with torch.device(dev.type):          # initialised where it trains: a 152M-parameter init on CPU takes seconds
        model = dev.put(wl.build_model())
    params = list(model.parameters())
    masters = None
    if opt_level == "O2":
        model.to(dtype)
        masters = [p.detach().float().clone().requires_grad_(True) for p in params]
    opt = wl.make_optimizer(masters or params)
    scaler = torch.amp.GradScaler(dev.type, enabled=dtype == torch.float16)
    data, now = wl.train_data(), dev.timer()
    start, cpu = now(), time.process_time()
    for _ in range(steps):
        x, y = dev.put(next(data))
        # The device's own autocast, as the trainer's (the simulated device's CUDA policy is for dtypes, not speed).
        with torch.autocast(dev.type, dtype=dtype, enabled=opt_level == "O1" and dtype != torch.float32):
            loss = wl.loss_fn(model(x), y)
        scaler.scale(loss).backward()
        if masters is not None:
            for p, m in zip(params, masters):
                m.grad, p.grad = p.grad.float(), None
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(masters or params, clip, foreach=True)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        if masters is not None:
            with torch.no_grad():
                torch._foreach_copy_(params, masters)
        float(loss.detach())
    return (now() - start) / steps, (time.process_time() - cpu) / steps


def trainer_loop(wl: SimpleNamespace, dev: Device, dtype: torch.dtype, opt_level: str, steps: int,
                 clip: float = 1.0) -> tuple[float, float]:
    from ampaudit.train import Trainer

    with torch.device(dev.type):
        model = wl.build_model()
    trainer = Trainer(model, wl.loss_fn, wl.train_data, optimizer=wl.make_optimizer, dtype=dtype,
                      opt_level=opt_level, clip_norm=clip, device=dev.type, handle_signals=False)
    now = dev.timer()
    start, cpu = now(), time.process_time()
    trainer.fit(steps=steps)
    return (now() - start) / steps, (time.process_time() - cpu) / steps


def with_peak(dev: Device, fn: Callable[[int], tuple], peaks: list) -> Callable[[int], tuple]:
    """``fn`` that also appends the device's peak memory of each call to ``peaks``."""
    def run(steps: int) -> tuple:
        gc.collect()                  # the last round's model is garbage, not memory this round needs
        dev.reset_peak()
        out = fn(steps)
        peaks.append(dev.peak_bytes())
        return out
    return run


def measure_config(wl, dev: Device, dtype: torch.dtype, opt_level: str, cfg: dict) -> dict[str, dict]:
    """Per loop ("hand-written", "trainer"): median wall seconds per step and the largest peak memory."""
    peaks: dict[str, list] = {"hand-written": [], "trainer": []}
    loops = {"hand-written": with_peak(dev, lambda n: hand_loop(wl, dev, dtype, opt_level, n), peaks["hand-written"]),
             "trainer": with_peak(dev, lambda n: trainer_loop(wl, dev, dtype, opt_level, n), peaks["trainer"])}
    rows = alternate(loops, cfg.get("rounds", 3), cfg.get("steps", 10))
    return {name: {"step_s": statistics.median(rows[name]["wall"]),
                   "peak_bytes": max((p for p in peaks[name] if p is not None), default=None)} for name in rows}


@contextlib.contextmanager
def tf32_matmuls(on: bool) -> Iterator[None]:
    """TF32 for CUDA matmuls and convolutions while inside (``on``), as before afterwards."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    if on:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def trainer_speed(record: Record, part: PartBudget, dev: Device, cfg: dict) -> str:
    """tokens/s and peak memory of each config under the trainer and the hand-written loop, FP32 the baseline."""
    wl = workload(SHAPES[cfg.get("shape", "gpu")])
    base: dict[str, dict] = {}
    for name, (dtype, level, tf32) in CONFIGS.items():
        if name not in cfg.get("configs", CONFIGS):
            continue
        if part.expired():
            return "stopped: budget"
        with tf32_matmuls(tf32):
            got = measure_config(wl, dev, dtype, level, cfg)
        base = base or got
        for loop, m in got.items():
            tps = wl.tokens / m["step_s"]
            record.figure("trainer", f"{loop} {name} tokens/s", tps, unit="tokens/s",
                          baseline=(f"{loop} fp32 tokens/s", wl.tokens / base[loop]["step_s"]),
                          note=f"step {m['step_s'] * 1e3:.1f} ms"
                          + ("" if dtype == torch.float32 else "; claim: AMP 1.5-3x"))
            if m["peak_bytes"] is not None:
                record.figure("trainer", f"{loop} {name} peak memory", m["peak_bytes"] / 2**20, unit="MiB",
                              baseline=(f"{loop} fp32 peak memory", (base[loop]["peak_bytes"] or 0) / 2**20),
                              note="" if dtype == torch.float32 else "claim: 30-50% less than FP32")
        record.figure("trainer", f"trainer / hand-written {name} step time", got["trainer"]["step_s"],
                      unit="s", baseline=("hand-written step time", got["hand-written"]["step_s"]),
                      note="target <= 1.03x")
    return "done"


WATCH_CONFIGS = {"none": None, "stats": {"every": 50}, "divergence": {"stats": False, "divergence_every": 50},
                 "both": {"every": 50, "divergence_every": 50}}


def watch_cost(record: Record, part: PartBudget, dev: Device, cfg: dict) -> str:
    """watch's cost per step at GPU step times, each watch against the same loop with no hooks (bf16)."""
    wl = workload(SHAPES[cfg.get("shape", "gpu")])
    steps, warmup, chunk = cfg.get("steps", 100), cfg.get("warmup", 5), cfg.get("chunk", 10)
    data = [((dev.put(x),), dev.put(y)) for x, y in itertools.islice(wl.train_data(), warmup + steps)]
    with torch.device(dev.type):
        model = wl.build_model()
    loops = [Loop(name, _copy(model), wl.make_optimizer, wl.loss_fn, torch.bfloat16, kw, device_type=dev.type,
                  sync=dev.sync) for name, kw in WATCH_CONFIGS.items()]
    status = "done"
    try:
        for loop in loops:
            loop.run(data[:warmup], timed=False)
        for start in range(warmup, warmup + steps, chunk):
            if part.expired():
                status = "stopped: budget"
                break
            for loop in loops:
                loop.run(data[start:start + chunk], timed=True)
    finally:
        for loop in loops:
            loop.close()
    per_step = {loop.name: loop.wall / max(1, loop.timed_steps) for loop in loops}
    for name in WATCH_CONFIGS:
        if name != "none" and loops[0].timed_steps:
            limit = {"stats": "target <= 1.10x", "divergence": "target <= 1.05x"}.get(name, "")
            record.figure("watch", f"watch {name} step time", per_step[name], unit="s",
                          baseline=("no hooks step time", per_step["none"]),
                          note=f"{loops[0].timed_steps} timed steps; {limit}".rstrip("; "))
    return status


def _copy(model: torch.nn.Module) -> torch.nn.Module:
    import copy

    return copy.deepcopy(model)
