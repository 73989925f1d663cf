"""The low-precision training recipes as data: the names a plan's ``choice`` and ``metrics`` use, what each
scales, which GPUs run it natively, and the next safer one.

    recipe("float8_rowwise").scaling           # "row"
    parse_recipes("tensorwise,mxfp8")          # ("float8_tensorwise", "mxfp8"): short names are accepted
    native_recipes(9.0)                        # the recipes an H100 runs with its own kernels
    safer("nvfp4")                             # "mxfp8"
    choices()                                  # every recipe name, then "bfloat16", "float32"
    budget("nvfp4")                            # (12.0, 10.0): forward / backward SQNR budget in dB (None: [plan]'s)
    format_budget("rowwise")                   # (20.0, 15.0): its own budget, else settings.toml [plan]'s
    normalise_plan(v1_plan)                    # a version-1 plan read as version 2

The table lives in rules/policy/recipes.toml; nothing here names a recipe.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from ampaudit.errors import RuleError, UsageError
from ampaudit.datafiles import read_toml, rules_dir

# The version of the plan JSON ``ampaudit plan`` writes (ampaudit.planning.api.Plan.to_dict) and every reader reads
# a plan as (:func:`normalise_plan`; version 1 is read too).
PLAN_VERSION = 2

__all__ = ["PLAN_VERSION", "Recipe", "recipe", "recipe_names", "parse_recipes", "native_recipes", "safer", "choices",
           "HIGH_PRECISION", "budget", "format_budget", "normalise_plan"]

HIGH_PRECISION = ("bfloat16", "float32")
_FIELDS = ("family", "torchao", "scaling", "block", "weight_block", "scale_dtype", "input", "weight",
           "grad_output", "grad_weight", "min_compute_capability", "safer", "source")


@dataclass(frozen=True)
class Recipe:
    """One row of rules/policy/recipes.toml (its fields are documented there)."""

    name: str
    family: str
    torchao: str
    scaling: str
    block: int
    weight_block: int
    scale_dtype: str
    input: str
    weight: str
    grad_output: str
    grad_weight: str
    min_compute_capability: float
    safer: str
    source: str

    @property
    def low_grad_weight(self) -> bool:
        """Whether the weight-gradient GEMM runs in the low-precision format too."""
        return self.grad_weight not in HIGH_PRECISION


@lru_cache(maxsize=None)
def _table() -> dict[str, Recipe]:
    path = rules_dir() / "policy" / "recipes.toml"
    rows = read_toml(path).get("recipe")
    if not isinstance(rows, dict) or not rows:
        raise RuleError(f"{path.name}: no [recipe.<name>] tables", hint="fix the file")
    table = {}
    for name, row in rows.items():
        missing = [key for key in _FIELDS if key not in row]
        unknown = sorted(set(row) - set(_FIELDS))
        if missing or unknown:
            what = f"lacks {', '.join(missing)}" if missing else f"has unknown key(s) {', '.join(unknown)}"
            raise RuleError(f"{path.name}: [recipe.{name}] {what}", hint="fix the file")
        table[name] = Recipe(name=name, **{key: row[key] for key in _FIELDS})
    for r in table.values():
        if r.safer not in table and r.safer not in HIGH_PRECISION:
            raise RuleError(f"{path.name}: [recipe.{r.name}] safer = {r.safer!r} is not a recipe or "
                            f"{' / '.join(HIGH_PRECISION)}", hint="fix the file")
    return table


def recipe_names() -> tuple[str, ...]:
    """Every recipe name, in file order."""
    return tuple(_table())


def choices() -> tuple[str, ...]:
    """What a plan layer's ``choice`` may be: a recipe name, ``bfloat16`` or ``float32``."""
    return recipe_names() + HIGH_PRECISION


def recipe(name: str) -> Recipe:
    """The recipe called ``name`` (full or short name, see :func:`parse_recipes`); UsageError when unknown."""
    return _table()[parse_recipes(name)[0]]


def _full_name(name: str) -> str | None:
    table = _table()
    if name in table:
        return name
    # torchao's own float8 names (tensorwise, rowwise, rowwise_with_gw_hp) are what users of torchao type.
    matches = [r.name for r in table.values() if r.torchao == name]
    return matches[0] if len(matches) == 1 else None


def parse_recipes(text: str) -> tuple[str, ...]:
    """``"tensorwise,mxfp8"`` -> ``("float8_tensorwise", "mxfp8")``; UsageError naming an unknown recipe."""
    out: list[str] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        full = _full_name(part)
        if full is None:
            raise UsageError(f"unknown recipe {part!r}", hint=f"choose from {', '.join(recipe_names())}")
        if full not in out:
            out.append(full)
    if not out:
        raise UsageError("no recipe given", hint=f"choose from {', '.join(recipe_names())}")
    return tuple(out)


def native_recipes(compute_capability: float) -> tuple[str, ...]:
    """The recipes a GPU of this compute capability runs with native kernels, in file order."""
    return tuple(r.name for r in _table().values() if compute_capability >= r.min_compute_capability)


def safer(name: str) -> str:
    """The recipe (or ``bfloat16``) a layer falls back to when ``name`` leaves its budget."""
    if name in HIGH_PRECISION:
        return "float32" if name == "bfloat16" else name
    return recipe(name).safer


def budget(name: str) -> tuple[float, float] | None:
    """``(forward_db, backward_db)`` of the recipe's own [budget.<name>] table, None where it has none (then
    settings.toml [plan]'s float8 budget applies)."""
    full = parse_recipes(name)[0]
    path = rules_dir() / "policy" / "recipes.toml"
    row = (read_toml(path).get("budget") or {}).get(full)
    if row is None:
        return None
    try:
        return float(row["forward_db"]), float(row["backward_db"])
    except (KeyError, TypeError, ValueError) as exc:
        raise RuleError(f"{path.name}: [budget.{full}] needs numeric forward_db and backward_db",
                        hint="fix the file") from exc


def format_budget(name: str, default: tuple[float, float] | None = None) -> tuple[float, float]:
    """``(forward_db, backward_db)`` a layer in recipe ``name`` must keep: its [budget.<name>] table, else
    ``default`` (plan's ``--budget``), else settings.toml [plan]'s float8 budget. The one budget of a recipe: plan
    judges by it, the fallback's shadow check by its forward_db."""
    own = budget(name)
    if own is not None:
        return own
    if default is not None:
        return default
    from ampaudit.policy import settings

    cfg = settings()["plan"]
    return float(cfg["budget_forward_db"]), float(cfg["budget_backward_db"])


def normalise_plan(data: dict) -> dict:
    """A plan (the dict of ``ampaudit plan -o``) as version :data:`PLAN_VERSION`: a version-1 plan's
    ``choice: "float8"`` becomes the recipe its top-level ``recipe`` named (``float8_tensorwise`` when absent),
    ``recipe`` and ``recipes`` name it in full, and its ``metrics["float8"]`` is filed under that name. A version-2 plan comes back as it
    is (a copy); anything else, or a version-1 recipe this table does not know, raises InputError."""
    import copy

    from ampaudit.errors import InputError

    hint = "re-run ampaudit plan on this model and pass the new plan"
    if not isinstance(data, dict) or not isinstance(data.get("layers"), list) or data.get("version") not in (1, 2):
        raise InputError("not an ampaudit plan (version 1 or 2)", hint=hint)
    out = copy.deepcopy(data)
    if out["version"] == PLAN_VERSION:
        return out
    try:
        name = parse_recipes(str(out.get("recipe") or "tensorwise"))[0]
    except UsageError as exc:
        raise InputError(f"plan recipe {out.get('recipe')!r} is unknown", hint=hint) from exc
    for layer in out["layers"]:
        if not isinstance(layer, dict):
            raise InputError("a plan layer is not an object", hint=hint)
        if layer.get("choice") == "float8":
            layer["choice"] = name
        metrics = layer.get("metrics")
        if isinstance(metrics, dict) and "float8" in metrics:
            metrics[name] = metrics.pop("float8")
    out["version"], out["recipe"], out["recipes"] = PLAN_VERSION, name, [name]
    return out
