"""``ampaudit.plan``: a per-layer precision plan (a low-precision recipe / bfloat16 / float32), measured on data.

    plan = ampaudit.plan(model, batches, recipes="tensorwise,rowwise,mxfp8", speed_model="b200")
    plan.layers[0].choice, plan.layers[0].reasons      # "float8_rowwise", ["float8_rowwise: within budget ..."]
    plan.layers[0].gemms                               # None, or {"output": "mxfp8", ..., "grad_weight": "bfloat16"}
    plan.to_dict()                                     # the JSON contract, version 2 (README, "ampaudit plan")
    plan.low_precision_modules()                       # {"blocks.0.mlp.fc1": "float8_rowwise", ...}

``batches``: ``(args, kwargs)`` or ``(args, kwargs, target)`` tuples (``analysis.calibrate.batches_from``), or
``train_data()``'s own ``(inputs, target)`` items.
Each nn.Linear is measured alone on the inputs and output gradients it receives in an FP32 run (``measure``),
in every recipe asked for exactly as torchao trains it (emulated on CPU: ``emulate``), in bf16 and in fp16;
``speed`` predicts its GEMMs' time on the named GPU (``recipe_speed``); ``pick`` decides, per layer and where the
recipe allows it per GEMM; each chosen layer is then run alone in its recipe inside the whole model
(``sensitivity``). torchao's own float8 filter (``_auto_filter_for_recipe``) is asked too, so the plan shows
where the two differ. Version-1 plans (one float8 recipe, ``choice: "float8"``) are read through
``recipes.normalise_plan``.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch import nn

from ampaudit.errors import UsageError
from ampaudit.planning.choose import Budget, LayerPlan, misaligned_dims
from ampaudit.precision.recipes import PLAN_VERSION, choices, native_recipes, parse_recipes, recipe_names
from ampaudit.precision.recipes import recipe as recipe_row

RECIPES = ("tensorwise", "rowwise", "auto")      # the single-recipe ``recipe=`` of version-1 callers
_AUTO = ("float8_tensorwise", "float8_rowwise")


@dataclass
class Plan:
    """The plan for one model; see the module docstring."""

    recipes: tuple[str, ...]
    speed_model: str
    budget: Budget
    layers: list[LayerPlan]
    notes: list[str] = field(default_factory=list)

    @property
    def recipe(self) -> str:
        """The recipes measured, comma-separated (what ``--recipes`` takes)."""
        return ",".join(self.recipes)

    def low_precision_modules(self) -> dict[str, str]:
        """module -> recipe, for every layer whose choice is a recipe."""
        return {layer.module: layer.choice for layer in self.layers if layer.choice in recipe_names()}

    def float8_modules(self) -> set[str]:
        """The layers that train in a low-precision recipe (any of them)."""
        return set(self.low_precision_modules())

    def float32_modules(self) -> set[str]:
        return {layer.module for layer in self.layers if layer.choice == "float32"}

    def summary(self) -> dict:
        counts = {c: sum(layer.choice == c for layer in self.layers) for c in choices()}
        low = self.low_precision_modules()
        differs = [layer.module for layer in self.layers
                   if layer.torchao is not None and layer.torchao != (layer.module in low)]
        out: dict[str, Any] = {"layers": len(self.layers), "low_precision": len(low), **counts,
                               "torchao_filter_differs": len(differs)}
        noises = {layer.module: (layer.metrics.get(layer.choice, {}).get("model_grads") or {}).get("noise")
                  for layer in self.layers if layer.module in low}
        if all(isinstance(n, float) for n in noises.values()):
            from ampaudit.planning.sensitivity import combined_sqnr

            # Predicted SQNR of every parameter gradient against FP32 with the plan's low-precision layers.
            out["predicted_grad_sqnr_db"] = {"plan": combined_sqnr(noises.values())}
        if self.layers and all(layer.speed or layer.module not in low for layer in self.layers) and \
                all(layer.speed_bf16 for layer in self.layers):
            bf16 = sum(layer.speed_bf16 for layer in self.layers)
            mine = sum(_low_seconds(layer) if layer.module in low else layer.speed_bf16 for layer in self.layers)
            out["predicted_linear_speedup"] = bf16 / mine if mine else None
        return out

    def to_dict(self) -> dict:
        from ampaudit.runtime.trace import jsonable

        return jsonable({"version": PLAN_VERSION, "recipes": list(self.recipes), "speed_model": self.speed_model,
                         "budget": self.budget.to_dict(), "budgets": _budgets(self.recipes, self.budget),
                         "layers": [layer.to_dict() for layer in self.layers],
                         "summary": self.summary(), "notes": list(self.notes)})


def _low_seconds(layer: LayerPlan) -> float:
    speed = layer.speed or {}
    return speed.get(layer.choice) or speed.get("float8") or speed["bfloat16"] / speed["speedup"]


def _budgets(names, default: Budget) -> dict:
    from ampaudit.planning.pick import recipe_budget_of

    return {name: recipe_budget_of(name, default).to_dict() for name in names}


def recipe_speed(m: int, k: int, n: int, gpu: str, name: str) -> dict | None:
    """``speed.linear_times`` of recipe ``name`` on ``gpu``; None where the speed model has no cast kernels for
    the recipe. UsageError where ``gpu`` has no native kernels for it (:func:`not_native_recipes` says which: those
    are never chosen for that GPU, not chosen by accuracy alone) or is unknown."""
    from ampaudit.planning.speed import cast_kernels, linear_times

    try:
        cast_kernels(name)
    except UsageError:
        return None
    return linear_times(m, k, n, gpu, recipe=name)


def not_native_recipes(names, speed_model: str) -> dict[str, str]:
    """``{recipe: why}`` for the recipes of ``names`` the ``speed_model`` GPU has no native kernels for (none for
    ``"off"``): a plan for that GPU measures them but never chooses them."""
    from ampaudit.planning.speed import not_native

    if speed_model == "off":
        return {}
    return {name: why for name in names if (why := not_native(speed_model, name))}


def _torchao_choices(model: nn.Module, names: list[str], layers: list[LayerPlan]) -> dict[str, bool | None]:
    """What torchao's own float8 filter (``_auto_filter_for_recipe``) says per layer, for the layer's float8
    recipe (its choice, else the first float8 recipe measured); None where no float8 recipe applies."""
    from ampaudit.precision.fp8 import import_torchao

    float8 = [r for r in names if recipe_row(r).family == "float8"]
    modules = dict(model.named_modules())
    out: dict[str, bool | None] = {}
    for layer in layers:
        which = layer.choice if layer.choice in float8 else (float8[0] if float8 else None)
        if which is None or (layer.choice in recipe_names() and layer.choice not in float8):
            out[layer.module] = None
            continue
        try:
            filt = import_torchao()._auto_filter_for_recipe(recipe_row(which).torchao, filter_fqns=[])
        except NotImplementedError:          # torchao 0.18's filter knows tensorwise and rowwise only
            out[layer.module] = None
            continue
        out[layer.module] = bool(filt(modules[layer.module], layer.module))
    return out


def _speeds(measures, names, speed_model: str, pad: bool) -> dict[str, dict[str, dict | None]]:
    foreign = not_native_recipes(names, speed_model)
    out: dict[str, dict[str, dict | None]] = {}
    for m in measures:
        dims = {"in_features": m.in_features, "out_features": m.out_features}
        if pad:   # a padded layer's GEMMs run at the padded width
            dims.update(misaligned_dims(m))
        out[m.module] = {name: recipe_speed(m.tokens, dims["in_features"], dims["out_features"], speed_model, name)
                         for name in names if name not in foreign}
    return out


def _plan_for(model: nn.Module, batches: list, names: tuple[str, ...], *, loss_fn, budget: Budget,
              speed_model: str, tokens: int | None, pad: bool, flagged: dict[str, str] | None) -> Plan:
    from ampaudit.planning.emulate import NOTES
    from ampaudit.planning.measure import measure_layers
    from ampaudit.planning.pick import pick_layer
    from ampaudit.planning.sensitivity import model_sensitivity

    measures = measure_layers(model, batches, loss_fn=loss_fn, dtypes=names + ("bfloat16", "float16"))
    for m in measures:
        if tokens:
            m.tokens = tokens
    speeds = _speeds(measures, names, speed_model, pad) if speed_model != "off" else {}
    foreign = not_native_recipes(names, speed_model)
    layers = [pick_layer(m, names, budget=budget, speeds=speeds.get(m.module), pad=pad,
                         flagged=(flagged or {}).get(m.module), not_native=foreign) for m in measures]
    for layer in layers:
        bf16 = next((s["bfloat16"] for s in (speeds.get(layer.module) or {}).values() if s), None)
        layer.speed_bf16 = bf16
    theirs = _torchao_choices(model, list(names), layers)
    # Where each layer's own error goes downstream, on the first batch: one FP32 run, then one per low-precision
    # layer with that layer alone in its recipe.
    chosen = {layer.module: (layer.choice, bool(layer.gemms)) for layer in layers if layer.choice in names}
    spread = model_sensitivity(model, batches[0], list(chosen), loss_fn=loss_fn, layer_recipes=chosen)
    for layer in layers:
        layer.torchao = theirs.get(layer.module)
        if layer.module in spread:
            layer.metrics.setdefault(layer.choice, {})["model_grads"] = spread[layer.module]
    notes = [NOTES[n] for n in names if n in NOTES]
    if foreign:
        notes.append(f"{speed_model} has no native kernels for {', '.join(foreign)}: measured, never chosen for it "
                     "(--speed-model off, or a GPU that has them, to choose them)")
    unknown = [n for n in names if n not in foreign and all(not (s or {}).get(n) for s in speeds.values())]
    if speed_model != "off" and unknown and measures:
        notes.append(f"speed model {speed_model} has no numbers for {', '.join(unknown)}: "
                     "layers choosing among those go by accuracy alone")
    return Plan(names, speed_model, budget, layers, notes)


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


def default_recipes(speed_model: str) -> tuple[str, ...]:
    """The recipes ``speed_model``'s GPU runs natively (rules/policy/recipes.toml ``min_compute_capability``) that
    this machine can emulate; every emulatable recipe for ``"off"``."""
    from ampaudit.planning.emulate import unsupported
    from ampaudit.planning.speed import load_gpus

    names = recipe_names() if speed_model == "off" else native_recipes(
        float(load_gpus()[speed_model]["compute_capability"]))
    return tuple(n for n in names if unsupported(recipe_row(n), tokens=0, k=0, n=0) is None)


def _recipe_names(recipes, recipe: str | None) -> tuple[str, ...] | None:
    if recipes is not None:
        return parse_recipes(recipes if isinstance(recipes, str) else ",".join(recipes))
    if recipe is None:
        return None
    if recipe not in RECIPES:
        raise UsageError(f"unknown recipe {recipe!r}", hint=f"use one of {', '.join(RECIPES)}, or recipes=")
    return _AUTO if recipe == "auto" else parse_recipes(recipe)


def _check_speed_model(speed_model: str) -> None:
    if speed_model == "off":
        return
    from ampaudit.planning.speed import float8_gpus, load_gpus

    fp8_gpus = float8_gpus()
    if speed_model not in fp8_gpus:
        what = "has no float8 Tensor Cores" if speed_model in load_gpus() else "is not a known GPU"
        raise UsageError(f"speed model {speed_model!r} {what}", hint=f"use one of {', '.join(fp8_gpus)} or off")


def plan(model: nn.Module, batches: list, *, recipes=None, recipe: str | None = None, loss_fn=None,
         budget: Budget | None = None, speed_model: str = "h100", tokens: int | None = None, pad: bool = False,
         flagged: dict[str, str] | None = None, threads: int | None = 1) -> Plan:
    """Measure and choose; see the module docstring. ``recipes``: names of rules/policy/recipes.toml (full or
    short, a list or "tensorwise,mxfp8"; default: :func:`default_recipes` of ``speed_model``); ``recipe``: one
    torchao float8 recipe as version-1 callers passed it ("auto": tensorwise and rowwise). ``budget``: the
    float8 budget (recipes.toml [budget.<name>] sets the others). ``tokens``: M of every GEMM instead of the
    batches'. ``flagged``: module -> reason it must stay fp32 (e.g. from check's findings). ``threads``: torch's
    CPU threads while planning (None: the caller's setting; it is restored afterwards either way)."""
    if not isinstance(model, nn.Module):
        raise UsageError(f"plan() needs an nn.Module, got {type(model).__name__}", hint="pass the model first")
    names = _recipe_names(recipes, recipe)
    if not batches:
        raise UsageError("plan() needs at least one batch", hint="pass [(args, kwargs)] or train_data() batches")
    _check_speed_model(speed_model)
    from ampaudit.analysis.calibrate import as_batch
    from ampaudit.planning.emulate import unsupported

    names = names or default_recipes(speed_model)
    dropped = [n for n in names if recipe_row(n).family != "mx" and unsupported(recipe_row(n), tokens=0, k=0, n=0)]
    if dropped and len(dropped) == len(names):
        raise UsageError(unsupported(recipe_row(dropped[0]), tokens=0, k=0, n=0),
                         hint=f"plan with others: {', '.join(default_recipes('off'))}")
    names = tuple(n for n in names if n not in dropped)
    batches = [as_batch(b) for b in batches]     # train_data()'s (inputs, target) items too
    budget = budget or Budget.default()
    kw = dict(loss_fn=loss_fn, budget=budget, speed_model=speed_model, tokens=tokens, pad=pad, flagged=flagged)
    # One thread by default: planning is hundreds of small ops (each Linear re-run alone in each recipe, bf16 and
    # fp16, the casts emulated elementwise, one model run per layer), too small to split, and each op that
    # OpenMP splits waits for its slowest thread, which on a shared or busy CPU is a thread that lost its core.
    # Measured in BENCHMARKS.md ("FP8 plan": planning wall time).
    with _torch_threads(threads):
        result = _plan_for(model, batches, names, **kw)
    result.notes += [f"{unsupported(recipe_row(n), tokens=0, k=0, n=0)}: left out" for n in dropped]
    return result
