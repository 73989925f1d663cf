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


def piped_width() -> int:
    """Columns for output that is not a terminal: ``COLUMNS`` when set (a CI log, ``COLUMNS=80 ampaudit ...``),
    else 120 (rich would fold at 80)."""
    value = os.environ.get("COLUMNS", "")
    return int(value) if value.isdigit() and int(value) >= 40 else 120


def stdout_console(**kwargs):
    """A rich Console for stdout: the terminal's width, or :func:`piped_width` columns when piped."""
    from rich.console import Console

    return Console(**kwargs) if sys.stdout.isatty() else Console(width=piped_width(), **kwargs)


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
        except (typer.Exit, typer.Abort, SystemExit, BrokenPipeError):   # the reader left: main() ends quietly
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


# Options that take a value but mean one when given bare: ``--checkpoint-activations --save x`` is ``auto``.
BARE_VALUES = {"--checkpoint-activations": "auto"}


def bare_values(argv: list[str]) -> list[str]:
    """``argv`` with each :data:`BARE_VALUES` option that has no value of its own given its default; a next
    word that is an option, a model file (``.py``) or a ``pkg.module:factory`` target is not its value."""
    out: list[str] = []
    for i, word in enumerate(argv):
        out.append(word)
        if word in BARE_VALUES:
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            if nxt is None or nxt.startswith("-") or nxt.endswith(".py") or ":" in nxt or os.sep in nxt:
                out.append(BARE_VALUES[word])
    return out


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            typer.echo(f"ampaudit {version('ampaudit')}")
        except PackageNotFoundError:  # a source tree on sys.path without an install
            typer.echo("ampaudit (not installed)")
        raise typer.Exit(0)


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print ampaudit's version and exit.")) -> None:
    """Audit and train PyTorch models under mixed precision (fp16 / bf16 / fp8)."""


def _usage_line(exc) -> str:
    # click's own message ("No such option: --bogus", "Missing argument 'target'") and the help to read next.
    ctx = getattr(exc, "ctx", None)
    where = ctx.command_path if ctx is not None else "ampaudit"
    return f"{exc.format_message().rstrip('.')}; see '{where} --help'"


def _click():
    try:
        from typer import _click as click   # typer 0.22+ runs on its own copy of click
    except ImportError:
        import click
    return click


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point. Usage errors are one ``error:`` line on stderr and exit 2, as ours are; a
    reader that leaves early (``| head``) ends it quietly with 141 (:mod:`ampaudit.cli.pipes`)."""
    from ampaudit.cli.pipes import PipeWatch

    watch = PipeWatch()
    try:
        code = _run(list(argv if argv is not None else sys.argv[1:]))
    except BrokenPipeError:
        sys.exit(watch.exit_code(1, broke=True))
    except SystemExit as exc:       # rich and typer exit 1 on a broken pipe
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    sys.exit(watch.exit_code(code))


def _run(args: list[str]) -> int:
    click = _click()
    from ampaudit.cli import commands  # noqa: F401  registers every command on `app`

    try:
        code = app(args=bare_values(args), prog_name="ampaudit", standalone_mode=False)
    except click.exceptions.NoArgsIsHelpError as exc:   # a bare command: its help, as click would print it
        typer.echo(exc.ctx.get_help() if exc.ctx is not None else exc.format_message())
        code = 0
    except click.exceptions.UsageError as exc:
        typer.echo(f"error: {_usage_line(exc)}", err=True)
        code = 2
    except typer.Abort:     # typer's own Abort: its click copy has none
        typer.echo("error: interrupted", err=True)
        code = 130
    return code if isinstance(code, int) else 0
