"""Choosing each Linear's recipe among several, per GEMM where the recipe allows it: the fastest recipe whose output,
grad_input and grad_weight are all within that recipe's budget; bf16 when none is; fp32 where even bf16 is not.

    layer = pick_layer(measure, ["float8_tensorwise", "float8_rowwise", "mxfp8"], speeds={...}, budget=None)
    layer.choice, layer.gemms, layer.reasons
    # "mxfp8", None, ["mxfp8: within budget (out/dx/dw 29.1/28.0/27.5 dB >= 20/15/15), speed not modelled",
    #                 "float8_rowwise: output SQNR 9.8 dB < 20 dB budget; ..."]

Per GEMM: torchao's MXFP8 training runs the weight-gradient GEMM unquantized on request
(``MXFP8TrainingOpConfig(wgrad_with_hp=True)``), so an mxfp8 layer whose grad_weight alone leaves the budget is
planned ``gemms = {"output": "mxfp8", "grad_input": "mxfp8", "grad_weight": "bfloat16"}``, judged on bf16's
grad_weight. float8's own form of it is the recipe float8_rowwise_with_gw_hp, measured under its own name.

``speeds[recipe]`` is ``speed.linear_times``'s dict for this layer (None: the speed model has no numbers for the
recipe); a choice among recipes without speeds goes by accuracy alone (the largest worst-GEMM margin over the
budget), and the reasons say so. A recipe the target GPU has no native kernels for (``not_native``) is never chosen
for it, whatever its accuracy: its reason says so, its metrics stay.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from ampaudit.planning.choose import BACKWARD, Budget, LayerPlan, _bf16_fails, _sqnr
from ampaudit.precision.recipes import Recipe, format_budget, recipe
from ampaudit.policy import settings

__all__ = ["Verdict", "judge", "pick_layer", "recipe_budget_of", "HP_GRAD_WEIGHT"]

# torchao recipes (by torchao name) whose weight-gradient GEMM may run unquantized, and the option that does it.
HP_GRAD_WEIGHT = {"mxfp8": "MXFP8TrainingOpConfig(wgrad_with_hp=True)"}
ROLES = ("output",) + BACKWARD
_SHORT = {"output": "out", "grad_input": "dx", "grad_weight": "dw"}


@dataclass
class Verdict:
    """One recipe's judgement for one layer."""

    recipe: str
    failures: list[str] = field(default_factory=list)
    margin: float = math.inf              # worst (SQNR - budget) over the GEMMs, dB
    sqnr: dict = field(default_factory=dict)
    gemms: dict | None = None
    misaligned: dict | None = None

    @property
    def ok(self) -> bool:
        return not self.failures


def recipe_budget_of(name: str, default: Budget) -> Budget:
    """The recipe's budget from rules/policy/recipes.toml [budget.<name>], else ``default`` (settings [plan])."""
    return Budget(*format_budget(name, (default.forward_db, default.backward_db)))


def _misaligned(measure, r: Recipe) -> dict[str, int]:
    multiple = max(int(settings()["plan"]["fp8_multiple"]), r.block)
    return {dim: -(-getattr(measure, dim) // multiple) * multiple for dim in ("in_features", "out_features")
            if getattr(measure, dim) % multiple}


def _flushes(stats: dict, cap: float, hp_grad_weight: bool, name: str) -> list[str]:
    out = []
    for cast in ("input", "grad_output", "input_for_grad_weight", "grad_output_for_grad_weight"):
        if hp_grad_weight and cast.endswith("_for_grad_weight"):
            continue
        share = (stats.get(cast) or {}).get("flushed_share")
        if isinstance(share, (int, float)) and share > cap:
            out.append(f"{share:.0%} of the nonzero {cast.replace('_', ' ')} values flush to 0 in {name} (over {cap:.0%}; "
                       "the SQNR does not show values this small)")
    return out


def judge(measure, name: str, budget: Budget, *, pad: bool = False, hp_grad_weight: bool = False) -> Verdict:
    """Whether ``measure`` (a ``measure.LayerMeasure``) may train in recipe ``name`` (``hp_grad_weight``: with its
    grad_weight GEMM in bf16), and what stops it."""
    r = recipe(name)
    v = Verdict(name)
    if name in measure.unsupported:
        v.failures.append(measure.unsupported[name])
        return v
    if name not in measure.metrics:
        v.failures.append("not measured")
        return v
    misaligned = _misaligned(measure, r)
    if misaligned and not pad:
        v.misaligned = misaligned
        dims = ", ".join(f"{d} {getattr(measure, d)}" for d in misaligned)
        v.failures.append(f"{dims} not a multiple of {max(int(settings()['plan']['fp8_multiple']), r.block)} "
                          "(--pad pads it without changing results)")
    for role in ROLES:
        source = "bfloat16" if hp_grad_weight and role == "grad_weight" else name
        if role not in measure.metrics.get(source, {}):
            continue                # no gradient reached this layer: its backward is not trained
        floor = budget.forward_db if role == "output" else budget.backward_db
        db, what = _sqnr(measure.metrics, source, role)
        v.sqnr[role] = db
        if math.isnan(db):
            v.failures.append(f"{role.replace('_', ' ')} not measurable (the FP32 reference is not finite)")
            continue
        v.margin = min(v.margin, db - floor)
        if not db >= floor:
            v.failures.append(f"{role.replace('_', ' ')} {what} {db:.1f} dB < {floor:g} dB budget")
    cap = float(settings()["plan"]["max_flushed_share"])
    v.failures += _flushes(measure.metrics[name].get("stats") or {}, cap, hp_grad_weight, name)
    if hp_grad_weight:
        v.gemms = {"output": name, "grad_input": name, "grad_weight": "bfloat16"}
    return v


def _only_grad_weight(v: Verdict) -> bool:
    return bool(v.failures) and all(f.startswith("grad weight") or "for grad weight" in f for f in v.failures)


def _verdicts(measure, names, budget: Budget, pad: bool) -> list[Verdict]:
    out = []
    for name in names:
        v = judge(measure, name, recipe_budget_of(name, budget), pad=pad)
        out.append(v)
        if _only_grad_weight(v) and recipe(name).torchao in HP_GRAD_WEIGHT:
            out.append(judge(measure, name, recipe_budget_of(name, budget), pad=pad, hp_grad_weight=True))
    return out


def _numbers(v: Verdict, budget: Budget) -> str:
    shown = [r for r in ROLES if r in v.sqnr]
    dbs = "/".join(f"{v.sqnr[r]:.1f}" for r in shown)
    floors = "/".join(f"{budget.forward_db if r == 'output' else budget.backward_db:g}" for r in shown)
    return f"{'/'.join(_SHORT[r] for r in shown)} {dbs} dB >= {floors}"


def _label(v: Verdict) -> str:
    return f"{v.recipe} with bf16 wgrad ({HP_GRAD_WEIGHT[recipe(v.recipe).torchao]})" if v.gemms else v.recipe


def _best(passing: list[Verdict], speeds: dict) -> tuple[Verdict, str]:
    """The fastest passing verdict, or the most accurate where some have no predicted speed; and how."""
    timed = [v for v in passing if speeds.get(v.recipe)]
    if len(timed) == len(passing):
        best = max(passing, key=lambda v: (speeds[v.recipe]["speedup"], v.margin))
        return best, f"{speeds[best.recipe]['speedup']:.2f}x faster than bf16"
    missing = sorted({v.recipe for v in passing if not speeds.get(v.recipe)})
    best = max(passing, key=lambda v: v.margin)
    why = ("speed not modelled" if not speeds else f"the speed model has no numbers for {', '.join(missing)}")
    return best, f"chosen by accuracy alone ({why})"


def _runner_up(v: Verdict, best: Verdict, speeds: dict, budget: Budget) -> str:
    """Why a recipe within budget was not chosen."""
    mine, theirs = speeds.get(v.recipe), speeds.get(best.recipe)
    if mine and theirs:
        return f"{_label(v)}: within budget too ({_numbers(v, budget)}), {mine['speedup']:.2f}x faster than bf16"
    return (f"{_label(v)}: within budget too ({_numbers(v, budget)}), {v.margin:.1f} dB over its budget at its "
            f"worst GEMM against {best.margin:.1f}")


def pick_layer(measure, names, *, budget: Budget, speeds: dict | None = None, pad: bool = False,
               flagged: str | None = None, not_native: dict[str, str] | None = None) -> LayerPlan:
    """The plan for one measured layer among recipes ``names``; see the module docstring. ``not_native``:
    ``{recipe: why}`` the target GPU cannot run natively; measured, never chosen."""
    speeds = speeds or {}
    plan = LayerPlan(measure.module, "bfloat16", [], measure.in_features, measure.out_features, measure.tokens,
                     metrics=measure.metrics, stats={})
    if measure.unsupported:
        plan.metrics = dict(measure.metrics) | {n: {"unsupported": why} for n, why in measure.unsupported.items()}
    fp32 = flagged or _bf16_fails(measure)
    if fp32:
        plan.choice = "float32"
        plan.reasons.append(fp32)
        return plan
    verdicts = _verdicts(measure, names, budget, pad)
    passing = []
    for v in verdicts:
        if v.recipe in (not_native or {}):
            v.failures.insert(0, not_native[v.recipe])
        speed = speeds.get(v.recipe)
        if v.ok and speed and speed["speedup"] < 1.0:
            # Few tokens or a narrow layer: the scale and cast passes cost more than the faster GEMMs save.
            v.failures.append(f"predicted {1 / speed['speedup']:.2f}x slower than bf16 ({speed['bound']}-bound "
                              f"at {measure.tokens} tokens)")
        if v.ok:
            passing.append(v)
    if passing:
        best, how = _best(passing, speeds)
        plan.choice, plan.gemms = best.recipe, best.gemms
        plan.stats = measure.metrics[best.recipe].get("stats") or {}
        plan.speed = speeds.get(best.recipe)
        plan.speedup = plan.speed["speedup"] if plan.speed else None
        plan.reasons.append(f"{_label(best)}: within budget ({_numbers(best, recipe_budget_of(best.recipe, budget))})"
                            f", {how}")
        plan.reasons += [_runner_up(v, best, speeds, recipe_budget_of(v.recipe, budget)) for v in passing
                         if v is not best]
    plan.reasons += [f"{_label(v)}: {'; '.join(v.failures)}" for v in verdicts if not v.ok]
    if not passing:
        aligned_only = [v for v in verdicts if v.misaligned and len(v.failures) == 1]
        if aligned_only:
            plan.float8_if_padded = aligned_only[0].misaligned   # alignment alone keeps it out
        if not verdicts:
            plan.reasons.append("no recipe measured")
    elif pad:
        plan.padded = _misaligned(measure, recipe(plan.choice)) or None
    return plan
