"""Rich console rendering of a check report: one row per group of repeated findings (``report.groups``), worst
first, then in execution order. Errors and warnings are in full, infos one line each (``verbose``: in full); a fix
clause that rows share is one footnote (ampaudit.report.fix_notes). JSON, SARIF and GitHub output keep everything.

    render_report(report, console)
    render_report(report, console, show_why=True, verbose=True)     # check --why --verbose
"""
from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text

from ampaudit.findings import SEVERITY_RANK, Report, location_text
from ampaudit.report.fix_notes import FixNotes
from ampaudit.report.groups import Group, group_findings

# Source lines of a group listed under its first (the rest: --format json).
_MORE_LINES = 3
_STYLE = {"error": "bold red", "warning": "yellow", "info": "cyan"}


def render_report(report: Report, console: Console, *, show_why: bool = False, verbose: bool = False) -> None:
    """The table of ``report``'s groups, its footnotes, the summary line and the report's notes."""
    pol = report.policy
    console.print(Text.assemble(("ampaudit check ", "bold"), f"{report.target} ",
                                (f"[{pol['device']} {pol['dtype']} autocast, captured by {report.capture}]", "dim")))
    if not report.findings and report.unaudited:
        console.print(Text("No findings in what was audited; the notes below say what was not, so the model is not "
                           "called clean.", style="yellow"))
    elif not report.findings:
        console.print(Text("No findings: the model is clean for this target.", style="green"))
    groups = group_findings(report.findings)
    order = {id(g): i for i, g in enumerate(groups)}
    groups.sort(key=lambda g: (-SEVERITY_RANK[g.severity], order[id(g)]))
    one_line = {id(g) for g in groups if g.severity == "info" and not verbose}
    notes = FixNotes.of([g.findings[0].fix for g in groups if id(g) not in one_line and g.findings[0].fix])
    if groups:
        table = Table(show_lines=False, expand=True, box=None, padding=(0, 1))
        table.add_column("sev", no_wrap=True)
        table.add_column("rule", no_wrap=True)
        located = [g.locations[0] for g in groups if g.locations]
        every_library = bool(located) and all(loc.get("library") for loc in located)
        # Every line an installed library's: the header says so once, not "(library)" on every row.
        table.add_column("where (library)" if every_library else "where", no_wrap=True)
        table.add_column("finding", ratio=1)
        for g in groups:
            body = _line(g) if id(g) in one_line else _body(g, notes, show_why)
            table.add_row(Text(g.severity, style=_STYLE[g.severity]), g.rule, _where_cell(g, every_library), body)
        console.print(table)
    for n, text in enumerate(notes.footnotes, 1):
        console.print(Text(f"[{n}] {text}", style="dim"))
    s = report.summary()
    parts = [f"{n} {sev}" for sev, n in reversed(s["by_severity"].items()) if n]
    line = f"{s['total']} finding(s)" + (f": {', '.join(parts)}" if parts else "")
    if s["suppressed"]:
        line += f"; {s['suppressed']} suppressed by '# ampaudit: ignore'"
    console.print(Text(line, style="bold"))
    hint = _hint(groups, len(one_line))
    if hint:
        console.print(Text(hint, style="dim"))
    for note in report.notes:
        console.print(Text(f"note: {note}", style="dim"))


def _body(g: Group, notes: FixNotes, show_why: bool) -> Text:
    """A group in full: its message, the modules and lines it covers, its fix (shared clauses as references)."""
    first, locs = g.findings[0], g.locations
    body = Text(g.message)
    similar = len({f.message for f in g.findings}) - 1
    if similar:
        body.append(f" (and {similar} more like it)", style="dim")
    modules = g.modules
    if len(modules) > 1 or g.count > 1:
        body.append(f"\n{g.count}x in {g.pattern}" + (f" ({len(modules)} modules)" if len(modules) > 1 else ""),
                    style="dim")
    else:
        body.append(f"\nin {first.module or '<top module>'}", style="dim")
    if len(locs) > 1:   # what the "+N" of the where column stands for
        more = ", ".join(_more(loc) for loc in locs[1:1 + _MORE_LINES])
        rest = len(locs) - 1 - _MORE_LINES
        body.append(f"\n+{len(locs) - 1} more line(s): {more}" + (f" and {rest} more" if rest > 0 else ""),
                    style="dim")
    if first.fix:
        body.append(f"\nfix{' (the first)' if similar else ''}: {notes.shorten(first.fix)}", style="dim")
    if show_why and first.why:
        body.append(f"\nwhy: {first.why}", style="dim italic")
    return body


def _where_cell(g: Group, every_library: bool) -> str:
    """The group's first line, ``+N`` for its others (spelled out in its body)."""
    locs = g.locations
    if not locs:
        return "-"
    where = _where(locs[0])
    if every_library:
        where = where.removesuffix(" (library)")
    return where + (f" +{len(locs) - 1}" if len(locs) > 1 else "")


def _hint(groups: list[Group], one_line: int) -> str:
    """Where what the table summarises is in full: --verbose for the infos cut to one line, JSON for each finding."""
    similar = any(len({f.message for f in g.findings}) > 1 for g in groups)
    if one_line:
        return "infos are one line each: --verbose shows them in full, --format json lists every finding"
    return "rows with more like them: --format json lists every finding" if similar else ""


def _line(g: Group) -> Text:
    """An info group on one line: how many findings, the message cut to the column (--verbose: in full)."""
    count = f"{g.count}x " if g.count > 1 else ""
    return Text(f"{count}{g.message}", no_wrap=True, overflow="ellipsis")


def _more(loc: dict) -> str:
    # The where column names the library (torchvision/.../rpn.py:76 (library)); its further lines by file alone.
    if loc and loc.get("library"):
        return f"{str(loc['file']).replace(chr(92), '/').rsplit('/', 1)[-1]}:{loc['line']}"
    return _where(loc)


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
