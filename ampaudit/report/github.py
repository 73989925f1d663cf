"""GitHub Actions workflow commands: one annotation per finding, shown on the pull request's diff.

    print(to_github(report))
    # ::warning file=models/net.py,line=41,title=AMP101 linear-dims-misaligned::Linear 1000->500: ...

error -> ``::error``, warning -> ``::warning``, info -> ``::notice``. A finding without a source line is
annotated without ``file``/``line`` (GitHub lists it on the run's summary). Escaping follows the Actions
toolkit: ``%``, CR and LF in the message; those and ``:`` and ``,`` in properties.
"""
from __future__ import annotations

from ampaudit.findings import Finding, Report

COMMAND = {"error": "error", "warning": "warning", "info": "notice"}


def escape_data(text: str) -> str:
    """A command's message: % first, so the escapes themselves are not escaped again."""
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def escape_property(text: str) -> str:
    """A property value (file, title): like the message, plus the separators ``:`` and ``,``."""
    return escape_data(text).replace(":", "%3A").replace(",", "%2C")


def annotation(f: Finding) -> str:
    """One ``::level file=F,line=L,title=T::message`` line for ``f``."""
    props = []
    if f.location and f.location.get("file"):
        props.append(f"file={escape_property(str(f.location['file']).replace(chr(92), '/'))}")
        props.append(f"line={max(1, int(f.location.get('line') or 1))}")
    props.append(f"title={escape_property(f'{f.rule} {f.name}')}")
    message = f"{f.message} [module: {f.module or '<top>'}]"
    if f.fix:
        message += f"\nFix: {f.fix}"
    return f"::{COMMAND[f.severity]} {','.join(props)}::{escape_data(message)}"


def to_github(report: Report) -> str:
    """Every finding of ``report`` as workflow commands, one per line ("" when clean)."""
    return "\n".join(annotation(f) for f in report.findings)
