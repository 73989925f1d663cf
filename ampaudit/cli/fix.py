"""``ampaudit fix``: rewrite a model file into FP32 islands (and pad GEMM dims with --pad), verify, write OUTDIR."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from ampaudit.cli.app import app, cli_errors, split_list


@app.command()
@cli_errors
def fix(
    target: Annotated[str, typer.Argument(help="Model file (model.py) or pkg.module:factory.")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Folder to write the fixed model.py, weights and summary to.")],
    entry: Annotated[Optional[str], typer.Option(help="Name of the model factory, class or instance in the file.")] = None,
    input: Annotated[Optional[list[str]], typer.Option("--input", help="Input shape per forward argument, e.g. 8x3x224x224 or 8x128:int64 (instead of example_inputs).")] = None,
    device: Annotated[Optional[str], typer.Option(help="Target device whose autocast policy applies: cuda or cpu [default: cuda].")] = None,
    dtype: Annotated[Optional[str], typer.Option(help="Reduced precision: float16, bfloat16 or float8 [default: float16].")] = None,
    select: Annotated[Optional[list[str]], typer.Option(help="Only fix findings of these rules: ids, prefixes, names or families.")] = None,
    ignore: Annotated[Optional[list[str]], typer.Option(help="Leave findings of these rules alone (same forms as --select).")] = None,
    pad: Annotated[bool, typer.Option("--pad", help="Also pad misaligned Linear/Embedding/Conv dims with zeros (outputs unchanged).")] = False,
    no_verify: Annotated[bool, typer.Option("--no-verify", help="Skip the re-check and the before/after autocast comparison.")] = False,
    calibrate: Annotated[bool, typer.Option("--calibrate", help="Also run the example inputs under autocast and fix the modules that produce inf/NaN.")] = False,
) -> None:
    """Rewrite a model so it runs safely under autocast: FP32 islands around flagged ops, verified."""
    from ampaudit.config import load_config
    from ampaudit.loading import _pick_entry, load_target
    from ampaudit.policy import Policy
    from ampaudit.rewrite.api import fix as run_fix
    from ampaudit.rewrite.writer import check_outdir, write_outdir

    cfg = load_config(start=Path(target).parent if target.endswith(".py") else None)
    device = device or cfg.get("device", "cuda")
    dtype = dtype or cfg.get("dtype", "float16")
    Policy.load(device, dtype)  # bad --device/--dtype fail before the model file runs
    check_outdir(output)        # and so does an OUTDIR we must not overwrite
    loaded = load_target(target, entry=entry, inputs=input)
    entry_name, _ = _pick_entry(loaded.namespace, entry or (target.partition(":")[2] if loaded.path is None else None) or None,
                                loaded.display)
    result = run_fix(loaded.model, *loaded.args, device=device, dtype=dtype, select=split_list(select) or cfg.get("select"),
                     ignore=split_list(ignore) or cfg.get("ignore"), pad=pad, verify=not no_verify, calibrate=calibrate,
                     target=target, **loaded.kwargs)
    saved_inputs = bool(input) or loaded.hook("example_inputs") is None
    written = write_outdir(result, output, source=loaded, entry=entry_name, saved_inputs=saved_inputs)
    typer.echo(result.report.to_text())
    typer.echo(f"wrote {', '.join(str(p) for p in written)}", err=True)
