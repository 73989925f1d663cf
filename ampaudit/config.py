"""``[tool.ampaudit]`` in pyproject.toml: project defaults for check (command-line options win).

    [tool.ampaudit]
    device = "cuda"
    dtype = "bfloat16"
    select = ["AMP1", "sensitive-op"]
    ignore = ["AMP403"]
    fail-on = "error"
    rules = ["tools/amp_rules"]      # relative to pyproject.toml

    cfg = load_config(start=Path("models/net.py"))     # nearest pyproject.toml upward from start, else cwd
"""
from __future__ import annotations

import tomllib
from pathlib import Path

from ampaudit.errors import ConfigError

KEYS = {"device": str, "dtype": str, "select": list, "ignore": list, "fail-on": str, "rules": list, "format": str}


def find_pyproject(start: Path | None) -> Path | None:
    folders = []
    if start is not None:
        start = start.resolve()
        folders += [start] if start.is_dir() else []
        folders += list(start.parents)
    folders += [Path.cwd().resolve(), *Path.cwd().resolve().parents]
    for folder in folders:
        candidate = folder / "pyproject.toml"
        if candidate.is_file():
            return candidate
    return None


def load_config(start: Path | None = None, path: Path | None = None) -> dict:
    """The ``[tool.ampaudit]`` table (keys normalized to underscores), with ``rules`` made absolute."""
    path = path or find_pyproject(start)
    if path is None:
        return {}
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:     # tomllib reads UTF-8 only
        raise ConfigError(f"{path}: invalid TOML: {exc}", hint="fix pyproject.toml") from exc
    table = data.get("tool", {}).get("ampaudit", {})
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: [tool.ampaudit] must be a table", hint="fix pyproject.toml")
    out = {}
    for key, value in table.items():
        if key not in KEYS:
            raise ConfigError(f"{path}: [tool.ampaudit] has unknown key {key!r}", hint=f"allowed: {', '.join(KEYS)}")
        if not isinstance(value, KEYS[key]):
            raise ConfigError(f"{path}: [tool.ampaudit] key {key!r} must be a {KEYS[key].__name__}",
                              hint="fix pyproject.toml")
        out[key.replace("-", "_")] = value
    if "rules" in out:
        out["rules"] = [str((path.parent / r).resolve()) for r in out["rules"]]
    return out
