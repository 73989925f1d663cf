"""The plan as a terminal table: what matters first (layers kept in fp32 or bf16 and why, then low-precision layers
by speedup), with each recipe's worst-GEMM SQNR side by side.

    render_plan(plan, console)        # plan: ampaudit.planning.api.Plan; console: rich Console
"""
from __future__ import annotations

import math

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ampaudit.precision.recipes import recipe, recipe_names

_ORDER = {"float32": 0, "bfloat16": 1}
_STYLE = {"float32": "red", "bfloat16": "yellow"}


def _db(value) -> str:
    if not isinstance(value, (int, float)) or math.isnan(value):
        return "-"
    return "inf" if math.isinf(value) and value > 0 else f"{value:.1f}"


def _sqnr(layer, dtype: str, role: str) -> str:
    return _db(layer.metrics.get(dtype, {}).get(role, {}).get("sqnr_db"))


def sort_key(layer) -> tuple:
    return _ORDER.get(layer.choice, 2), -(layer.speedup or 0.0), layer.module


def _choice(layer) -> str:
    text = f"[{_STYLE.get(layer.choice, 'green')}]{escape(layer.choice)}[/]"
    if layer.gemms:
        text += f"\n(wgrad {escape(layer.gemms['grad_weight'])})"
    return text


def _recipe_cell(layer, name: str) -> str:
    entry = layer.metrics.get(name, {})
    if "unsupported" in entry:
        return "n/a"
    values = [entry.get(r, {}).get("sqnr_db") for r in ("output", "grad_input", "grad_weight") if r in entry]
    cell = _db(min(values)) if values else "-"
    return f"[bold]{cell}[/bold]" if name == layer.choice else cell


# The "why" column needs this many columns beside the others; narrower terminals get the reasons below the
# table instead: rich crops (not wraps) a cell whose column is squeezed under the width it measured.
_WHY_MIN = 24


def _title(plan) -> str:
    from ampaudit.planning.pick import recipe_budget_of

    groups: dict[str, list[str]] = {}
    for name in plan.recipes:
        b = recipe_budget_of(name, plan.budget)
        groups.setdefault(f"{b.forward_db:g}/{b.backward_db:g}", []).append(recipe(name).torchao)
    shown = "; ".join(f"{' '.join(names)} {value}" for value, names in groups.items())
    return f"ampaudit plan [speed model {plan.speed_model}; budget dB fwd/bwd: {shown}]"


def _table(plan, *, why: bool) -> Table:
    table = Table(title=escape(_title(plan)), title_justify="left", show_lines=False, box=box.SIMPLE_HEAD)
    # fold: a number or a name too wide for its column goes on the next line instead of ending in an ellipsis
    columns = [("module", {"max_width": 28}), ("in→out × M", {}), ("choice", {"min_width": 8}), ("torchao", {"min_width": 7})]
    # One column per recipe: its worst GEMM's SQNR (each GEMM's is in the JSON and the reasons).
    columns += [(recipe(name).torchao.replace("_", "\n") + "\ndB", {"justify": "right"}) for name in plan.recipes]
    columns += [("model\ngrads dB", {"justify": "right"}), ("speed", {"justify": "right"})]
    if why:
        # fold too: a recipe name longer than the column (float8_rowwise_with_gw_hp: 26) breaks onto the next line
        columns.append(("why", {"ratio": 1, "min_width": _WHY_MIN}))
    for col, kw in columns:
        table.add_column(col, **({"overflow": "fold"} | kw))
    low = {layer.module for layer in plan.layers if layer.choice in recipe_names()}
    for layer in sorted(plan.layers, key=sort_key):
        theirs = "-" if layer.torchao is None else ("fp8" if layer.torchao else "skip")
        if layer.torchao is not None and layer.torchao != (layer.module in low):
            theirs = f"[bold]{theirs}[/bold]*"
        cells = [escape(layer.module), f"{layer.in_features}→{layer.out_features} × {layer.tokens}", _choice(layer),
                 theirs, *(_recipe_cell(layer, name) for name in plan.recipes),
                 _sqnr(layer, layer.choice, "model_grads"), f"{layer.speedup:.2f}x" if layer.speedup else "-"]
        table.add_row(*cells, *([escape("; ".join(layer.reasons))] if why else []))
    return table


def render_plan(plan, console: Console) -> None:
    narrow = _table(plan, why=False)
    why = console.width - console.measure(narrow).maximum >= _WHY_MIN
    console.print(_table(plan, why=True) if why else narrow)
    if not why:
        for layer in sorted(plan.layers, key=sort_key):
            if layer.reasons:
                console.print(f"  {escape(layer.module)}: {escape('; '.join(layer.reasons))}")
    s = plan.summary()
    per = ", ".join(f"{s[n]} {n}" for n in plan.recipes if s.get(n))
    line = (f"{s['layers']} Linear layer(s): {s['low_precision']} low precision ({per or 'none'}), "
            f"{s['bfloat16']} bfloat16, {s['float32']} float32")
    if s.get("predicted_linear_speedup"):
        line += f"; predicted Linear GEMM speedup {s['predicted_linear_speedup']:.2f}x over bf16"
    grads = s.get("predicted_grad_sqnr_db")
    if grads and s["low_precision"]:
        line += f"; model gradients with the plan's low-precision layers {_db(grads['plan'])} dB against FP32"
    if s["torchao_filter_differs"]:
        line += f"; torchao's filter differs on {s['torchao_filter_differs']} (marked *)"
    console.print(line)
    for note in plan.notes:
        console.print(f"note: {escape(note)}", style="dim")
