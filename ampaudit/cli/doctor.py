"""``ampaudit doctor``: what this machine and install mean for mixed precision, each line with what to change."""
from __future__ import annotations

import json
from typing import Annotated

import typer

from ampaudit.cli.app import app, cli_errors, stdout_console
from ampaudit.errors import UsageError

FORMATS = ("table", "json")
_STYLE = {"ok": "green", "note": "yellow", "warn": "bold red"}


@app.command()
@cli_errors
def doctor(
    format: Annotated[str, typer.Option("--format", "-f", help="table or json.")] = "table",
) -> None:
    """Check torch's build, the GPUs, the CPU, TF32 and reduction flags, and the extras, for mixed precision."""
    if format not in FORMATS:
        raise UsageError(f"unknown --format {format!r}", hint=f"use one of {', '.join(FORMATS)}")
    from ampaudit.machine import doctor as run_doctor

    report = run_doctor()
    if format == "json":
        typer.echo(json.dumps(report, indent=2))
    else:
        render_doctor(report, stdout_console())
    # Exit 0 whatever it found: doctor informs, it does not gate.


def render_doctor(report: dict, console) -> None:
    """One row per check (status, id, message) and, below a check that is not ok, its fix; then the counts."""
    from rich.table import Table
    from rich.text import Text

    table = Table("status", "check", "finding / what to change", box=None, pad_edge=False)
    for c in report["checks"]:
        # Text, not markup: messages hold brackets ("ampaudit[fp8]") that rich would read as tags.
        finding = Text(c["message"])
        if c["fix"]:
            finding.append("\n-> " + c["fix"], style="dim")
        table.add_row(Text(c["status"], style=_STYLE[c["status"]]), Text(c["id"]), finding)
    console.print(table)
    counts = {s: sum(c["status"] == s for c in report["checks"]) for s in _STYLE}
    console.print(Text(", ".join(f"{n} {s}" for s, n in counts.items())
                       + "   (ampaudit doctor --format json has every fact)"))
