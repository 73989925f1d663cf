"""Training a Linear in any recipe of rules/policy/recipes.toml through torchao, and switching it to another one
in place (the same module object and Parameters, so the optimizer, hooks and checkpoints stay valid).

    set_recipe(model.fc1, "float8_rowwise")                         # torchao Float8Linear, rowwise casts
    set_recipe(model.fc1, "float8_tensorwise", {"grad_weight": "bfloat16"})   # one GEMM kept high precision
    set_recipe(model.fc2, "mxfp8")          # torchao's MX training numerics (emulated on CPU)
    set_recipe(model.fc2, "nvfp4")          # emulated through torchao's NVFP4Tensor where its config refuses
    set_recipe(model.fc2, "blockwise")      # DeepSeek-V3's 1x128 / 128x128 FP8, emulated with torchao's quantizers
    set_recipe(model.fc2, "bfloat16")       # a plain nn.Linear again (the run's bf16 autocast computes it)
    recipe_of(model.fc1)                    # {"choice": "float8_tensorwise", "gemms": {"grad_weight": "bfloat16"}}
    recipes_of(model)                       # {name: recipe_of(module)} of every converted Linear
    emulation_notes(model)                  # one line per recipe emulated here instead of torchao's own config

Per family (recipes.toml ``family``):

- ``float8``: torchao's ``Float8LinearConfig.from_recipe_name`` (tensorwise, rowwise, rowwise_with_gw_hp); a GEMM a
  layer's ``gemms`` keeps in bf16/fp32 has its two operand casts disabled, as torchao's own rowwise_with_gw_hp does
  for grad_weight. Emulated off CUDA.
- ``mx`` / mxfp8: torchao's ``MXFP8TrainingOpConfig`` numerics: ``_to_mxfp8_then_scaled_mm`` (1x32 blocks, e8m0
  RCEIL scales; ``KernelPreference.EMULATED`` off CUDA), its ``wgrad_with_hp`` for a grad_weight kept high. The
  config's weight wrapper drops a Linear's bias in torchao 0.18, so the bias is added here.
- ``mx`` / nvfp4: torchao's ``NVFP4TrainingConfig`` runs only its Triton kernels (Blackwell, M, K, N multiples of
  128); this computes each of the three GEMMs from operands quantized by ``NVFP4Tensor.to_nvfp4`` (1x16 blocks,
  e4m3 scales, an fp32 tensor scale) along that GEMM's reduction dim, round to nearest (no Hadamard transform, no
  stochastic rounding), then dequantized: the numerics of NVFP4's format, not of torchao's training recipe.
- ``blockwise``: torchao's Float8BlockwiseLinear needs Triton on an SM90 GPU, has no emulated mode and refuses a
  bias (its quantizers, the reference ones too, import Triton); :mod:`ampaudit.precision.blockwise_emulated`
  computes its GEMMs with torchao.float8's dynamic e4m3 cast per 1x128 activation tile and 128x128 weight block,
  dequantized (dims and tokens multiples of 128), everywhere.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from ampaudit.errors import TrainError, UsageError
from ampaudit.precision.recipes import HIGH_PRECISION, choices, recipe

__all__ = ["GEMMS", "set_recipe", "recipe_of", "recipes_of", "emulation_notes", "RecipeLinear"]

GEMMS = ("output", "grad_input", "grad_weight")
# Which operand casts of torchao's Float8LinearConfig feed each GEMM.
_FLOAT8_CASTS = {"output": ("cast_config_input", "cast_config_weight"),
                 "grad_input": ("cast_config_grad_output", "cast_config_weight_for_grad_input"),
                 "grad_weight": ("cast_config_input_for_grad_weight", "cast_config_grad_output_for_grad_weight")}
_NVFP4_NOTE = ("nvfp4: torchao's NVFP4TrainingConfig runs only on its Triton kernels (Blackwell GPUs); emulated here "
               "through torchao's NVFP4Tensor (round to nearest, no Hadamard transform or stochastic rounding)")
_BLOCKWISE_NOTE = ("blockwise: torchao's Float8BlockwiseLinear runs only on its Triton kernels (SM90 GPUs); "
                   "emulated here with torchao.float8's e4m3 cast per 1x128 activation tile and 128x128 weight "
                   "block, dequantized")
_ATTR = "ampaudit_recipe"
_BASE = "_ampaudit_base_class"


def _gemms(choice: str, gemms: dict | None) -> dict[str, str]:
    """The choice of each of the three GEMMs (``gemms`` overrides ``choice``); UsageError on a bad entry."""
    out = {g: choice for g in GEMMS}
    for key, value in (gemms or {}).items():
        if key not in GEMMS:
            raise UsageError(f"unknown GEMM {key!r} in a plan layer's gemms", hint=f"use {', '.join(GEMMS)}")
        if value not in choices():
            raise UsageError(f"GEMM {key} has choice {value!r}", hint=f"choose from {', '.join(choices())}")
        out[key] = value
    low = {v for v in out.values() if v not in HIGH_PRECISION}
    if len(low) > 1:
        raise UsageError(f"one layer's GEMMs mix recipes {', '.join(sorted(low))}",
                         hint="keep one low-precision recipe per layer; the other GEMMs bfloat16")
    if low and "float32" in out.values():
        # torchao runs a GEMM it does not cast in its operands' dtype: bf16 under bf16 autocast.
        raise UsageError("a low-precision layer's GEMM cannot be kept in float32 alone",
                         hint="keep it in bfloat16, or the whole layer in float32")
    kept = [g for g, v in out.items() if v in HIGH_PRECISION]
    if "mxfp8" in low and kept not in ([], ["grad_weight"]):
        raise UsageError(f"mxfp8 keeps only grad_weight in high precision (torchao's wgrad_with_hp), not "
                         f"{', '.join(g for g in kept if g != 'grad_weight')}",
                         hint="keep the layer in a float8 recipe, which can keep any GEMM in bfloat16")
    return out


def _float8_config(name: str, per_gemm: dict[str, str], emulate: bool):
    from torchao.float8.config import CastConfig, ScalingType

    from ampaudit.precision.fp8 import import_torchao

    cfg = import_torchao().Float8LinearConfig.from_recipe_name(recipe(name).torchao)
    changes: dict[str, Any] = {"emulate": emulate}
    for gemm, casts in _FLOAT8_CASTS.items():
        if per_gemm[gemm] in HIGH_PRECISION:
            for field in casts:
                # torchao requires an operand's casts to agree in dtype (e.g. grad_output's e5m2), disabled or not.
                base = getattr(cfg, field) or getattr(cfg, field.split("_for_")[0])
                changes[field] = CastConfig(scaling_type=ScalingType.DISABLED, target_dtype=base.target_dtype)
    return dataclasses.replace(cfg, **changes)


_FLOAT8_CLASS: list[type] = []


def float8_class() -> type:
    """torchao's Float8Linear, reading CPU autocast as torchao reads CUDA's (its forward casts the input to the
    autocast dtype only under CUDA autocast; on CPU a bf16 grad_output then meets an fp32 input in a GEMM kept high
    precision). Same name, same attributes: everything that knows torchao's class knows this one."""
    if not _FLOAT8_CLASS:
        from torchao.float8.float8_linear import Float8Linear as TorchaoFloat8Linear

        class Float8Linear(TorchaoFloat8Linear):
            casts_cpu_autocast = True     # read by ampaudit.runtime.fp8_stats, which measures what is cast

            def forward(self, input: torch.Tensor) -> torch.Tensor:
                if torch.is_autocast_enabled("cpu") and not torch.is_autocast_enabled("cuda"):
                    input = input.to(torch.get_autocast_dtype("cpu"))
                return super().forward(input)

        _FLOAT8_CLASS.append(Float8Linear)
    return _FLOAT8_CLASS[0]


def _to_float8(mod: nn.Linear, name: str, per_gemm: dict[str, str], emulate: bool) -> None:
    cfg = _float8_config(name, per_gemm, emulate)
    # torchao's own constructor sets the attributes its forward reads; built on meta, copied onto this module.
    with torch.device("meta"):
        template = float8_class()(mod.in_features, mod.out_features, bias=False, config=cfg)
    for key in ("scaling_type_input", "scaling_type_weight", "scaling_type_grad_output", "config",
                "linear_mm_config"):
        setattr(mod, key, getattr(template, key))
    mod.__class__ = float8_class()


def _check_blocks(mod: nn.Linear, name: str) -> None:
    block = recipe(name).block
    bad = [f"{k} {v}" for k, v in (("in_features", mod.in_features), ("out_features", mod.out_features))
           if v % block]
    if bad:
        raise UsageError(f"{name} needs both weight dims in multiples of its {block}-element blocks; this layer has "
                         f"{', '.join(bad)}", hint="keep the layer in bfloat16 (re-plan), or pad it")


class RecipeLinear(nn.Linear):
    """An nn.Linear whose GEMMs run in mxfp8, nvfp4 or blockwise; see the module docstring.
    Made by :func:`set_recipe` from a Linear in place (no parameter or buffer is added)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        state = getattr(self, _ATTR)
        tokens = x.numel() // max(1, x.shape[-1])
        block = recipe(state["choice"]).block
        if tokens % block:
            raise TrainError(f"{state['choice']} layer got {tokens} tokens per micro-batch; its weight-gradient "
                             f"GEMM reduces over tokens in {block}-element blocks",
                             hint=f"use a micro-batch whose batch x sequence is a multiple of {block}")
        wgrad_hp = state["gemms"].get("grad_weight") in HIGH_PRECISION
        if state["choice"] == "mxfp8":
            out = _mxfp8(x, self.weight, wgrad_hp)
        elif state["choice"] == "nvfp4":
            from ampaudit.precision.nvfp4_emulated import nvfp4_linear

            out = nvfp4_linear(x, self.weight, state["gemms"])
        else:
            from ampaudit.precision.blockwise_emulated import blockwise_linear

            out = blockwise_linear(x, self.weight, state["gemms"])
        return out if self.bias is None else out + self.bias.to(out.dtype)


def _mxfp8(x: torch.Tensor, weight: torch.Tensor, wgrad_hp: bool) -> torch.Tensor:
    from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig
    from torchao.prototype.moe_training.mxfp8_linear import _to_mxfp8_then_scaled_mm
    from torchao.quantization.quantize_.common import KernelPreference

    native = weight.device.type == "cuda" and _capability(weight.device) >= recipe("mxfp8").min_compute_capability
    pref = KernelPreference.AUTO if native else KernelPreference.EMULATED
    cfg = MXFP8TrainingOpConfig(kernel_preference=pref, wgrad_with_hp=wgrad_hp)
    # What MXFP8TrainingWeightWrapperTensor's linear override calls with the config's fields.
    return _to_mxfp8_then_scaled_mm(x, weight, kernel_preference=cfg.kernel_preference,
                                    scale_calculation_mode=cfg.scale_calculation_mode,
                                    wgrad_with_hp=cfg.wgrad_with_hp)


def _capability(device: torch.device) -> float:
    major, minor = torch.cuda.get_device_capability(device)
    return major + minor / 10


def set_recipe(mod: nn.Linear, choice: str, gemms: dict | None = None, *, name: str = "",
               device: str | torch.device | None = None) -> None:
    """Make ``mod`` (an nn.Linear, possibly converted before) train in ``choice`` with per-GEMM ``gemms``, in
    place. ``bfloat16`` makes it a plain Linear (computed by the run's autocast); ``float32`` keeps it in fp32.
    ``device``: where it will train (default: where its weight is); float8 GEMMs are emulated off CUDA."""
    if not isinstance(mod, nn.Linear):
        raise UsageError(f"{name or type(mod).__name__} is not an nn.Linear", hint="plans choose Linear layers only")
    emulate = torch.device(device if device is not None else mod.weight.device).type != "cuda"
    per_gemm = _gemms(choice, gemms)
    low = [v for v in per_gemm.values() if v not in HIGH_PRECISION]
    target = low[0] if low else choice
    family = recipe(target).family if target not in HIGH_PRECISION else None
    if family in ("mx", "blockwise"):       # checked before anything changes: a refused layer stays as it was
        _check_blocks(mod, target)
    # The class the layer had before any recipe: a bf16 layer keeps it (a user's Linear subclass keeps its forward).
    base = mod.__dict__.setdefault(_BASE, type(mod))
    for key in ("scaling_type_input", "scaling_type_weight", "scaling_type_grad_output", "config",
                "linear_mm_config"):
        mod.__dict__.pop(key, None)
    mod.__class__ = base
    setattr(mod, _ATTR, {"choice": target, "gemms": {g: v for g, v in per_gemm.items() if v != target}})
    if target == "float32":
        from ampaudit.precision.keep_fp32 import keep_fp32

        keep_fp32(mod, [""])
    elif family == "float8":
        _to_float8(mod, target, per_gemm, emulate)
    elif family is not None:           # mx, blockwise
        mod.__class__ = RecipeLinear


def recipe_of(mod: nn.Module) -> dict | None:
    """``{"choice", "gemms"}`` a :func:`set_recipe` gave ``mod`` (gemms: only those that differ), or None."""
    state = getattr(mod, _ATTR, None)
    return {"choice": state["choice"], "gemms": dict(state["gemms"])} if isinstance(state, dict) else None


def recipes_of(model: nn.Module) -> dict[str, dict]:
    """``{module name: recipe_of(module)}`` of every Linear of ``model`` that :func:`set_recipe` converted."""
    from ampaudit.wrappers import unwrap

    found = {}
    for name, mod in unwrap(model).named_modules():
        state = recipe_of(mod)
        if state is not None:
            found[name] = state
    return found


def emulation_notes(model: nn.Module) -> list[str]:
    """One line per recipe whose numerics are emulated here rather than run by torchao's training config."""
    used = {state["choice"] for state in recipes_of(model).values()}
    return [note for name, note in (("nvfp4", _NVFP4_NOTE), ("blockwise", _BLOCKWISE_NOTE)) if name in used]
