"""Applying a plan to a model for training: each layer in its recipe (rules/policy/recipes.toml) through torchao,
its float32 layers kept in fp32 under autocast, the rest left to bf16 autocast.

    plan = load_plan("plan.json")                  # version 1 or 2, normalised to version 2
    apply_plan(model, plan, device="cpu")          # in place; returns {"float8": [...], "float32": [...]}
    recipes_of(model), emulation_notes(model)      # ampaudit.precision.convert: every layer's recipe, what is emulated
    apply_plan(model, plan, pad=True)              # also pads misaligned float8 layers; adds "padded": {name: change}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = loss_fn(model(x), y)

A version-2 plan's layer has ``choice`` (a recipe name, ``bfloat16`` or ``float32``) and optionally ``gemms``
(``{"output", "grad_input", "grad_weight"}`` -> a choice) when its GEMMs differ. A version-1 plan (choice
``"float8"`` with a top-level ``recipe``: tensorwise / rowwise) reads as the same version-2 plan
(:func:`normalise_plan`). :mod:`ampaudit.precision.convert` converts each layer (the same parameters and
state_dict keys, so checkpoints load either way): float8 recipes as torchao Float8Linear, emulated on CPU and with
real FP8 kernels on CUDA GPUs of compute capability 8.9 or newer (older GPUs are refused with the reason); MXFP8
with torchao's MX training numerics; NVFP4 emulated (``emulation_notes`` says so).

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
from ampaudit.precision.recipes import normalise_plan

_HINT = "re-run ampaudit plan on this model and pass the new plan"


def load_plan(path: str | Path) -> dict:
    """The plan JSON ``ampaudit plan -o`` wrote, as version 2; a clear InputError when it is missing or not a plan."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise InputError(f"plan file not found: {p}", hint="write one with ampaudit plan model.py -o plan.json")
    except (OSError, json.JSONDecodeError) as exc:
        raise InputError(f"{p} is not a readable plan ({type(exc).__name__})", hint=_HINT) from exc
    try:
        return normalise_plan(data)
    except InputError as exc:
        raise InputError(f"{p} is {exc.message}", hint=_HINT) from None


def _check_device(device: str | torch.device) -> None:
    """Raises on a CUDA GPU without FP8 Tensor Cores."""
    device = torch.device(device)
    if device.type != "cuda":
        return
    from ampaudit.planning.speed import min_float8_capability

    need = min_float8_capability()
    major, minor = torch.cuda.get_device_capability(device)
    if major + minor / 10 < need:
        name = torch.cuda.get_device_name(device)
        raise UsageError(f"{name} (compute capability {major}.{minor}) has no FP8 Tensor Cores; float8 training "
                         f"needs {need:g} or newer (L4, L40, H100, H200, B200)",
                         hint="train the plan's float8 layers in bf16: drop --plan, or use --dtype bfloat16")


def _layer_choice(layer: dict, modules: dict, pad: bool, device, default: str) -> tuple[str, dict | None]:
    from ampaudit.precision.recipes import choices

    name, choice = layer.get("module"), layer.get("choice")
    if choice not in choices():
        raise InputError(f"plan layer {name!r} has choice {choice!r}", hint=_HINT)
    mod = modules.get(name)
    if not isinstance(mod, nn.Linear):
        raise InputError(f"the plan names {name!r}, which this model has no Linear for", hint=_HINT)
    shape = layer.get("shape") or {}
    if (shape.get("in_features"), shape.get("out_features")) != (mod.in_features, mod.out_features):
        raise InputError(f"plan layer {name!r} is {shape.get('in_features')}->{shape.get('out_features')}, "
                         f"the model's is {mod.in_features}->{mod.out_features}", hint=_HINT)
    if pad and choice == "bfloat16" and layer.get("float8_if_padded"):
        return default, dict(layer["float8_if_padded"])     # alignment was its only reason to stay out
    if layer.get("padded") and choice.startswith("float8"):
        if pad:
            return choice, dict(layer["padded"])
        if torch.device(device).type == "cuda":
            # Planned with --pad: torch._scaled_mm refuses the unpadded dims, so the layer must be padded first.
            raise UsageError(f"plan layer {name!r} is float8 only once padded to {layer['padded']}",
                             hint="ampaudit train --pad (apply_plan(..., pad=True)) pads it, or re-plan without --pad")
    return choice, None


def apply_plan(model: nn.Module, plan: dict, *, device: str | torch.device = "cpu", pad: bool = False) -> dict:
    """Convert ``model`` in place as ``plan`` (version 1 or 2) says; returns the float8-family and float32 layers
    and, with ``pad``, ``"padded"``: module -> ``PadChange``."""
    from ampaudit.precision.convert import set_recipe
    from ampaudit.precision.recipes import recipe

    plan = normalise_plan(plan)
    modules = dict(model.named_modules())
    default = plan.get("recipe", "float8_tensorwise")
    picked: dict[str, tuple[str, dict | None]] = {}
    to_pad: dict[str, dict[str, int]] = {}
    for layer in plan["layers"]:
        choice, dims = _layer_choice(layer, modules, pad, device, default)
        picked[layer["module"]] = (choice, layer.get("gemms") if isinstance(layer.get("gemms"), dict) else None)
        if dims is not None:
            to_pad[layer["module"]] = dims
    families = {name: recipe(c).family for name, (c, _) in picked.items() if c not in ("bfloat16", "float32")}
    if "float8" in families.values():
        _check_device(device)
    for name, (choice, gemms) in picked.items():
        set_recipe(modules[name], choice, gemms, name=name, device=device)
    chosen: dict = {"float8": [n for n, f in families.items() if f == "float8"],
                    "float32": [n for n, (c, _) in picked.items() if c == "float32"]}
    if pad:
        from ampaudit.rewrite.pad import pad_linear

        chosen["padded"] = {name: pad_linear(modules[name], dims, name=name) for name, dims in to_pad.items()}
    return chosen
