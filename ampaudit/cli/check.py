"""``ampaudit check``: the static audit, from a model file to a table, JSON or SARIF report."""
from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from ampaudit.cli.app import app, cli_errors, split_list, stdout_console
from ampaudit.errors import UsageError
from ampaudit.findings import SEVERITY_RANK

FORMATS = ("table", "json", "sarif", "github")
FAIL_ON = ("error", "warning", "info", "never")
OPT_LEVELS = ("O1", "O2")      # ampaudit.train.masters.OPT_LEVELS, named here so a bad one answers before torch loads


@app.command()
@cli_errors
def check(
    target: Annotated[str, typer.Argument(help="Model file (model.py) or pkg.module:factory.")],
    entry: Annotated[Optional[str], typer.Option(help="Name of the model factory, class or instance in the file.")] = None,
    input: Annotated[Optional[list[str]], typer.Option("--input", help="Input shape per forward argument, e.g. 8x3x224x224 or 8x128:int64 (instead of example_inputs).")] = None,
    device: Annotated[Optional[str], typer.Option(help="Target device whose autocast policy applies: cuda or cpu [default: cuda].")] = None,
    dtype: Annotated[Optional[str], typer.Option(help="Reduced precision: float16, bfloat16 or float8 [default: float16].")] = None,
    format: Annotated[Optional[str], typer.Option("--format", "-f", help="table, json, sarif or github (workflow annotations) [default: table].")] = None,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Write the report to this file (atomically).")] = None,
    fail_on: Annotated[Optional[str], typer.Option(help="Exit 1 when a finding is at or above: error, warning, info, never [default: warning].")] = None,
    select: Annotated[Optional[list[str]], typer.Option(help="Only these rules: ids, id prefixes (AMP2), names or families; comma-separated or repeated.")] = None,
    ignore: Annotated[Optional[list[str]], typer.Option(help="Skip these rules (same forms as --select).")] = None,
    rules: Annotated[Optional[list[Path]], typer.Option("--rules", help="Folder of extra rule files (*.toml).")] = None,
    why: Annotated[bool, typer.Option("--why", help="Show why each finding matters (table format).")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Show info findings in full, not one line each (table format).")] = False,
    capture: Annotated[str, typer.Option(help="How to capture the graph: auto (fx, then torch.export, then dispatch-level recording), fx, export or dispatch.")] = "auto",
    calibrate: Annotated[bool, typer.Option("--calibrate", help="Also run the model in FP32 and under the target's autocast and report measured range, non-finite and divergence findings.")] = False,
    calibrate_batches: Annotated[int, typer.Option(help="With --calibrate: use this many batches of train_data() [default: its first batch when the file has train_data() and loss_fn, else example_inputs()].")] = 0,
    opt_level: Annotated[str, typer.Option(help="With --calibrate: how the run stores the model, as ampaudit train --opt-level: O1 (fp32 weights + autocast) or O2 (fp16/bf16 weights, FP32 masters of the trainable ones; state it updates in place is measured in that storage).")] = "O1",
    train_steps: Annotated[int, typer.Option(help="With --calibrate: also train a copy N steps in memory with the built-in Trainer (train_data/loss_fn/make_optimizer of the model file; weights stored in fp16/bf16 at O1: as a plain loop steps them) and report swamping and precursor warnings [0: none].")] = 0,
    lr: Annotated[Optional[float], typer.Option(help="With --train-steps: the learning rate (overrides make_optimizer's).")] = None,
    batch: Annotated[Optional[int], typer.Option(help="The per-rank micro-batch the model will be trained with: BatchNorm below rules/policy/settings.toml's min_micro_batch is a finding (AMP304).")] = None,
    timeout: Annotated[float, typer.Option(help="Give up after this many seconds (a forward that hangs) [0: no limit].")] = 600.0,
) -> None:
    """Audit a model for mixed-precision hazards: alignment, precision-sensitive ops, norms, constants."""
    from ampaudit.config import load_config
    from ampaudit.target_path import model_file

    model_file(target)      # a missing file is refused before torch loads
    target_path = Path(target)
    cfg = load_config(start=target_path.parent if target.endswith(".py") else None)
    device = device or cfg.get("device", "cuda")
    dtype = dtype or cfg.get("dtype", "float16")
    fmt = format or cfg.get("format", "table")
    fail = fail_on or cfg.get("fail_on", "warning")
    sel = split_list(select) or cfg.get("select")
    ign = split_list(ignore) or cfg.get("ignore")
    rule_dirs = [str(r) for r in (rules or [])] or cfg.get("rules", [])
    _refuse_bad_arguments(fmt, fail, batch, calibrate, calibrate_batches, rule_dirs, sel, ign)
    opt_level = _refuse_bad_training(opt_level, train_steps, lr, calibrate)
    if output is not None:
        from ampaudit.fileio import writable_as

        writable_as("--output", output, folder=False)      # as report --html: refused now, not after the audit
    from ampaudit.api import check as run_check
    from ampaudit.loading import load_target
    from ampaudit.policy import Policy

    Policy.load(device, dtype)  # bad --device/--dtype fail before the model file runs
    from ampaudit.analysis.calibrate import calibration_data
    from ampaudit.timeout import time_limit

    with time_limit(timeout, "check"):
        loaded = load_target(target, entry=entry, inputs=input)
        # The batches and the loss come from calibration_data, as fix --calibrate's do: the two agree.
        data = calibration_data(loaded, calibrate_batches, explicit_inputs=bool(input)) if calibrate else None
        report = run_check(loaded.model, *loaded.args, device=device, dtype=dtype, select=sel, ignore=ign,
                           rules_dirs=rule_dirs, target=target, base_dir=Path.cwd(), capture_mode=capture,
                           calibrate=calibrate, data=data, batch=batch, opt_level=opt_level,
                           train_steps=train_steps, lr=lr, **loaded.kwargs)

    _emit(report, fmt, output, {"show_why": why, "verbose": verbose}, rule_dirs)
    if fail != "never" and report.at_or_above(fail):
        raise typer.Exit(1)


def _emit(report, fmt: str, output: Path | None, view: dict, rule_dirs: list[str]) -> None:
    """Print ``report`` in ``fmt`` (table, json, github, sarif), or write it to ``output``; ``view``: the table's
    render_report options (show_why, verbose)."""
    if fmt == "table":
        if output:
            from rich.console import Console

            console = Console(record=True, width=120, file=io.StringIO())
            _render(report, console, view)
            _write(output, console.export_text())
        else:
            # Piped output gets 120 columns rather than rich's 80, so messages are not folded into slivers.
            _render(report, stdout_console(), view)
    else:
        if fmt == "json":
            text = json.dumps(report.to_dict(), indent=2)
        elif fmt == "github":
            from ampaudit.report.github import to_github

            text = to_github(report)
        else:
            from ampaudit.report.sarif import to_sarif
            from ampaudit.rules.loader import load_rules

            text = json.dumps(to_sarif(report, load_rules(rule_dirs)), indent=2)
        if output:
            _write(output, text + "\n" if text else "")
        elif text:  # a clean run prints nothing in the github format
            typer.echo(text)


def _refuse_bad_arguments(fmt: str, fail: str, batch: int | None, calibrate: bool, calibrate_batches: int,
                          rule_dirs: list[str], sel: list[str] | None, ign: list[str] | None) -> None:
    """A UsageError (or RuleError) for a bad option, before torch loads: a usage error answers at once."""
    from ampaudit.rule_index import rule_keys, validate_selectors

    if fmt not in FORMATS:
        raise UsageError(f"unknown --format {fmt!r}", hint=f"use one of {', '.join(FORMATS)}")
    if fail not in FAIL_ON:
        raise UsageError(f"unknown --fail-on {fail!r}", hint=f"use one of {', '.join(FAIL_ON)}")
    if batch is not None and batch < 1:
        raise UsageError(f"--batch must be >= 1, got {batch}", hint="the per-rank micro-batch, e.g. --batch 32")
    if calibrate_batches and not calibrate:
        raise UsageError("--calibrate-batches needs --calibrate", hint="add --calibrate")
    known = rule_keys(rule_dirs)        # the rule files' ids, names and families: no matcher, no torch
    validate_selectors(known, sel, "--select")
    validate_selectors(known, ign, "--ignore")


def _refuse_bad_training(opt_level: str, train_steps: int, lr: float | None, calibrate: bool) -> str:
    """The opt level, normalised; a UsageError for a bad --opt-level, --train-steps or --lr (before torch loads)."""
    level = opt_level.upper()
    if level not in OPT_LEVELS:
        raise UsageError(f"unknown --opt-level {opt_level!r}", hint="use O1 (fp32 weights + autocast) or O2 "
                         "(fp16/bf16 weights + FP32 master weights), as ampaudit train --opt-level")
    if train_steps < 0:
        raise UsageError(f"--train-steps must be >= 0, got {train_steps}", hint="e.g. --train-steps 34 (0: none)")
    if lr is not None and not lr > 0:
        raise UsageError(f"--lr must be > 0, got {lr}", hint="e.g. --lr 0.02")
    if lr is not None and not train_steps:
        raise UsageError("--lr needs --train-steps", hint="add --train-steps N")
    for given, what in ((train_steps, "--train-steps"), (level != "O1", "--opt-level O2")):
        if given and not calibrate:
            raise UsageError(f"{what} needs --calibrate", hint="add --calibrate")
    return level


def _render(report, console, view: dict) -> None:
    from ampaudit.report.console import render_report

    render_report(report, console, **view)


def _write(path: Path, text: str) -> None:
    from ampaudit.fileio import atomic_write_text

    atomic_write_text(path, text)
    typer.echo(f"wrote {path}", err=True)


assert set(SEVERITY_RANK) <= set(FAIL_ON)
