"""Falling back during training: a plan's low-precision layer that leaves its budget on a sampled step trains in
the next safer recipe (rules/policy/recipes.toml ``safer``, ending in bf16) from the next step on.

``ampaudit train --plan plan.json --trace run.jsonl --fallback`` (alias ``--fp8-fallback``) runs one through its
:class:`WatchSession <ampaudit.runtime.session.WatchSession>`; used alone, after :class:`RecipeStats`:

    fb = Fallback(writer, plan_file="plan.json")        # plan_file None: the plan is not rewritten
    found = stats.end_step(step)                        # ampaudit.runtime.recipe_stats
    switched = fb.judge(step, found, stats.layers)      # [(module, from, to)]; each switched in place
    reasons(found["fc1"], "float8_tensorwise")          # [("input_flushed", 0.62, 0.5), ...]
    output_budget("nvfp4", plan["budgets"])             # 12.0: the plan's forward budget of the recipe

The budgets (a layer leaves its recipe at the first that is crossed, checked in this order):

- ``sqnr``: its output's SQNR against its FP32 shadow below its recipe's forward budget, the one ``ampaudit plan``
  judged the layer by: the plan file's ``budgets[recipe].forward_db`` (so ``plan --budget`` carries over), else
  recipes.toml ``[budget.<recipe>]`` / settings.toml ``[plan]`` (:func:`ampaudit.precision.recipes.format_budget`);
- ``input_flushed`` / ``grad_output_flushed``: a flushed share past ``[plan] max_flushed_share`` (settings.toml);
- ``input_amax_growth`` / ``grad_output_amax_growth``: amax past ``[fallback] max_amax_growth`` times its first
  sampled step's in its current recipe (growth since step 1 for the plan's recipe; after a switch, since the
  switch, so one growing outlier does not walk the whole chain on growth alone).

The switch happens between steps (after the optimizer step, before the next forward): the module object and its
Parameters stay (:func:`ampaudit.precision.convert.set_recipe`), so the optimizer state, hooks and checkpoints carry
on. Each switch writes a ``fallback`` event (module, from, to, reason, value, limit) and, with ``plan_file``,
rewrites that plan atomically: the layer's ``choice`` becomes the new recipe and its ``fallback`` list records
``{step, from, to, reason, value, limit}``. The trainer's checkpoint holds every layer's current recipe, so a
resumed run trains the switched plan from the step it resumes at.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from torch import nn

from ampaudit.runtime.trace import TraceWriter

__all__ = ["Fallback", "reasons", "output_budget"]


def _limits() -> tuple[float, float]:
    from ampaudit.policy import settings

    s = settings()
    return float(s["plan"]["max_flushed_share"]), float(s["fallback"]["max_amax_growth"])


def output_budget(recipe_name: str, budgets: dict | None = None) -> float:
    """The least output SQNR (dB) on the shadow check a layer in ``recipe_name`` may have: ``budgets`` (a plan's
    ``budgets``: recipe -> {forward_db, backward_db}) where it names the recipe, else the recipe table's."""
    from ampaudit.precision.recipes import format_budget

    row = (budgets or {}).get(recipe_name)
    if isinstance(row, dict) and isinstance(row.get("forward_db"), (int, float)):
        return float(row["forward_db"])
    return format_budget(recipe_name)[0]


def reasons(found: dict, recipe_name: str, budgets: dict | None = None) -> list[tuple[str, float, float]]:
    """Every budget a ``recipe_stats`` event of a layer in ``recipe_name`` crossed: ``(reason, value, limit)``;
    ``budgets``: the plan's (see :func:`output_budget`)."""
    max_flushed, max_growth = _limits()
    out = []
    budget = output_budget(recipe_name, budgets)
    if found.get("sqnr_db") is not None and found["sqnr_db"] < budget:
        out.append(("sqnr", found["sqnr_db"], budget))
    for role in ("input", "grad_output"):
        flushed = (found.get(role) or {}).get("flushed_share")
        if flushed is not None and flushed > max_flushed:
            out.append((f"{role}_flushed", flushed, max_flushed))
    for role in ("input", "grad_output"):
        growth = (found.get(role) or {}).get("amax_growth")
        if growth is not None and growth > max_growth:
            out.append((f"{role}_amax_growth", growth, max_growth))
    return out


def describe(reason: str, value: float, limit: float, recipe_name: str = "this recipe") -> str:
    """``input_flushed, 0.62, 0.5`` -> "62% of its input flushed to 0 (budget 50%)"."""
    if reason == "sqnr":
        return f"output SQNR {value:.1f} dB vs FP32 (budget {limit:g} dB)"
    if reason.endswith("_flushed"):
        return f"{value:.0%} of its {reason[:-len('_flushed')]} flushed to 0 (budget {limit:.0%})"
    role = reason[:-len("_amax_growth")]
    return f"its {role}'s amax grew {value:.3g}x since its first sampled step in {recipe_name} (budget {limit:g}x)"


def _switch(mod: nn.Module, name: str, before: dict) -> tuple[str, dict]:
    """Set ``mod`` to the first recipe down the safer chain that takes it (its shape, its per-GEMM choices:
    nvfp4's 16-blocks and a bf16 grad_input do not fit mxfp8, for one); bfloat16 always does."""
    from ampaudit.errors import UsageError
    from ampaudit.precision.convert import set_recipe
    from ampaudit.precision.recipes import safer

    to = safer(before["choice"])
    while True:
        gemms = {} if to == "bfloat16" else before["gemms"]
        try:
            set_recipe(mod, to, gemms, name=name)
            return to, gemms
        except UsageError:
            to = safer(to)


class Fallback:
    """Judges each sampled step's ``recipe_stats`` and switches layers past their budget; see the module docstring.
    ``on_switch(name, module)``: called after each switch (the session retargets its float8 statistics)."""

    def __init__(self, writer: TraceWriter, *, plan_file: str | Path | None = None,
                 on_switch: Callable[[str, nn.Module], None] | None = None):
        self.writer = writer
        self.plan_file = Path(plan_file) if plan_file is not None else None
        self.on_switch = on_switch
        self.switched: list[dict] = []
        self.budgets = self._plan_budgets()

    def _plan_budgets(self) -> dict | None:
        """The budgets the plan was made with (``ampaudit plan`` writes them), None without a readable plan."""
        if self.plan_file is None:
            return None
        try:
            budgets = json.loads(self.plan_file.read_text()).get("budgets")
        except (OSError, ValueError, AttributeError):
            return None        # apply_plan already read and judged the plan; the table's budgets apply
        return budgets if isinstance(budgets, dict) else None

    def judge(self, step: int | None, found: dict[str, dict], layers: dict[str, nn.Module]) -> list[tuple]:
        """Switch every layer of ``found`` past a budget to its recipe's ``safer``; returns (module, from, to)."""
        from ampaudit.precision.convert import recipe_of

        done = []
        for name, event in found.items():
            crossed = reasons(event, event["recipe"], self.budgets)
            mod = layers.get(name)
            if not crossed or mod is None:
                continue
            reason, value, limit = crossed[0]
            before = recipe_of(mod)
            to, gemms = _switch(mod, name, before)
            record = {"module": name, "from": before["choice"], "to": to, "reason": reason, "value": value,
                      "limit": limit, "why": describe(reason, value, limit, before["choice"])}
            self.writer.write("fallback", step=step, **record)
            self.switched.append({"step": step, **record})
            self._update_plan(name, to, gemms, {"step": step, **{k: record[k] for k in
                                                                ("from", "to", "reason", "value", "limit")}})
            if self.on_switch is not None:
                self.on_switch(name, mod)
            done.append((name, before["choice"], to))
        return done

    def _update_plan(self, name: str, to: str, gemms: dict, record: dict) -> None:
        if self.plan_file is None:
            return
        from ampaudit.fileio import atomic_write_text
        from ampaudit.precision.recipes import normalise_plan

        plan = normalise_plan(json.loads(self.plan_file.read_text()))
        for layer in plan["layers"]:
            if layer.get("module") == name:
                layer["choice"] = to
                if gemms:
                    layer["gemms"] = dict(gemms)
                else:
                    layer.pop("gemms", None)
                history = layer.setdefault("fallback", [])
                if record not in history:       # a resumed run switches again at the same step
                    history.append(record)
        atomic_write_text(self.plan_file, json.dumps(plan, indent=2) + "\n",
                          hint="make the plan file writable, or drop --fallback")
