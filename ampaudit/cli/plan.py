"""``ampaudit plan``: a per-layer precision plan (a low-precision recipe / bfloat16 / float32) measured on the model's
data."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from ampaudit.cli.app import app, cli_errors, stdout_console
from ampaudit.errors import UsageError

FORMATS = ("table", "json")


def _speed_models() -> str:
    from ampaudit.planning.speed import float8_gpus

    return ", ".join(float8_gpus())


@app.command()
@cli_errors
def plan(
    target: Annotated[str, typer.Argument(help="Model file (model.py) or pkg.module:factory.")],
    entry: Annotated[Optional[str], typer.Option(help="Name of the model factory, class or instance in the file.")] = None,
    dtype: Annotated[str, typer.Option(help="The precision to plan for: float8 (any low-precision recipe).")] = "float8",
    recipes: Annotated[Optional[str], typer.Option(help="Recipes to measure and choose among, comma-separated, full or short names (tensorwise, rowwise, rowwise_with_gw_hp, mxfp8, nvfp4; rules/policy/recipes.toml). Default: those the --speed-model GPU runs natively.", show_default=False)] = None,
    recipe: Annotated[Optional[str], typer.Option(help="One torchao float8 recipe (tensorwise, rowwise; auto: both), as --recipes with one name.", show_default=False)] = None,
    budget: Annotated[Optional[float], typer.Option(help="Minimum forward SQNR in dB against FP32 for the float8 recipes (default: rules/policy/settings.toml); mxfp8 and nvfp4 keep their own (recipes.toml).")] = None,
    budget_backward: Annotated[Optional[float], typer.Option(help="Minimum SQNR in dB of the input and weight gradients.")] = None,
    speed_model: Annotated[str, typer.Option(help=f"GPU whose roofline predicts each GEMM in bf16 and each recipe ({_speed_models()}, or off; rules/policy/gpus.toml); it also sets the default --recipes, and a recipe it has no native kernels for is measured but never chosen.")] = "h100",
    tokens: Annotated[Optional[int], typer.Option(help="Rows (batch x sequence) of every GEMM for the speed model, instead of the calibration batches'.")] = None,
    pad: Annotated[bool, typer.Option("--pad", help="Count misaligned layers as padded to the fp8 multiple (ampaudit fix --pad pads without changing results).")] = False,
    calibrate_batches: Annotated[Optional[int], typer.Option(help="Batches of train_data() to measure on [default: 4 when the file has train_data(), else example_inputs()].")] = None,
    format: Annotated[str, typer.Option("--format", "-f", help="table or json.")] = "table",
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Write the plan's JSON to this file (atomically), for ampaudit train --plan.")] = None,
    timeout: Annotated[float, typer.Option(help="Give up after this many seconds [0: no limit].")] = 600.0,
) -> None:
    """Measure each Linear in each recipe (as torchao trains it), bf16 and fp16 on real batches, and choose."""
    from ampaudit.target_path import model_file

    model_file(target)      # a missing file is refused before torch loads
    if dtype != "float8":
        raise UsageError(f"ampaudit plan plans float8 layers, got --dtype {dtype}",
                         hint="use --dtype float8; for fp16/bf16 hazards run ampaudit check --calibrate")
    if format not in FORMATS:
        raise UsageError(f"unknown --format {format!r}", hint=f"use one of {', '.join(FORMATS)}")
    if recipes is not None and recipe is not None:
        raise UsageError("--recipes and --recipe both given", hint="pass the list to --recipes only")
    if output is not None:
        from ampaudit.fileio import writable_as

        writable_as("--output", output, folder=False)      # refused now, not after the measurements
    from ampaudit.analysis.calibrate import batches_from
    from ampaudit.loading import load_target
    from ampaudit.planning.api import plan as make_plan
    from ampaudit.planning.choose import Budget
    from ampaudit.precision.fp8 import import_torchao
    from ampaudit.timeout import time_limit

    import_torchao()                      # a missing extra fails before the model file runs
    chosen = Budget.default()
    chosen = Budget(budget if budget is not None else chosen.forward_db,
                    budget_backward if budget_backward is not None else chosen.backward_db)
    with time_limit(timeout, "plan"):
        loaded = load_target(target, entry=entry)
        count = calibrate_batches if calibrate_batches is not None else (4 if loaded.hook("train_data") else 0)
        batches = batches_from(loaded, count)
        result = make_plan(loaded.model, batches, recipes=recipes, recipe=recipe, loss_fn=loaded.hook("loss_fn"), budget=chosen,
                           speed_model=speed_model, tokens=tokens, pad=pad)
    text = json.dumps(result.to_dict(), indent=2)
    if output:
        from ampaudit.fileio import atomic_write_text

        atomic_write_text(output, text + "\n")
        typer.echo(f"wrote {output}", err=True)
    if format == "json" and not output:
        typer.echo(text)
    elif format == "table":
        from ampaudit.planning.report import render_plan

        render_plan(result, stdout_console())
