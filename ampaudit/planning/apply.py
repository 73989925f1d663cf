"""Applying a plan to a model for training: its float8 layers converted with torchao, its float32 layers kept in
fp32 under autocast, the rest left to bf16 autocast.

    plan = load_plan("plan.json")                  # or ampaudit.plan(...).to_dict()
    apply_plan(model, plan, device="cpu")          # in place; returns {"float8": [...], "float32": [...]}
    apply_plan(model, plan, pad=True)              # also pads misaligned float8 layers; adds "padded": {name: change}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = loss_fn(model(x), y)

torchao's ``convert_to_float8_training`` swaps each chosen nn.Linear for a Float8Linear (same parameters and
state_dict keys, so checkpoints load either way), emulated on CPU and with real FP8 kernels on CUDA GPUs of compute
capability 8.9 or newer; older GPUs are refused with the reason.

``pad=True`` (``train --pad``): the layers a ``plan --pad`` plan marks ``padded``, and those a plan without it kept
in bf16 for alignment alone (``float8_if_padded``), are padded with zero rows and columns after the conversion
(``rewrite.pad.pad_linear``: the same outputs, the unpadded shapes in ``state_dict()``) and train in float8.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from ampaudit.errors import InputError, UsageError

_HINT = "re-run ampaudit plan on this model and pass the new plan"


def load_plan(path: str | Path) -> dict:
    """The plan JSON ``ampaudit plan -o`` wrote; a clear InputError when it is missing or not a plan."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise InputError(f"plan file not found: {p}", hint="write one with ampaudit plan model.py -o plan.json")
    except (OSError, json.JSONDecodeError) as exc:
        raise InputError(f"{p} is not a readable plan ({type(exc).__name__})", hint=_HINT) from exc
    if not isinstance(data, dict) or data.get("version") not in (1, 2) or not isinstance(data.get("layers"), list):
        raise InputError(f"{p} is not an ampaudit plan (version 1 or 2)", hint=_HINT)
    return data


def _check_device(device: str | torch.device) -> bool:
    """True to emulate FP8 (CPU); raises on a CUDA GPU without FP8 Tensor Cores."""
    device = torch.device(device)
    if device.type != "cuda":
        return True
    from ampaudit.planning.speed import min_float8_capability

    need = min_float8_capability()
    major, minor = torch.cuda.get_device_capability(device)
    if major + minor / 10 < need:
        name = torch.cuda.get_device_name(device)
        raise UsageError(f"{name} (compute capability {major}.{minor}) has no FP8 Tensor Cores; float8 training "
                         f"needs {need:g} or newer (L4, L40, H100, H200, B200)",
                         hint="train the plan's float8 layers in bf16: drop --plan, or use --dtype bfloat16")
    return False


def apply_plan(model: nn.Module, plan: dict, *, device: str | torch.device = "cpu", pad: bool = False) -> dict:
    """Convert ``model`` in place as ``plan`` says; returns the modules per choice that changed (with ``pad``,
    also ``"padded"``: module -> ``PadChange``)."""
    from ampaudit.planning.fp8 import config, import_torchao
    from ampaudit.rewrite.keep_fp32 import keep_fp32

    modules = dict(model.named_modules())
    chosen: dict = {"float8": [], "float32": []}
    to_pad: dict[str, dict[str, int]] = {}
    for layer in plan["layers"]:
        name, choice = layer.get("module"), layer.get("choice")
        if choice not in ("float8", "bfloat16", "float32"):
            raise InputError(f"plan layer {name!r} has choice {choice!r}", hint=_HINT)
        mod = modules.get(name)
        if not isinstance(mod, nn.Linear):
            raise InputError(f"the plan names {name!r}, which this model has no Linear for", hint=_HINT)
        shape = layer.get("shape") or {}
        if (shape.get("in_features"), shape.get("out_features")) != (mod.in_features, mod.out_features):
            raise InputError(f"plan layer {name!r} is {shape.get('in_features')}->{shape.get('out_features')}, "
                             f"the model's is {mod.in_features}->{mod.out_features}", hint=_HINT)
        if pad and choice == "bfloat16" and layer.get("float8_if_padded"):
            choice = "float8"          # alignment was its only reason to stay out
            to_pad[name] = dict(layer["float8_if_padded"])
        elif pad and choice == "float8" and layer.get("padded"):
            to_pad[name] = dict(layer["padded"])
        elif choice == "float8" and layer.get("padded") and torch.device(device).type == "cuda":
            # Planned with --pad: torch._scaled_mm refuses the unpadded dims, so the layer must be padded first.
            raise UsageError(f"plan layer {name!r} is float8 only once padded to {layer['padded']}",
                             hint="ampaudit train --pad (apply_plan(..., pad=True)) pads it, or re-plan without --pad")
        if choice in chosen:
            chosen[choice].append(name)
    if chosen["float8"]:
        emulate = _check_device(device)
        wanted = set(chosen["float8"])
        import_torchao().convert_to_float8_training(
            model, config=config(plan.get("recipe", "tensorwise"), emulate=emulate),
            module_filter_fn=lambda mod, fqn: fqn in wanted)
    if chosen["float32"]:
        keep_fp32(model, chosen["float32"])
    if pad:
        from ampaudit.rewrite.pad import pad_linear

        # After the conversion: torchao builds a new module per Linear, which would drop the padding hooks.
        after = dict(model.named_modules())
        chosen["padded"] = {name: pad_linear(after[name], dims, name=name) for name, dims in to_pad.items()}
    return chosen
