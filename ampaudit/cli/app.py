"""The typer app every command registers on, and the one place errors become exit codes.

A command module does::

    from ampaudit.cli.app import app, cli_errors

    @app.command()
    @cli_errors
    def check(...): ...
"""
from __future__ import annotations

import functools
import os
import sys
import traceback
from typing import Callable, TypeVar

import typer

from ampaudit.errors import AmpAuditError
from ampaudit.timeout import TimeLimitExceeded

app = typer.Typer(
    name="ampaudit",
    help="Audit and train PyTorch models under mixed precision (fp16 / bf16 / fp8).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)

F = TypeVar("F", bound=Callable)


def _debug() -> bool:
    return os.environ.get("AMPAUDIT_DEBUG", "") not in ("", "0", "false")


def split_list(values: list[str] | None) -> list[str]:
    """``--select A,B --select C`` -> ``["A", "B", "C"]``."""
    return [v.strip() for item in values or [] for v in item.split(",") if v.strip()]


def stdout_console(**kwargs):
    """A rich Console for stdout: the terminal's width, or 120 columns when piped (rich would fold at 80)."""
    from rich.console import Console

    return Console(**kwargs) if sys.stdout.isatty() else Console(width=120, **kwargs)


def fail(message: str, code: int = 2) -> None:
    """Print one ``error:`` line to stderr and exit with ``code``."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def cli_errors(fn: F) -> F:
    """Turn ampaudit's errors into one stderr line and an exit code; ``AMPAUDIT_DEBUG=1`` keeps the traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (typer.Exit, typer.Abort, SystemExit):
            raise
        except (AmpAuditError, TimeLimitExceeded) as exc:
            if _debug():
                traceback.print_exc()
            fail(exc.one_line(), exc.exit_code)
        except KeyboardInterrupt:
            fail("interrupted", 130)
        except Exception as exc:  # a bug of ours or an unforeseen input: still one line, never a traceback
            if _debug():
                traceback.print_exc()
            fail(f"unexpected {type(exc).__name__}: {' '.join(str(exc).split())[:300]}; "
                 "rerun with AMPAUDIT_DEBUG=1 for the traceback and report it")

    return wrapper  # type: ignore[return-value]


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point."""
    from ampaudit.cli import commands  # noqa: F401  registers every command on `app`

    app(args=argv if argv is not None else sys.argv[1:], prog_name="ampaudit")
