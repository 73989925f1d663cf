"""bench/gpu_day.py's float8 part: torchao's Float8Linear against bf16, per Linear shape, and what
ampaudit/planning/speed.py's roofline predicted for the same GPU.

    fp8_speed(record, part_budget, dev, cfg)
    linear_shapes("llama3-8b")        # [(layer name, K in_features, N out_features), ...] and its token count M
    gpu_key("NVIDIA H200")            # "h200": the rules/policy/gpus.toml entry the prediction is read from

Each shape is timed as one training step of the Linear alone (forward, backward of a fixed gradient) in bf16
and after ``convert_to_float8_training`` with the recipe (tensorwise, rowwise), eager and then compiled
(torchao's speed-ups are compiled ones; the roofline assumes its casts fused). A shape torchao cannot run
(``torch._scaled_mm`` needs dims in multiples of 16: the sample's 58-wide head) is recorded as an error.
"""
from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from gpu_day_device import Device
from gpu_day_record import PartBudget, Record

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ("tensorwise", "rowwise")
# Llama-3-8B (hidden 4096, 32 heads over 8 key/value heads, SwiGLU 14336, vocabulary 128256), one layer of it
# built on the meta device by bench/llama_meta.py; 8192 tokens a step (one sequence of its 8192 context).
LLAMA3_8B = dict(layers=1, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256)
TOKENS = {"llama3-8b": 8192}


def gpu_key(device_name: str) -> str | None:
    """The rules/policy/gpus.toml name of a torch device name ("NVIDIA H100 80GB HBM3" -> "h100"), or None."""
    from ampaudit.planning.speed import load_gpus

    low = device_name.lower().replace(" ", "")
    return next((key for key in load_gpus() if key in low), None)


def linear_shapes(model: str) -> tuple[int, list[tuple[str, int, int]]]:
    """(tokens M a step, distinct (first layer name, K, N) of the model's nn.Linears)."""
    if model == "sample":
        sys.path.insert(0, str(ROOT / "bench"))
        from train_overhead import load_model_file

        ct = load_model_file("transformer")
        net, tokens = ct.build_model(), ct.BATCH * ct.BLOCK
    else:
        from llama_meta import build_llama

        net, tokens = build_llama(**LLAMA3_8B, device="meta"), TOKENS[model]
    seen: dict[tuple[int, int], str] = {}
    for name, m in net.named_modules():
        if isinstance(m, nn.Linear):
            seen.setdefault((m.in_features, m.out_features), name)
    return tokens, [(name, k, n) for (k, n), name in seen.items()]


def step_seconds(module: nn.Module, x: torch.Tensor, grad: torch.Tensor, dev: Device, iters: int) -> float:
    """Wall seconds of one forward + backward of ``module`` on ``x`` (three warm-up steps first)."""
    def once():
        module(x).backward(grad)
        x.grad = None                      # a fresh gradient each step, as after zero_grad(set_to_none=True)
        module.zero_grad(set_to_none=True)
    for _ in range(3):
        once()
    now = dev.timer()
    start = now()
    for _ in range(iters):
        once()
    return (now() - start) / iters


def variants(k: int, n: int, dev: Device, compiled: bool) -> dict[str, Callable[[], nn.Module]]:
    """bf16 and each float8 recipe of one Linear(k, n) (same weights), emulated where there is no GPU."""
    from ampaudit.precision.fp8 import config, import_torchao

    torch.manual_seed(0)
    with torch.device(dev.type):          # Llama's 4096 x 128256 head: seconds to initialise on a CPU
        base = nn.Sequential(nn.Linear(k, n, bias=False)).to(torch.bfloat16)

    def fp8(recipe):
        def build():
            return import_torchao().convert_to_float8_training(copy.deepcopy(base),
                                                     config=config(recipe, emulate=dev.type != "cuda"))
        return build
    out = {"bf16": lambda: copy.deepcopy(base), **{r: fp8(r) for r in RECIPES}}
    return {name: (lambda b=b: torch.compile(b())) if compiled else b for name, b in out.items()}


def fp8_speed(record: Record, part: PartBudget, dev: Device, cfg: dict) -> str:
    """Measured fp8 / bf16 speed-up per shape and recipe, against the roofline's prediction."""
    from ampaudit.planning.speed import linear_times, supports_float8

    gpu = cfg.get("gpu") or gpu_key(dev.name)
    if gpu is not None and not supports_float8(gpu):
        gpu = None                        # no fp8 Tensor Cores there: nothing to predict
    rows: list[dict] = []
    failed: set[tuple] = set()            # (model, layer, variant) that raised eagerly: not compiled again
    for mode in cfg.get("modes", ("eager", "compiled")):
        for model in cfg.get("models", ("llama3-8b", "sample")):
            tokens, shapes = linear_shapes(model)
            m = cfg.get("tokens", tokens)
            for layer, k, n in shapes[: cfg.get("max_shapes")]:
                if part.expired():
                    return "stopped: budget"
                if mode == "compiled":
                    # Every Float8Linear (and Sequential) shares one forward code object: without a reset, the
                    # shapes after dynamo's recompile limit would run eager and be reported as compiled.
                    torch._dynamo.reset()
                x = torch.randn(m, k, device=dev.type, dtype=torch.bfloat16, requires_grad=True)
                grad = torch.randn(m, n, device=dev.type, dtype=torch.bfloat16)
                times: dict[str, float | str] = {}
                for name, build in variants(k, n, dev, mode == "compiled").items():
                    if (model, layer, name) in failed:
                        times[name] = "error eagerly: not compiled"
                        continue
                    try:
                        times[name] = step_seconds(build(), x, grad, dev, cfg.get("iters", 20))
                    except Exception as exc:      # misaligned dims, a kernel torchao lacks for this GPU
                        times[name] = f"error: {type(exc).__name__}: {str(exc)[:60]}"
                        failed.add((model, layer, name))
                for recipe in RECIPES:
                    label = f"{model} {layer} M,K,N={m},{k},{n} {recipe} {mode}"
                    pred = linear_times(m, k, n, gpu, recipe=recipe)["speedup"] if gpu else "no gpus.toml entry"
                    fp8, bf16 = times[recipe], times["bf16"]
                    if isinstance(fp8, float) and isinstance(bf16, float):
                        record.figure("fp8", f"{label} speed-up", bf16 / fp8, unit="x",
                                      baseline=(f"roofline prediction ({gpu})", pred),
                                      note=f"bf16 {bf16 * 1e3:.3f} ms, fp8 {fp8 * 1e3:.3f} ms")
                    rows.append({"shape": label, "bf16 s": bf16, "fp8 s": fp8, "predicted speed-up": pred})
                record.table("fp8", "per shape", rows)
    return "done"
