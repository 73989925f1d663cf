"""Where a layer's float8 error goes: the whole model's gradients with that one Linear in float8.

    found = model_sensitivity(model, batch, ["blocks.0.fc", "head"], recipe="tensorwise", loss_fn=loss_fn)
    found["head"]         # {"sqnr_db": 33.3, "noise": 4.7e-4}: every parameter's gradient against FP32

A layer's own error (``measure``) is judged on the gradient that reaches it in FP32; what its forward error does
downstream is not seen there. The output head is the usual case: its logits feed the softmax, whose gradient
``p - y`` then carries the head's error into every other layer. Here the model runs once in FP32 and once per
layer with only that layer swapped for torchao's Float8Linear (emulated; the rest stays FP32, so the difference is
that layer's alone), and all parameter gradients are compared, concatenated. ``noise`` is 10^(-SQNR/10), the
error power relative to the gradient's: independent layers' noises add, so the sum over a set of float8 layers
predicts the model's gradient SQNR with all of them in float8 (``combined_sqnr``).

The model is unchanged afterwards: gradients are taken with ``autograd.grad`` (no ``.grad`` is written), each
swapped module is put back, every run starts from the same state (parameters, BatchNorm statistics and modes a
training-mode forward moves are put back between runs: :func:`ampaudit.runtime.replay_state.state_snapshot`) and
the same RNG state (the same dropout masks).
"""
from __future__ import annotations

import math
from typing import Any, Callable, Iterable

import torch
from torch import nn

from ampaudit.analysis.calibrate import batch_loss
from ampaudit.planning.measure import error_metrics
from ampaudit.runtime.replay_state import state_snapshot


def _grads(model: nn.Module, params: list[nn.Parameter], batch: tuple, loss_fn,
           restore: Callable[[], None]) -> torch.Tensor:
    """All of ``params``' gradients of one run; ``restore`` (a state snapshot) is called after it, so the next run
    starts from the same parameters, buffers, modes and RNG state as this one."""
    args, kwargs = tuple(batch[0]), dict(batch[1])
    target = batch[2] if len(batch) > 2 else None
    try:
        with torch.enable_grad():
            loss = batch_loss(loss_fn, target, proxy="sum")(model(*args, **kwargs))
            grads = torch.autograd.grad(loss.float().sum(), params, allow_unused=True)
    finally:
        restore()
    return torch.cat([torch.zeros(p.numel(), dtype=torch.float64) if g is None else g.detach().double().flatten()
                      for p, g in zip(params, grads)])


def model_sensitivity(model: nn.Module, batch: tuple, names: Iterable[str], *, recipe: str = "tensorwise",
                      loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
                      layer_recipes: dict[str, tuple[str, bool]] | None = None) -> dict[str, dict[str, float]]:
    """For each Linear in ``names``: the SQNR of all parameter gradients against FP32 with that layer alone in
    float8 (torchao's ``recipe``), and its ``noise`` (see the module docstring). ``batch``: ``(args, kwargs[,
    target])``. ``layer_recipes``: name -> (recipe of rules/policy/recipes.toml, grad_weight in bf16) instead, each
    layer swapped for :func:`ampaudit.planning.emulate.recipe_linear` of its own recipe."""
    from ampaudit.planning import emulate
    from ampaudit.precision.fp8 import config, import_torchao
    from ampaudit.precision.recipes import recipe as recipe_of

    float8_linear = import_torchao().float8_linear.Float8Linear
    cfg = config(recipe) if layer_recipes is None else None

    def swapped(name: str, original: nn.Module) -> nn.Module:
        if layer_recipes is None:
            return float8_linear.from_float(original, config=cfg)
        which, hp = layer_recipes[name]
        return emulate.recipe_linear(original, recipe_of(which), hp_grad_weight=hp)

    params = [p for p in model.parameters() if p.requires_grad]
    restore = state_snapshot(model)
    ref = _grads(model, params, batch, loss_fn, restore)
    out: dict[str, dict[str, float]] = {}
    for name in names:
        if not name:                 # the model is the Linear itself: run its swapped form as the model
            sqnr = error_metrics(ref, _grads(swapped(name, model), params, batch, loss_fn, restore))["sqnr_db"]
            out[name] = {"sqnr_db": sqnr, "noise": _noise(sqnr)}
            continue
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        original = getattr(parent, attr)
        # Shares the Parameters: nothing is copied, and the gradients line up with the reference's.
        setattr(parent, attr, swapped(name, original))
        try:
            sqnr = error_metrics(ref, _grads(model, params, batch, loss_fn, restore))["sqnr_db"]
        finally:
            setattr(parent, attr, original)
        out[name] = {"sqnr_db": sqnr, "noise": _noise(sqnr)}
    return out                      # the model and the RNGs are as before: each _grads put them back


def _noise(sqnr: float) -> float:
    """10^(-SQNR/10); an exact gradient (SQNR inf) adds no noise, a NaN or -inf one all of it."""
    if math.isnan(sqnr) or sqnr == -math.inf:
        return math.inf
    return 10 ** (-sqnr / 10)


def combined_sqnr(noises: Iterable[float]) -> float:
    """The predicted gradient SQNR of the model with every layer of these noises in float8 (inf: none)."""
    total = sum(noises)
    return math.inf if total == 0 else -10 * math.log10(total)
