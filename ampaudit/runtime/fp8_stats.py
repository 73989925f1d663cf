"""What torchao's float8 casts do in training: per Float8Linear, on sampled steps, the amax, scale and the shares
flushed to zero and clipped of its input, weight and grad_output, and a note when a layer leaves the plan's budget.

:class:`WatchSession <ampaudit.runtime.session.WatchSession>` starts one when the watched model holds torchao
``Float8Linear`` modules (``ampaudit train --plan ... --trace run.jsonl``); used alone:

    fp8 = Fp8Stats.attach(model, writer, every=50, fallback=False)    # None: no Float8Linear in model
    fp8.begin_step(step)     # a sampled step (the first, then every `every`): hooks on each Float8Linear
    ...                      # forward and backward of the step
    fp8.end_step(step)       # removes the hooks, writes the events; True when a layer went back to bf16
    fp8.close()

Events (trace version 1, see ``ampaudit.runtime.trace``):

- ``fp8``: module, and ``input``, ``weight``, ``grad_output`` each ``{amax, scale, flushed_share, clipped_share}``
  (:func:`ampaudit.precision.fp8.cast_stats` on the tensor torchao casts, with that cast's dtype, granularity and
  rounding; ``scale`` is torchao's, the smallest one of an axiswise cast). ``grad_output`` is absent when no
  gradient reached the layer on that step.
- ``fp8_budget``: module, role (input or grad_output), flushed_share, max_flushed_share (rules/policy/settings.toml
  [plan]), fallback (whether this object moved the layer to bf16: ``fallback=True``, which a session gives it
  only for Float8Linear layers no plan converted; a plan's layers fall back through
  :mod:`ampaudit.runtime.fallback` and its ``fallback`` events). Once per layer and role.

Cost: nothing on the other steps (no hooks are registered). On a sampled step, per layer: a few passes over
its input, weight and grad_output and about 30 scalar reads, which on CUDA each wait for the queue.
Only the first call of a layer in the step is measured (the first micro-batch), and none that the watch makes
itself (its FP32 shadow and locator replays).
"""
from __future__ import annotations

import sys
from typing import Any, Callable

import torch
from torch import nn

from ampaudit.runtime.trace import TraceWriter
from ampaudit.wrappers import unwrap

__all__ = ["Fp8Stats", "float8_linears"]

# The forward operands the hook casts: role and the Float8LinearConfig field that configures its cast
# (grad_output's, cast_config_grad_output, is read where its gradient hook is registered).
_ROLES = (("input", "cast_config_input"), ("weight", "cast_config_weight"))
# What a layer's precision loss shows in: flushed activations or gradients (a weight's flush is its own init).
_BUDGET_ROLES = ("input", "grad_output")


def float8_linears(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(dotted name, module)`` of each torchao Float8Linear in ``model`` (unwrapped); [] without importing
    torchao when it is not loaded (then no Float8Linear can exist)."""
    loaded = sys.modules.get("torchao.float8.float8_linear")
    if loaded is None:
        return []
    cls = loaded.Float8Linear
    return [(name, m) for name, m in unwrap(model).named_modules() if isinstance(m, cls)]


def _cast(t: torch.Tensor, cast: Any, round_pow2: bool) -> dict[str, float]:
    from ampaudit.precision.fp8 import cast_stats

    stats = cast_stats(t, dtype=cast.target_dtype, granularity=cast.scaling_granularity,
                       round_scales_to_power_of_2=round_pow2, axiswise_dim=-1)
    return {key: stats[key] for key in ("amax", "scale", "flushed_share", "clipped_share")}


class Fp8Stats:
    """Sampled cast statistics of ``layers`` (from :func:`float8_linears`), written to ``writer``; see the module
    docstring. ``skip()``: true while the caller runs the model itself (the watch's replays)."""

    def __init__(self, layers: list[tuple[str, nn.Module]], writer: TraceWriter, *, every: int,
                 fallback: bool = False, skip: Callable[[], bool] | None = None):
        from ampaudit.policy import settings

        self.layers = dict(layers)
        self.writer, self.every, self.fallback = writer, max(1, int(every)), fallback
        self.max_flushed_share = float(settings()["plan"]["max_flushed_share"])
        self._skip = skip or (lambda: False)
        self._first: int | None = None
        self._handles: list[Any] = []
        self._pending: dict[str, dict[str, dict]] = {}
        self._over: set[tuple[str, str]] = set()
        self.fallen_back: list[str] = []

    @classmethod
    def attach(cls, model: nn.Module, writer: TraceWriter, **options: Any) -> "Fp8Stats | None":
        """A :class:`Fp8Stats` on ``model``'s Float8Linear layers, or None when it has none."""
        layers = float8_linears(model)
        return cls(layers, writer, **options) if layers else None

    def sampled(self, step: int) -> bool:
        if self._first is None:
            self._first = step
        return (step - self._first) % self.every == 0

    def begin_step(self, step: int) -> None:
        """Hook each Float8Linear when ``step`` is sampled (a step begun twice is hooked once)."""
        if self._handles or not self.layers or not self.sampled(step):
            return
        self._pending = {}
        for name, mod in self.layers.items():
            self._handles.append(mod.register_forward_hook(self._forward_hook(name)))

    def _forward_hook(self, name: str) -> Callable:
        def hook(mod: nn.Module, args: tuple, out: Any) -> None:
            if name in self._pending or self._skip() or not args or not isinstance(args[0], torch.Tensor):
                return
            x = args[0]
            # Float8Linear.forward's own cast under CUDA autocast (it reads the GPU's autocast state alone).
            if torch.is_autocast_enabled("cuda"):
                x = x.to(torch.get_autocast_dtype("cuda"))
            elif torch.is_autocast_enabled("cpu") and getattr(mod, "casts_cpu_autocast", False):
                x = x.to(torch.get_autocast_dtype("cpu"))    # ampaudit.precision.convert's Float8Linear
            cfg = mod.config
            pow2 = cfg.round_scales_to_power_of_2
            found = self._pending[name] = {}
            for role, field in _ROLES:
                cast = getattr(cfg, field)
                if cast.scaling_type.value != "disabled":
                    found[role] = _cast(x if role == "input" else mod.weight, cast, pow2)
            go_cast = cfg.cast_config_grad_output
            if isinstance(out, torch.Tensor) and out.requires_grad and go_cast.scaling_type.value != "disabled":
                # d loss / d output is the grad_output torchao casts (a bias add passes it on unchanged).
                def grad_hook(grad: torch.Tensor) -> None:
                    if "grad_output" not in found and grad is not None:
                        found["grad_output"] = _cast(grad, go_cast, pow2)
                out.register_hook(grad_hook)
        return hook

    def end_step(self, step: int | None) -> bool:
        """Remove the hooks; write the step's ``fp8`` and ``fp8_budget`` events. With ``fallback``, a layer past
        its budget trains in bf16 from the next step; returns True when one did."""
        if not self._handles:
            return False
        for h in self._handles:
            h.remove()
        self._handles.clear()
        pending, self._pending = self._pending, {}
        swapped = False
        for name, found in pending.items():
            self.writer.write("fp8", step=step, module=name, **found)
            over = [(role, found[role]["flushed_share"]) for role in _BUDGET_ROLES
                    if role in found and found[role]["flushed_share"] > self.max_flushed_share
                    and (name, role) not in self._over]
            for role, share in over:
                self._over.add((name, role))
                self.writer.write("fp8_budget", step=step, module=name, role=role, flushed_share=share,
                                  max_flushed_share=self.max_flushed_share, fallback=self.fallback)
            if over and self.fallback:
                self._to_bf16(name)
                swapped = True
        return swapped

    def _to_bf16(self, name: str) -> None:
        mod = self.layers.pop(name)
        # The same object made a plain nn.Linear (Float8Linear subclasses it and adds no parameter or buffer):
        # the optimizer, checkpoints and every hook keyed on the module (the watch's, DDP's) stay valid, and
        # under the run's bf16 autocast F.linear computes it in bf16.
        mod.__class__ = nn.Linear
        self.fallen_back.append(name)

    def close(self) -> None:
        """Remove any hooks left by a step that never ended."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._pending = {}
