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
import re
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


# Library parameters whose flag is not the parameter's own name (--clip-norm for clip_norm).
_FLAG_ALIASES = {"checkpoint_dir": "checkpoint"}


def _command_flags(fn: Callable) -> dict[str, str]:
    """A command's options by parameter name, from its typer annotations: ``{"clip_norm": "--clip-norm", ...}``."""
    import typing

    try:
        hints = typing.get_type_hints(fn, include_extras=True)
    except Exception:  # an annotation that does not resolve: say parameter names as they are
        return {}
    flags = {}
    for name, hint in hints.items():
        infos = [m for m in getattr(hint, "__metadata__", ()) if type(m).__name__ == "OptionInfo"]
        if infos:
            decls = [d for d in getattr(infos[0], "param_decls", None) or () if d.startswith("--")]
            flags[name] = decls[0].split("/")[0] if decls else "--" + name.replace("_", "-")
    flags.update({lib: flags[cli] for lib, cli in _FLAG_ALIASES.items() if cli in flags})
    return flags


def speak_flags(text: str, flags: dict[str, str]) -> str:
    """Library errors name parameters; say them as this command's flags.

    ``accum=4`` -> ``--accum 4``, ``resume=True`` -> ``--resume``, ``opt_level="O2"`` -> ``--opt-level O2``, and a
    bare ``clip_norm`` -> ``--clip-norm`` (bare names only with an underscore: "resume" is also a word).
    """
    if not flags:
        return text
    names = "|".join(sorted(map(re.escape, flags), key=len, reverse=True))
    start = r"(?<![\w.'\"-])"   # not inside another name, a dotted path or a quoted key
    text = re.sub(rf"{start}({names})=True\b", lambda m: flags[m[1]], text)
    text = re.sub(rf"{start}({names})=(['\"]?)([^\s,;'\"()]+)\2", lambda m: f"{flags[m[1]]} {m[3]}", text)
    return re.sub(rf"{start}({names})(?![\w=-])", lambda m: flags[m[1]] if "_" in m[1] else m[1], text)


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
            fail(speak_flags(exc.one_line(), _command_flags(fn)), exc.exit_code)
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
