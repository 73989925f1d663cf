"""The per-layer meters of a watched training run: a plan's low-precision layers and torchao Float8Linear layers.

    meters = LayerMeters.attach(model, writer, every=50, fp8_fallback=True, plan_file=None,
                                skip=lambda: watch.replaying, recipe_state=None)
    meters.begin_step(step)          # with the session's begin_step
    meters.sampled(step)             # whether they measure ``step`` (a compiled trainer runs it eagerly then)
    meters.end_step(step)            # the step's backward and optimizer are done: their events, then a fallback
    meters.recipe_state()            # what a checkpoint keeps of the recipe statistics
    meters.close()                   # remove their hooks

:class:`~ampaudit.runtime.session.WatchSession` holds one while its statistics are on. ``recipe_stats`` events of a
plan's layers (:mod:`ampaudit.runtime.recipe_stats`) and, with ``fp8_fallback``, the ``fallback`` that moves a layer
past its budget to the next safer recipe (:mod:`ampaudit.runtime.fallback`, rewriting ``plan_file``); ``fp8`` /
``fp8_budget`` events of Float8Linear layers (:mod:`ampaudit.runtime.fp8_stats`). A model with neither imports
nothing of them.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Callable

import torch.nn as nn

from ampaudit.runtime.trace import TraceWriter

if TYPE_CHECKING:
    from ampaudit.runtime.fallback import Fallback
    from ampaudit.runtime.fp8_stats import Fp8Stats
    from ampaudit.runtime.recipe_stats import RecipeStats


class LayerMeters:
    """The fp8 statistics, recipe statistics and fallback of one watched model; see the module docstring."""

    def __init__(self) -> None:
        self.fp8: Fp8Stats | None = None
        self.recipes: RecipeStats | None = None
        self.fallback: Fallback | None = None

    @classmethod
    def attach(cls, model: nn.Module, writer: TraceWriter, *, every: int, fp8_fallback: bool,
               plan_file: str | os.PathLike | None, skip: Callable[[], bool],
               recipe_state: dict | None = None) -> "LayerMeters":
        """Attach what ``model`` has layers for. ``skip``: true while the watch re-runs the model itself (its
        replays and FP32 shadow are not training steps). ``recipe_state``: a checkpoint's :meth:`recipe_state`."""
        from ampaudit.runtime.fp8_stats import Fp8Stats

        meters = cls()
        meters._attach_recipes(model, writer, every, fp8_fallback, plan_file, skip, recipe_state)
        # None unless the model holds torchao Float8Linear layers (a plan's): then `fp8` events too.
        meters.fp8 = Fp8Stats.attach(model, writer, every=every, fallback=fp8_fallback and meters.fallback is None,
                                     skip=skip)
        return meters

    def _attach_recipes(self, model: nn.Module, writer: TraceWriter, every: int, fp8_fallback: bool,
                        plan_file: str | os.PathLike | None, skip: Callable[[], bool],
                        recipe_state: dict | None) -> None:
        """`recipe_stats` of a plan's low-precision layers (none: nothing imported), and their fallback."""
        from ampaudit.precision.convert import recipes_of

        if not recipes_of(model):
            return
        from ampaudit.runtime.fallback import Fallback
        from ampaudit.runtime.recipe_stats import RecipeStats

        self.recipes = RecipeStats.attach(model, writer, every=every, skip=skip)
        if self.recipes is not None and recipe_state:
            self.recipes.load_state_dict(recipe_state)
        if self.recipes is not None and fp8_fallback:
            self.fallback = Fallback(writer, plan_file=plan_file, on_switch=self._switched)

    def _switched(self, name: str, mod: nn.Module) -> None:
        """A layer changed recipe: the float8 statistics follow it, the recipe statistics drop it once high."""
        from ampaudit.precision.recipes import HIGH_PRECISION

        if self.fp8 is not None:
            if hasattr(mod, "linear_mm_config"):     # a Float8Linear now
                self.fp8.layers[name] = mod
            else:
                self.fp8.layers.pop(name, None)
        if self.recipes is not None:
            if mod.ampaudit_recipe["choice"] in HIGH_PRECISION:
                self.recipes.untrack(name)
            else:       # the new recipe is judged on the growth it has seen, from its first sampled step on
                self.recipes.reference.pop(name, None)

    def recipe_state(self) -> dict | None:
        """What a checkpoint keeps of the recipe statistics (their first-step amaxes), or None."""
        return self.recipes.state_dict() if self.recipes is not None else None

    def restore_recipe_state(self, state: dict) -> None:
        """Load :meth:`recipe_state` from a checkpoint."""
        if self.recipes is not None:
            self.recipes.load_state_dict(state)

    def begin_step(self, step: int) -> None:
        """What follows is ``step``."""
        if self.fp8 is not None:
            self.fp8.begin_step(step)
        if self.recipes is not None:
            self.recipes.begin_step(step)

    def sampled(self, step: int) -> bool:
        """Whether any of the meters measures ``step``."""
        return ((self.fp8 is not None and self.fp8.sampled(step))
                or (self.recipes is not None and self.recipes.sampled(step)))

    def end_step(self, step: int) -> None:
        """``step``'s backward and optimizer step are done: write its fp8 and recipe events (before its ``step``
        event); a layer past its budget switches now, for the next step."""
        if self.fp8 is not None:
            self.fp8.end_step(step)
        if self.recipes is not None:
            found = self.recipes.end_step(step)
            if self.fallback is not None and found:
                self.fallback.judge(step, found, self.recipes.layers)

    def close(self) -> None:
        """Remove every meter's hooks."""
        recipes, fp8 = self.recipes, self.fp8
        self.recipes = self.fp8 = self.fallback = None
        if recipes is not None:
            recipes.close()
        if fp8 is not None:
            fp8.close()
