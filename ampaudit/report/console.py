"""Rich console rendering of a check report: one row per group of repeated findings (``report.groups``), worst
first, then in execution order.

    render_report(report, console)
"""
from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text

from ampaudit.findings import SEVERITY_RANK, Report, location_text
from ampaudit.report.groups import group_findings

# Source lines of a group listed under its first (the rest: --format json).
_MORE_LINES = 3
_STYLE = {"error": "bold red", "warning": "yellow", "info": "cyan"}


def render_report(report: Report, console: Console, *, show_why: bool = False) -> None:
    pol = report.policy
    console.print(Text.assemble(("ampaudit check ", "bold"), f"{report.target} ",
                                (f"[{pol['device']} {pol['dtype']} autocast, captured by {report.capture}]", "dim")))
    if not report.findings and report.unaudited:
        console.print(Text("No findings in what was audited; the notes below say what was not, so the model is not "
                           "called clean.", style="yellow"))
    elif not report.findings:
        console.print(Text("No findings: the model is clean for this target.", style="green"))
    groups = group_findings(report.findings)
    if groups:
        table = Table(show_lines=False, expand=True, box=None, padding=(0, 1))
        table.add_column("sev", no_wrap=True)
        table.add_column("rule", no_wrap=True)
        table.add_column("where", no_wrap=True)
        table.add_column("finding", ratio=1)
        order = {id(g): i for i, g in enumerate(groups)}
        for g in sorted(groups, key=lambda g: (-SEVERITY_RANK[g.severity], order[id(g)])):
            first = g.findings[0]
            locs = g.locations
            where = _where(locs[0]) if locs else "-"
            if len(locs) > 1:
                where += f" +{len(locs) - 1}"
            body = Text(g.message)
            similar = len({f.message for f in g.findings}) - 1
            if similar:
                body.append(f" (and {similar} more like it: --format json lists each)", style="dim")
            modules = g.modules
            if len(modules) > 1 or g.count > 1:
                body.append(f"\n{g.count}x in {g.pattern}" + (f" ({len(modules)} modules)" if len(modules) > 1 else ""),
                            style="dim")
            else:
                body.append(f"\nin {first.module or '<top module>'}", style="dim")
            if len(locs) > 1:   # what the "+N" of the where column stands for
                more = ", ".join(_where(loc) for loc in locs[1:1 + _MORE_LINES])
                rest = len(locs) - 1 - _MORE_LINES
                body.append(f"\n+{len(locs) - 1} more line(s): {more}" + (f" and {rest} more" if rest > 0 else ""),
                            style="dim")
            if first.fix:
                body.append(f"\nfix{' (the first)' if similar else ''}: {first.fix}", style="dim")
            if show_why and first.why:
                body.append(f"\nwhy: {first.why}", style="dim italic")
            table.add_row(Text(g.severity, style=_STYLE[g.severity]), g.rule, where, body)
        console.print(table)
    s = report.summary()
    parts = [f"{n} {sev}" for sev, n in reversed(s["by_severity"].items()) if n]
    line = f"{s['total']} finding(s)" + (f": {', '.join(parts)}" if parts else "")
    if s["suppressed"]:
        line += f"; {s['suppressed']} suppressed by '# ampaudit: ignore'"
    console.print(Text(line, style="bold"))
    for note in report.notes:
        console.print(Text(f"note: {note}", style="dim"))


def _where(loc: dict) -> str:
    # A user's file by its last two parts (the project is known); a library's by its package and file name, marked
    # (torchvision/.../faster_rcnn.py:370 (library)): the full path below site-packages (in JSON and SARIF) made the
    # column so wide that every message beside it wrapped once more.
    if loc and loc.get("library"):
        parts = str(loc["file"]).replace("\\", "/").split("/")
        short = "/".join(parts) if len(parts) <= 2 else f"{parts[0]}/.../{parts[-1]}"
        return location_text({**loc, "file": short})
    return location_text(loc, _short)


def _short(path: str) -> str:
    parts = path.replace("\\", "/").split("/")
    return "/".join(parts[-2:]) if len(parts) > 2 else path
