"""``ampaudit fix``: rewrite a model file into FP32 islands (and pad GEMM dims with --pad), verify, write OUTDIR;
or, with ``--diff`` / ``--write``, edit the user's own source files (ruff-style), verified before writing."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from ampaudit.cli.app import app, cli_errors, split_list
from ampaudit.errors import UsageError

FORMATS = ("text", "json")


@app.command()
@cli_errors
def fix(
    target: Annotated[str, typer.Argument(help="Model file (model.py) or pkg.module:factory.")],
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Folder to write the fixed model.py, weights and summary to (the graph rewrite, or the module tree of a model torch.fx cannot trace).")] = None,
    entry: Annotated[Optional[str], typer.Option(help="Name of the model factory, class or instance in the file.")] = None,
    input: Annotated[Optional[list[str]], typer.Option("--input", help="Input shape per forward argument, e.g. 8x3x224x224 or 8x128:int64 (instead of example_inputs).")] = None,
    device: Annotated[Optional[str], typer.Option(help="Target device whose autocast policy applies: cuda or cpu [default: cuda].")] = None,
    dtype: Annotated[Optional[str], typer.Option(help="Reduced precision: float16, bfloat16 or float8 [default: float16].")] = None,
    select: Annotated[Optional[list[str]], typer.Option(help="Only fix findings of these rules: ids, prefixes, names or families; with --diff/--write a rule named by id or name has its info findings fixed too.")] = None,
    ignore: Annotated[Optional[list[str]], typer.Option(help="Leave findings of these rules alone (same forms as --select).")] = None,
    pad: Annotated[bool, typer.Option("--pad", help="Also pad misaligned Linear/Embedding/Conv dims with zeros (outputs unchanged).")] = False,
    no_verify: Annotated[bool, typer.Option("--no-verify", help="Skip the re-check and the before/after autocast comparison.")] = False,
    calibrate: Annotated[bool, typer.Option("--calibrate", help="Also run the model under autocast, on what check --calibrate runs (the first train_data() batch through loss_fn, else example_inputs()), and fix the modules that produce inf/NaN.")] = False,
    diff: Annotated[bool, typer.Option("--diff", help="Print a unified diff that fixes your own source files; change nothing (exit 1 when there is a diff).")] = False,
    write: Annotated[bool, typer.Option("--write", help="Apply that diff to your source files, atomically, once it is verified; each keeps its mode, and a read-only file is refused (see --force).")] = False,
    unsafe_fixes: Annotated[bool, typer.Option("--unsafe-fixes", help="With --diff/--write: also make the edits that may change FP32 results (padding a vocabulary).")] = False,
    format: Annotated[str, typer.Option("--format", "-f", help="With --diff/--write: the summary as text or json.")] = "text",
    force: Annotated[bool, typer.Option("--force", help="With --write: also write files without write permission (each keeps its mode).")] = False,
) -> None:
    """Rewrite a model so it runs safely under autocast: FP32 islands around flagged ops, verified; or fix your
    own source with --diff / --write."""
    from ampaudit.target_path import model_file

    model_file(target)      # a missing file is refused first, before torch loads
    if force and not write:
        raise UsageError("--force applies to --write", hint="add --write")
    if diff or write:
        return _fix_source(target, entry=entry, input=input, device=device, dtype=dtype, select=select,
                           ignore=ignore, calibrate=calibrate, no_verify=no_verify, diff=diff, write=write,
                           unsafe=unsafe_fixes, fmt=format, output=output, pad=pad, force=force)
    if output is None:
        raise UsageError("fix needs --output DIR (a rewritten model.py) or --diff/--write (your own source fixed)",
                         hint="e.g. ampaudit fix model.py --diff")
    if unsafe_fixes:
        raise UsageError("--unsafe-fixes applies to --diff/--write", hint="add --diff or --write")
    from ampaudit.loading import _pick_entry, load_target
    from ampaudit.rewrite.api import fix as run_fix
    from ampaudit.rewrite.writer import check_outdir, write_outdir

    cfg, device, dtype = _settings(target, device, dtype)  # bad --device/--dtype fail before the model file runs
    check_outdir(output)        # and so does an OUTDIR we must not overwrite
    loaded = load_target(target, entry=entry, inputs=input)
    from ampaudit.analysis.calibrate import calibration_data

    # The batches and the loss check --calibrate uses (one choice): what check measures is what fix fixes.
    data = calibration_data(loaded, explicit_inputs=bool(input)) if calibrate else None
    entry_name, _ = _pick_entry(loaded.namespace, entry or (target.partition(":")[2] if loaded.path is None else None) or None,
                                loaded.display)
    result = run_fix(loaded.model, *loaded.args, device=device, dtype=dtype, select=split_list(select) or cfg.get("select"),
                     ignore=split_list(ignore) or cfg.get("ignore"), pad=pad, verify=not no_verify, calibrate=calibrate,
                     target=target, data=data, **loaded.kwargs)
    saved_inputs = bool(input) or loaded.hook("example_inputs") is None
    written = write_outdir(result, output, source=loaded, entry=entry_name, saved_inputs=saved_inputs)
    typer.echo(result.report.to_text())
    typer.echo(f"wrote {', '.join(str(p) for p in written)}", err=True)
    # Exit 1 when the re-check finds findings of the fixed families left (in a wrapped body the rewrite leaves as
    # written too), as check does for findings and --diff/--write for a fix still to make; the autocast comparison
    # alone does not decide it (rules the fix was not asked for, --select/--ignore, may still make inf there).
    verification = result.report.verification
    if verification is not None and (verification.remaining or verification.unrewritten):
        raise typer.Exit(1)


def _settings(target: str, device: str | None, dtype: str | None) -> tuple[dict, str, str]:
    """The project config near ``target``, and the device and dtype (the options, else the config's, else
    cuda/float16), checked against the policy tables."""
    from ampaudit.config import load_config
    from ampaudit.policy import Policy

    cfg = load_config(start=Path(target).parent if target.endswith(".py") else None)
    device = device or cfg.get("device", "cuda")
    dtype = dtype or cfg.get("dtype", "float16")
    Policy.load(device, dtype)
    return cfg, device, dtype


def _fix_source(target: str, *, entry, input, device, dtype, select, ignore, calibrate, no_verify, diff, write,
                unsafe, fmt, output, pad, force=False) -> None:
    """--diff / --write: plan, verify, print the diff or write the files, print the summary."""
    import json

    from ampaudit.sourcefix.api import fix_source

    if diff and write:
        raise UsageError("--diff and --write are exclusive", hint="--diff shows the edits, --write makes them")
    if output is not None or pad:
        raise UsageError(f"{'--output' if output is not None else '--pad'} belongs to the graph rewrite, not to "
                         "--diff/--write", hint="run them separately")
    if fmt not in FORMATS:
        raise UsageError(f"unknown --format {fmt!r}", hint=f"use one of {', '.join(FORMATS)}")
    cfg, device, dtype = _settings(target, device, dtype)
    result = fix_source(target, entry=entry, inputs=input, device=device, dtype=dtype,
                        select=split_list(select) or cfg.get("select"), ignore=split_list(ignore) or cfg.get("ignore"),
                        rules_dirs=cfg.get("rules", []), calibrate=calibrate, unsafe=unsafe, verify=not no_verify)
    verified = result.verified
    if write and result.changed and verified:
        result.write(force=force)
    if fmt == "json":
        data = result.to_dict()
        if diff:
            data["diff"] = result.diff()
        typer.echo(json.dumps(data, indent=2))
    else:
        if diff and result.changed:
            typer.echo(result.diff(), nl=False)
        # With --diff the summary goes to stderr, so stdout is a patch that git apply / patch -p1 take.
        typer.echo(result.to_text(), err=diff)
        if write and result.written:
            typer.echo(f"wrote {', '.join(str(p) for p in result.written)}", err=True)
        elif write and result.changed:
            typer.echo("nothing written: the edits did not verify", err=True)
    if result.changed and (diff or not verified):
        raise typer.Exit(1)
