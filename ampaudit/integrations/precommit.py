"""The ``ampaudit-check`` pre-commit hook: ``ampaudit check`` on each staged model file, in one process.

    python -m ampaudit.integrations.precommit [check options] FILE.py [FILE.py ...]
    python -m ampaudit.integrations.precommit --fail-on error --device cpu models/net.py models/vit.py

pre-commit passes the hook's ``args`` first and the matching file names last. Every option of ``ampaudit check``
is accepted and applies to each file; ``--output`` is refused (one file per model would overwrite it). The exit
code is the worst of the per-file codes: 0 clean, 1 findings at or above ``--fail-on``, 2 a file that could not
be loaded or audited. Loading a model file runs its code: point the hook's ``files:`` at model files only.
"""
from __future__ import annotations

import sys

# Options of `ampaudit check` that take a value (so the value is not mistaken for a file name).
VALUE_OPTIONS = {"--entry", "--input", "--device", "--dtype", "--format", "-f", "--fail-on", "--select",
                 "--ignore", "--rules"}
REFUSED = {"--output", "-o"}


def split_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """``(options, files)``: files are the arguments that are not options or option values."""
    options: list[str] = []
    files: list[str] = []
    expect_value = False
    for arg in argv:
        if expect_value:
            options.append(arg)
            expect_value = False
        elif arg.startswith("-"):
            options.append(arg)
            expect_value = arg in VALUE_OPTIONS  # --opt=value carries its own value
        else:
            files.append(arg)
    return options, files


def main(argv: list[str] | None = None) -> int:
    """Check each file; return the worst exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    options, files = split_args(argv)
    refused = [o for o in options if o.split("=")[0] in REFUSED]
    if refused:
        print(f"error: {refused[0]} is not supported by the pre-commit hook (one report per file would overwrite "
              "it); use `ampaudit check FILE --output ...` for one model", file=sys.stderr)
        return 2
    if not files:
        return 0
    from typer.main import get_command

    from ampaudit.cli import commands  # noqa: F401  registers the commands
    from ampaudit.cli.app import app

    command = get_command(app)
    worst = 0
    for path in files:
        if len(files) > 1:
            print(f"--- {path}", file=sys.stderr)
        # standalone_mode=False: errors come back as exit codes instead of ending the process.
        code = command.main(args=["check", path, *options], prog_name="ampaudit", standalone_mode=False)
        worst = max(worst, code if isinstance(code, int) else 0)
    return worst


if __name__ == "__main__":
    raise SystemExit(main())
