"""GitHub Actions workflow commands: one annotation per finding, shown on the pull request's diff.

    print(to_github(report))
    # ::warning file=models/net.py,line=41,title=AMP101 linear-dims-misaligned::Linear 1000->500: ...

error -> ``::error``, warning -> ``::warning``, info -> ``::notice``. Repeated findings (the same rule and
message up to its numbers, ``report.groups``) on one source line are one annotation naming their modules (every
block of a model built in a loop shares the loop's line). A finding without a source line is
annotated without ``file``/``line`` (GitHub lists it on the run's summary); so is one on an installed library's
line (a transformers model's own code: not a file of the pull request), its message saying the library's
``file:line``. What the audit could not look into (``report.unaudited``) is one ``::warning`` each, titled
"ampaudit: not audited", so a run without findings does not read as clean. Escaping follows the Actions toolkit: ``%``, CR and LF in the message; those and ``:`` and ``,``
in properties.
"""
from __future__ import annotations

from ampaudit.findings import Finding, Report, location_text
from ampaudit.report.groups import group_findings, module_pattern

COMMAND = {"error": "error", "warning": "warning", "info": "notice"}


def escape_data(text: str) -> str:
    """A command's message: % first, so the escapes themselves are not escaped again."""
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def escape_property(text: str) -> str:
    """A property value (file, title): like the message, plus the separators ``:`` and ``,``."""
    return escape_data(text).replace(":", "%3A").replace(",", "%2C")


def annotation(f: Finding, modules: list[str] | None = None) -> str:
    """One ``::level file=F,line=L,title=T::message`` line for ``f`` (found in ``modules``, default its own)."""
    props = []
    if f.location and f.location.get("file") and not f.library:
        props.append(f"file={escape_property(str(f.location['file']).replace(chr(92), '/'))}")
        props.append(f"line={max(1, int(f.location.get('line') or 1))}")
    props.append(f"title={escape_property(f'{f.rule} {f.name}')}")
    modules = modules or [f.module]
    where = (f"module: {modules[0] or '<top>'}" if len(modules) == 1
             else f"{len(modules)} modules: {module_pattern(modules)}")
    if f.library:
        where += f"; at {location_text(f.location)}"
    message = f"{f.message} [{where}]"
    if f.fix:
        message += f"\nFix: {f.fix}"
    return f"::{COMMAND[f.severity]} {','.join(props)}::{escape_data(message)}"


def to_github(report: Report) -> str:
    """Every finding of ``report`` as workflow commands, one per line, then what it could not audit ("" when
    clean)."""
    lines = []
    for group in group_findings(report.findings):
        by_line: dict[tuple, list[Finding]] = {}
        for f in group.findings:
            loc = f.location or {}
            by_line.setdefault((loc.get("file"), loc.get("line")), []).append(f)
        for same in by_line.values():
            lines.append(annotation(same[0], list(dict.fromkeys(f.module for f in same))))
    lines += [f"::warning title={escape_property('ampaudit: not audited')}::{escape_data(n)}" for n in report.unaudited]
    return "\n".join(lines)
