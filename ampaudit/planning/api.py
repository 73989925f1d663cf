"""``ampaudit.plan``: a per-layer precision plan (float8 / bfloat16 / float32), measured on data.

    plan = ampaudit.plan(model, batches, recipe="tensorwise", speed_model="h100")
    plan.layers[0].choice, plan.layers[0].reasons      # "float8", ["aligned, within budget ..., 1.41x faster"]
    plan.to_dict()                                     # the JSON contract (README, "ampaudit plan")
    plan.float8_modules()                              # {"blocks.0.mlp.fc1", ...}: for torchao's module_filter_fn

``batches``: ``(args, kwargs)`` or ``(args, kwargs, target)`` tuples (``analysis.calibrate.batches_from``), or
``train_data()``'s own ``(inputs, target)`` items.
Each nn.Linear is measured alone on the inputs and output gradients it receives in an FP32 run (``measure``),
in float8 exactly as torchao's float8 training runs it (emulated on CPU), in bf16 and in fp16; ``speed`` predicts
its GEMMs' time on the named GPU; ``choose`` decides. torchao's own filter (``_auto_filter_for_recipe``) is asked
too, so the plan shows where the two differ.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch import nn

from ampaudit.errors import UsageError
from ampaudit.planning.choose import CHOICES, Budget, LayerPlan, choose, misaligned_dims

PLAN_VERSION = 1
RECIPES = ("tensorwise", "rowwise", "auto")


@dataclass
class Plan:
    """The plan for one model; see the module docstring."""

    recipe: str
    speed_model: str
    budget: Budget
    layers: list[LayerPlan]
    notes: list[str] = field(default_factory=list)

    def float8_modules(self) -> set[str]:
        return {layer.module for layer in self.layers if layer.choice == "float8"}

    def float32_modules(self) -> set[str]:
        return {layer.module for layer in self.layers if layer.choice == "float32"}

    def summary(self) -> dict:
        counts = {c: sum(layer.choice == c for layer in self.layers) for c in CHOICES}
        differs = [layer.module for layer in self.layers
                   if layer.torchao is not None and layer.torchao != (layer.choice == "float8")]
        out: dict[str, Any] = {"layers": len(self.layers), **counts, "torchao_filter_differs": len(differs)}
        noises = {layer.module: (layer.metrics.get("float8", {}).get("model_grads") or {}).get("noise")
                  for layer in self.layers}
        if self.layers and all(isinstance(n, float) for n in noises.values()):
            from ampaudit.planning.sensitivity import combined_sqnr

            # Predicted SQNR of every parameter gradient against FP32 with these layers in float8.
            out["predicted_grad_sqnr_db"] = {
                "plan": combined_sqnr(noises[m] for m in self.float8_modules()),
                "all_float8": combined_sqnr(noises.values())}
        times = [layer for layer in self.layers if layer.speed is not None]
        if times and len(times) == len(self.layers):
            bf16 = sum(layer.speed["bfloat16"] for layer in times)
            mine = sum(layer.speed["float8" if layer.choice == "float8" else "bfloat16"] for layer in times)
            out["predicted_linear_speedup"] = bf16 / mine if mine else None
        return out

    def to_dict(self) -> dict:
        from ampaudit.runtime.trace import jsonable

        return jsonable({"version": PLAN_VERSION, "dtype": "float8", "recipe": self.recipe, "speed_model": self.speed_model,
                "budget": self.budget.to_dict(), "layers": [layer.to_dict() for layer in self.layers],
                "summary": self.summary(), "notes": list(self.notes)})


def _torchao_choices(model: nn.Module, recipe: str, names: list[str]) -> dict[str, bool]:
    from ampaudit.planning.fp8 import import_torchao

    filt = import_torchao()._auto_filter_for_recipe(recipe, filter_fqns=[])
    modules = dict(model.named_modules())
    return {name: bool(filt(modules[name], name)) for name in names}


def _plan_for(model: nn.Module, batches: list, recipe: str, *, loss_fn, budget: Budget, speed_model: str,
              tokens: int | None, pad: bool, flagged: dict[str, str] | None) -> Plan:
    from ampaudit.planning.measure import measure_layers
    from ampaudit.planning.sensitivity import model_sensitivity

    measures = measure_layers(model, batches, recipe=recipe, loss_fn=loss_fn)
    for m in measures:
        if tokens:
            m.tokens = tokens
    speeds = None
    if speed_model != "off":
        from ampaudit.planning.speed import linear_times

        speeds = {}
        for m in measures:
            dims = {"in_features": m.in_features, "out_features": m.out_features}
            if pad:   # a padded layer's GEMMs run at the padded width
                dims.update(misaligned_dims(m))
            speeds[m.module] = linear_times(m.tokens, dims["in_features"], dims["out_features"], speed_model,
                                            recipe=recipe)
    layers = choose(measures, budget=budget, speeds=speeds, pad=pad, flagged=flagged)
    theirs = _torchao_choices(model, recipe, [layer.module for layer in layers])
    # Where each layer's float8 error goes downstream, on the first batch (one FP32 run, then one per layer).
    spread = model_sensitivity(model, batches[0], [layer.module for layer in layers], recipe=recipe,
                               loss_fn=loss_fn)
    for layer in layers:
        layer.torchao = theirs.get(layer.module)
        layer.metrics.setdefault("float8", {})["model_grads"] = spread[layer.module]
    return Plan(recipe, speed_model, budget, layers)


@contextlib.contextmanager
def _torch_threads(count: int | None) -> Iterator[None]:
    """torch's intra-op thread count set to ``count`` inside, the caller's restored on leaving, error or not."""
    if count is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def plan(model: nn.Module, batches: list, *, recipe: str = "tensorwise", loss_fn=None,
         budget: Budget | None = None, speed_model: str = "h100", tokens: int | None = None, pad: bool = False,
         flagged: dict[str, str] | None = None, threads: int | None = 1) -> Plan:
    """Measure and choose; see the module docstring. ``recipe="auto"`` plans with both torchao recipes and keeps
    the one with more float8 layers (then the faster). ``tokens``: M of every GEMM instead of the batches'.
    ``flagged``: module -> reason it must stay fp32 (e.g. from check's findings). ``threads``: torch's CPU
    threads while planning (None: the caller's setting; it is restored afterwards either way)."""
    if not isinstance(model, nn.Module):
        raise UsageError(f"plan() needs an nn.Module, got {type(model).__name__}", hint="pass the model first")
    if recipe not in RECIPES:
        raise UsageError(f"unknown recipe {recipe!r}", hint=f"use one of {', '.join(RECIPES)}")
    if not batches:
        raise UsageError("plan() needs at least one batch", hint="pass [(args, kwargs)] or train_data() batches")
    from ampaudit.analysis.calibrate import as_batch

    batches = [as_batch(b) for b in batches]     # train_data()'s (inputs, target) items too
    if speed_model != "off":
        from ampaudit.planning.speed import load_gpus, supports_float8

        fp8_gpus = sorted(g for g in load_gpus() if supports_float8(g))
        if speed_model not in fp8_gpus:
            what = "has no float8 Tensor Cores" if speed_model in load_gpus() else "is not a known GPU"
            raise UsageError(f"speed model {speed_model!r} {what}", hint=f"use one of {', '.join(fp8_gpus)} or off")
    budget = budget or Budget.default()
    kw = dict(loss_fn=loss_fn, budget=budget, speed_model=speed_model, tokens=tokens, pad=pad, flagged=flagged)
    # One thread by default: planning is hundreds of small ops (each Linear re-run alone in float8, bf16 and
    # fp16, the fp8 casts emulated elementwise, one model run per layer), too small to split, and each op that
    # OpenMP splits waits for its slowest thread, which on a shared or busy CPU is a thread that lost its core.
    # Measured in BENCHMARKS.md ("FP8 plan": planning wall time).
    with _torch_threads(threads):
        if recipe != "auto":
            return _plan_for(model, batches, recipe, **kw)
        plans = [_plan_for(model, batches, r, **kw) for r in ("tensorwise", "rowwise")]
    best = max(plans, key=lambda p: (p.summary()["float8"], p.summary().get("predicted_linear_speedup") or 0))
    other = plans[1] if best is plans[0] else plans[0]
    best.notes.append(f"recipe auto: {best.recipe} gives {best.summary()['float8']} float8 layer(s), "
                      f"{other.recipe} {other.summary()['float8']}")
    return best
