"""Where ampaudit's data lives (the rules/ folder) and how its TOML is read; no torch, so a command can check its
arguments against the data before the heavy work.

    rules_dir() / "policy" / "ops.toml"     # the packaged rules/ (a wheel's _rules/, or a checkout's rules/)
    read_toml(path)                         # a dict, or a RuleError naming the file: missing, not TOML, not text
"""
from __future__ import annotations

import tomllib
from pathlib import Path

from ampaudit.errors import RuleError


def rules_dir() -> Path:
    """The packaged rules/ folder (inside the wheel) or the repository's rules/ (source checkout, editable)."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "_rules", here.parent / "rules"):
        if (candidate / "policy" / "ops.toml").is_file():
            return candidate
    raise RuleError("ampaudit's rules/ data folder is missing", hint="reinstall ampaudit")


def read_toml(path: Path) -> dict:
    """Parse a TOML file; a syntax error becomes a RuleError naming the file and line."""
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError as exc:
        raise RuleError(f"rule file not found: {path}", hint="check --rules") from exc
    except tomllib.TOMLDecodeError as exc:
        raise RuleError(f"{path.name}: invalid TOML: {exc}", hint="fix the file") from exc
    except UnicodeDecodeError as exc:       # tomllib reads UTF-8 only; a binary file is not a rule file
        raise RuleError(f"{path.name}: not UTF-8 text ({exc.reason} at byte {exc.start})",
                        hint="save it as UTF-8 TOML, or move it out of the folder") from exc
    except IsADirectoryError as exc:
        raise RuleError(f"{path.name} is a folder, not a TOML file", hint="rename it, or move it out of the folder") from exc
