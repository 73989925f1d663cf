"""``ampaudit report TRACE``: a training run's mixed-precision health, in the terminal and as an HTML page.

    ampaudit report run.jsonl                       # summary and recommendations
    ampaudit report run.jsonl --html run.html       # plus one self-contained page with plots
    ampaudit report run.jsonl --check findings.json # name the `ampaudit check` findings the run confirmed
    ampaudit report run.jsonl --json                # the summary as JSON, for other tools
    ampaudit report run.jsonl --tensorboard runs/amp  # the trace's scalars for TensorBoard

Unreadable lines in the trace (a run killed mid-write) are reported and skipped; the exit code stays 0.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from ampaudit.cli.app import app, cli_errors, stdout_console
from ampaudit.errors import TraceError
from ampaudit.fileio import writable_as


@app.command()
@cli_errors
def report(
    trace: Annotated[Path, typer.Argument(help="Trace (JSON Lines) from `ampaudit train --trace` or ampaudit.watch.",
                                          show_default=False)],
    *,
    html: Annotated[Optional[Path], typer.Option(
        "--html", help="Also write a self-contained HTML page with plots to this path (needs the report extra).",
        show_default=False)] = None,
    check: Annotated[Optional[Path], typer.Option(
        "--check", help="Findings from `ampaudit check --format json`: list those the run confirmed.",
        show_default=False)] = None,
    tensorboard: Annotated[Optional[Path], typer.Option(
        "--tensorboard", help="Also write the trace's scalars (loss, scale, skips, grad norm, per-module headroom "
        "and divergence) as TensorBoard logs to this folder (needs the tensorboard extra).",
        show_default=False)] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the summary as JSON instead of text.")] = False,
    top: Annotated[int, typer.Option("--top", min=1, help="Modules shown per table.")] = 5,
) -> None:
    """Summarise a training trace: skipped steps, loss scale, first non-finite, divergence, headroom, advice."""
    from ampaudit.report.trace_advice import load_findings
    from ampaudit.report.trace_summary import collect, summarize
    from ampaudit.runtime.trace import read_trace

    if html is not None:  # fail before the work, not after it
        from ampaudit.report.html import require_plotly
        require_plotly()
        writable_as("--html", html, folder=False)
    if tensorboard is not None:
        writable_as("--tensorboard", tensorboard, folder=True)
        from ampaudit.extras import require
        require("tensorboard", extra="tensorboard", feature="--tensorboard")
    findings = load_findings(check) if check is not None else None
    if trace.is_dir():
        raise TraceError(f"{trace} is a folder, not a trace", hint="pass the .jsonl file written by --trace or ampaudit.watch")
    events, problems = read_trace(trace)
    if not events:
        _refuse(trace, problems)
    data = collect(events)
    summary = summarize(data, problems, top=top, findings=findings, trace=str(trace))

    if as_json:
        typer.echo(json.dumps(summary, indent=2, allow_nan=False))
    else:

        from ampaudit.report.trace_console import render_summary
        render_summary(summary, stdout_console(highlight=False))
        if findings is not None and not any(r.get("kind") == "confirmed_findings"
                                            for r in summary.get("recommendations", [])):
            typer.echo(f"--check: the run confirmed none of the {len(findings)} finding(s) in {check}")
    if html is not None:
        from ampaudit.report.html import write_html
        # The plots rank every module the trace has, not only the --top shown in the terminal.
        written = write_html(html, data, problems, trace=str(trace), summary=summary)
        typer.echo(f"wrote {written}", err=as_json)
    if tensorboard is not None:
        from ampaudit.report.tensorboard import write_tensorboard
        count = write_tensorboard(events, tensorboard)
        typer.echo(f"wrote {count} TensorBoard scalars to {tensorboard}", err=as_json)


def _refuse(trace: Path, problems: list[str]) -> None:
    """A file without one event is not reported on, but one cut-off line is a run killed at its first write: say
    which the file is (a TraceError), or return for that killed run."""
    hint = "pass the file written by --trace or ampaudit.watch"
    if not problems:
        raise TraceError(f"trace {trace} holds no events", hint=hint)
    if _holds_findings(trace):
        raise TraceError(f"{trace} holds findings from ampaudit check, not a trace",
                         hint=f"pass it as --check {trace} with the run's trace")
    first = _first_line(trace)
    if not first.lstrip().startswith("{"):
        raise TraceError(f"{trace} is not an ampaudit trace: its first line is not a JSON event", hint=hint)
    if len(problems) > 1:
        raise TraceError(f"{trace} is not an ampaudit trace: none of its {len(problems)} lines is a JSON event",
                         hint=hint)
    if _parses(first):      # a whole JSON line, so not one a kill cut short: it is just not an event
        raise TraceError(f"{trace} is not an ampaudit trace: its line is JSON but not an event "
                         "(no \"event\" key)", hint=hint)


def _first_line(path: Path) -> str:
    with open(path, encoding="utf-8", errors="replace") as fh:
        return next((line for line in fh if line.strip()), "")


def _parses(line: str) -> bool:
    try:
        json.loads(line)
    except json.JSONDecodeError:
        return False
    return True


def _holds_findings(path: Path) -> bool:
    """Whether ``path`` is ``ampaudit check --format json`` output (a document with a "findings" list)."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(doc, dict) and isinstance(doc.get("findings"), list)
