"""What each low-precision layer of a plan does to its data in training, on sampled steps: the SQNR of its output
against FP32 of the same layer on the same input (a shadow check), and the amax and flushed share of its input and
grad_output under the layer's own recipe quantizer.

:class:`WatchSession <ampaudit.runtime.session.WatchSession>` starts one when the model holds layers that
:func:`ampaudit.precision.convert.set_recipe` converted (``ampaudit train --plan``); used alone:

    stats = RecipeStats.attach(model, writer, every=50)     # None: no low-precision layer in model
    stats.begin_step(step)     # a sampled step (step 1, then each multiple of `every`): hooks on each layer
    ...                        # forward and backward of the step
    found = stats.end_step(step)   # removes the hooks, writes one `recipe_stats` event per layer, returns them
    stats.close()

``recipe_stats`` event (trace version 4): module, recipe (the layer's choice), gemms (GEMMs kept otherwise),
``sqnr_db`` (output vs its FP32 shadow; None when the output is exact or not finite), and ``input`` and
``grad_output`` each ``{amax, flushed_share, amax_growth}``: flushed_share of the nonzero finite values that the
recipe's cast for its first GEMM (input: the output GEMM's; grad_output: grad_input's) turns into 0,
``amax_growth`` the amax over that of the layer's first sampled step in its current recipe (a fallback starts it
again: the safer recipe is judged on the growth it has seen). ``grad_output`` is absent when no gradient
reached the layer. The schedule counts from step 1 (not from the first step seen), so a resumed run samples the
same steps as an uninterrupted one; the first-step amaxes travel in the checkpoint (:meth:`state_dict`).

Cost: nothing on other steps. On a sampled step, per layer: one FP32 ``F.linear`` of its first micro-batch's input
and a few passes over the input and grad_output. Calls the watch makes itself (its replays) are not measured.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from ampaudit.runtime.trace import TraceWriter

__all__ = ["RecipeStats", "recipe_layers", "flushed_share", "sqnr_db"]


def recipe_layers(model: nn.Module) -> dict[str, nn.Module]:
    """``{name: module}`` of the layers a plan converted to a low-precision recipe (not bf16 / fp32)."""
    from ampaudit.precision.convert import recipes_of
    from ampaudit.precision.recipes import HIGH_PRECISION
    from ampaudit.wrappers import unwrap

    modules = dict(unwrap(model).named_modules())
    return {n: modules[n] for n, r in recipes_of(model).items() if r["choice"] not in HIGH_PRECISION}


def sqnr_db(ref: torch.Tensor, got: torch.Tensor) -> float | None:
    """10 log10(|ref|^2 / |ref - got|^2) in fp32; None when exact or not finite."""
    ref, got = ref.detach().float(), got.detach().float()
    noise = float((ref - got).pow(2).sum())
    signal = float(ref.pow(2).sum())
    if not (math.isfinite(noise) and math.isfinite(signal)) or noise == 0 or signal == 0:
        return None
    return 10 * math.log10(signal / noise)


def _qdq(t: torch.Tensor, mod: nn.Module, role: str) -> torch.Tensor | None:
    """``t`` (2-D, reduction dim last) through the cast the layer's recipe gives ``role`` in its first GEMM."""
    state = mod.ampaudit_recipe
    name = state["choice"]
    if name == "mxfp8":
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from torchao.prototype.mx_formats.mx_tensor import MXTensor

        return MXTensor.to_mx(t.float().contiguous(), torch.float8_e4m3fn, 32,
                              ScaleCalculationMode.RCEIL).dequantize(torch.float32)
    if name == "nvfp4":
        from ampaudit.precision.nvfp4_emulated import nvfp4_qdq

        return nvfp4_qdq(t)
    if name == "blockwise":
        from ampaudit.precision.blockwise_emulated import act_qdq

        return act_qdq(t)
    from torchao.float8.float8_utils import tensor_to_scale, to_fp8_saturated

    cfg = mod.config
    cast = cfg.cast_config_input if role == "input" else cfg.cast_config_grad_output
    if cast.scaling_type.value == "disabled":
        return None
    axis = -1 if cast.scaling_granularity.value == "axiswise" else None
    x = t.float()
    scale = tensor_to_scale(x, cast.target_dtype, scaling_granularity=cast.scaling_granularity,
                            axiswise_dim=axis, round_scales_to_power_of_2=cfg.round_scales_to_power_of_2)
    return to_fp8_saturated(x * scale, cast.target_dtype).float() / scale


def flushed_share(t: torch.Tensor, mod: nn.Module, role: str) -> float | None:
    """Share of ``t``'s nonzero finite values that the layer's recipe cast for ``role`` turns into 0."""
    x = t.detach().reshape(-1, t.shape[-1])
    q = _qdq(x, mod, role)
    if q is None:
        return None
    counted = (x != 0) & torch.isfinite(x)
    n = int(counted.sum())
    return int((counted & (q == 0)).sum()) / n if n else 0.0


def _amax(t: torch.Tensor) -> float:
    return float(t.detach().abs().float().amax()) if t.numel() else 0.0


class RecipeStats:
    """Sampled statistics of ``layers`` (from :func:`recipe_layers`) written to ``writer``; see the module
    docstring. ``skip()``: true while the caller runs the model itself (the watch's replays)."""

    def __init__(self, layers: dict[str, nn.Module], writer: TraceWriter, *, every: int,
                 skip: Callable[[], bool] | None = None):
        self.layers = dict(layers)
        self.writer, self.every = writer, max(1, int(every))
        self._skip = skip or (lambda: False)
        self._handles: list[Any] = []
        self._pending: dict[str, dict] = {}
        self.reference: dict[str, dict[str, float]] = {}     # first sampled amax per layer and role

    @classmethod
    def attach(cls, model: nn.Module, writer: TraceWriter, **options: Any) -> "RecipeStats | None":
        layers = recipe_layers(model)
        return cls(layers, writer, **options) if layers else None

    def sampled(self, step: int) -> bool:
        return step == 1 or step % self.every == 0

    def begin_step(self, step: int) -> None:
        if self._handles or not self.layers or not self.sampled(step):
            return
        self._pending = {}
        for name, mod in self.layers.items():
            self._handles.append(mod.register_forward_hook(self._hook(name)))

    def _hook(self, name: str) -> Callable:
        def hook(mod: nn.Module, args: tuple, out: Any) -> None:
            if name in self._pending or self._skip() or not args or not isinstance(args[0], torch.Tensor) \
                    or not isinstance(out, torch.Tensor):
                return
            x = args[0].detach()
            if torch.is_autocast_enabled("cpu") and getattr(mod, "casts_cpu_autocast", False):
                x = x.to(torch.get_autocast_dtype("cpu"))     # what the layer itself multiplies
            with torch.no_grad(), torch.autocast(x.device.type, enabled=False):
                ref = F.linear(x.float(), mod.weight.float(), None if mod.bias is None else mod.bias.float())
                found = self._pending[name] = {"sqnr_db": sqnr_db(ref, out),
                                               "input": self._role(name, "input", x, mod)}
            if out.requires_grad:
                def grad_hook(grad: torch.Tensor) -> None:
                    if "grad_output" not in found and grad is not None:
                        with torch.no_grad():
                            found["grad_output"] = self._role(name, "grad_output", grad, mod)
                out.register_hook(grad_hook)
        return hook

    def _role(self, name: str, role: str, t: torch.Tensor, mod: nn.Module) -> dict:
        amax = _amax(t)
        first = self.reference.setdefault(name, {}).setdefault(role, amax)
        growth = amax / first if first > 0 else None
        return {"amax": amax, "flushed_share": flushed_share(t, mod, role), "amax_growth": growth}

    def end_step(self, step: int | None) -> dict[str, dict]:
        """Remove the hooks; write and return the step's ``recipe_stats`` per layer (``{}`` when not sampled)."""
        if not self._handles:
            return {}
        for h in self._handles:
            h.remove()
        self._handles.clear()
        pending, self._pending = self._pending, {}
        out = {}
        for name, found in pending.items():
            state = self.layers[name].ampaudit_recipe
            event = {"module": name, "recipe": state["choice"], "gemms": dict(state["gemms"]), **found}
            self.writer.write("recipe_stats", step=step, **event)
            out[name] = event
        return out

    def untrack(self, name: str) -> None:
        """Stop measuring ``name`` (it now trains in bf16 / fp32)."""
        self.layers.pop(name, None)

    def state_dict(self) -> dict:
        return {"reference": {n: dict(r) for n, r in self.reference.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.reference = {n: dict(r) for n, r in (state or {}).get("reference", {}).items()}

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._pending = {}
