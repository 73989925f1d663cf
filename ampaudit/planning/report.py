"""The plan as a terminal table: what matters first (layers kept out of fp8 and why, then fp8 layers by speedup).

    render_plan(plan, console)        # plan: ampaudit.planning.api.Plan; console: rich Console
"""
from __future__ import annotations

import math

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

_ORDER = {"float32": 0, "bfloat16": 1, "float8": 2}
_STYLE = {"float32": "red", "bfloat16": "yellow", "float8": "green"}


def _db(value) -> str:
    if not isinstance(value, (int, float)) or math.isnan(value):
        return "-"
    return "inf" if math.isinf(value) and value > 0 else f"{value:.1f}"


def _sqnr(layer, dtype: str, role: str) -> str:
    return _db(layer.metrics.get(dtype, {}).get(role, {}).get("sqnr_db"))


def sort_key(layer) -> tuple:
    return _ORDER[layer.choice], -(layer.speedup or 0.0), layer.module


# The "why" column needs this many columns beside the others; narrower terminals get the reasons below the
# table instead: rich crops (not wraps) a cell whose column is squeezed under the width it measured.
_WHY_MIN = 24


def _table(plan, *, why: bool) -> Table:
    table = Table(title=escape(f"ampaudit plan [float8 {plan.recipe}, speed model {plan.speed_model}, budget "
                               f"{plan.budget.forward_db:g} dB forward / {plan.budget.backward_db:g} dB backward]"),
                  title_justify="left", show_lines=False, box=box.SIMPLE_HEAD)
    # fold: a number or a name too wide for its column goes on the next line instead of ending in an ellipsis
    columns = [("module", {"max_width": 28}), ("in→out × M", {}), ("choice", {}), ("torchao", {}),
               ("fp8 dB\nout/dx/dw", {"justify": "right"}), ("model\ngrads dB", {"justify": "right"}),
               ("fp8\nspeed", {"justify": "right"})]
    if why:
        columns.append(("why", {"ratio": 1, "min_width": _WHY_MIN, "overflow": "ellipsis"}))
    for col, kw in columns:
        table.add_column(col, **({"overflow": "fold"} | kw))
    for layer in sorted(plan.layers, key=sort_key):
        fp8 = "/".join(_sqnr(layer, "float8", r) for r in ("output", "grad_input", "grad_weight"))
        theirs = "-" if layer.torchao is None else ("fp8" if layer.torchao else "skip")
        if layer.torchao is not None and layer.torchao != (layer.choice == "float8"):
            theirs = f"[bold]{theirs}[/bold]*"
        cells = [layer.module, f"{layer.in_features}→{layer.out_features} × {layer.tokens}",
                 f"[{_STYLE[layer.choice]}]{layer.choice}[/]", theirs, fp8, _sqnr(layer, "float8", "model_grads"),
                 f"{layer.speedup:.2f}x" if layer.speedup else "-"]
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
    line = f"{s['layers']} Linear layer(s): {s['float8']} float8, {s['bfloat16']} bfloat16, {s['float32']} float32"
    if s.get("predicted_linear_speedup"):
        line += f"; predicted Linear GEMM speedup {s['predicted_linear_speedup']:.2f}x over bf16"
    grads = s.get("predicted_grad_sqnr_db")
    if grads:
        line += (f"; model gradients with the plan's float8 layers {_db(grads['plan'])} dB, with every layer "
                 f"in float8 {_db(grads['all_float8'])} dB (against FP32)")
    if s["torchao_filter_differs"]:
        line += f"; torchao's filter differs on {s['torchao_filter_differs']} (marked *)"
    console.print(line)
    for note in plan.notes:
        console.print(f"note: {note}", style="dim")
