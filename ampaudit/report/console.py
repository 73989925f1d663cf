"""Rich console rendering of a check report: findings grouped by module, worst first within each module.

    render_report(report, console)
"""
from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text

from ampaudit.findings import SEVERITY_RANK, Report

_STYLE = {"error": "bold red", "warning": "yellow", "info": "cyan"}


def render_report(report: Report, console: Console, *, show_why: bool = False) -> None:
    pol = report.policy
    console.print(Text.assemble(("ampaudit check ", "bold"), f"{report.target} ",
                                (f"[{pol['device']} {pol['dtype']} autocast, captured by {report.capture}]", "dim")))
    if not report.findings:
        console.print(Text("No findings: the model is clean for this target.", style="green"))
    groups: dict[str, list] = {}
    for f in report.findings:
        groups.setdefault(f.module, []).append(f)
    for module, items in groups.items():
        table = Table(title=Text(module or "<top module>", style="bold"), title_justify="left", show_lines=False,
                      expand=True, box=None, padding=(0, 1))
        table.add_column("sev", no_wrap=True)
        table.add_column("rule", no_wrap=True)
        table.add_column("where", no_wrap=True)
        table.add_column("finding", ratio=1)
        for f in sorted(items, key=lambda f: -SEVERITY_RANK[f.severity]):
            where = f"{_short(f.location['file'])}:{f.location['line']}" if f.location else "-"
            body = Text(f.message)
            if f.fix:
                body.append(f"\nfix: {f.fix}", style="dim")
            if show_why and f.why:
                body.append(f"\nwhy: {f.why}", style="dim italic")
            table.add_row(Text(f.severity, style=_STYLE[f.severity]), f.rule, where, body)
        console.print(table)
    s = report.summary()
    parts = [f"{n} {sev}" for sev, n in reversed(s["by_severity"].items()) if n]
    line = f"{s['total']} finding(s)" + (f": {', '.join(parts)}" if parts else "")
    if s["suppressed"]:
        line += f"; {s['suppressed']} suppressed by '# ampaudit: ignore'"
    console.print(Text(line, style="bold"))
    for note in report.notes:
        console.print(Text(f"note: {note}", style="dim"))


def _short(path: str) -> str:
    parts = path.replace("\\", "/").split("/")
    return "/".join(parts[-2:]) if len(parts) > 2 else path
