"""Which rules exist, read from the rule files without a matcher (or torch): a bad ``--select``, ``--ignore`` or
rule id is refused before the heavy work starts.

    keys = rule_keys(["my_rules"])        # [RuleKey(id="AMP101", name=..., family="alignment"), ...]
    validate_selectors(keys, ["AMP9"], "--select")    # a RuleError: '--select 'AMP9' matches no rule'
    find_rule(keys, "amp201")             # by id or name, any case

The selectors and the lookup take anything with ``id``, ``name`` and ``family``: these keys, or the validated
:class:`~ampaudit.rules.loader.Rule` objects (which :func:`ampaudit.rules.loader.load_rules` builds and checks
completely; a malformed file is its error to report, so its entries are skipped here).
"""
from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from ampaudit.datafiles import read_toml, rules_dir
from ampaudit.errors import RuleError

FAMILIES = ("alignment", "sensitive-op", "normalization", "constant", "range", "nonfinite", "divergence", "swamping",
            "precursor")


class RuleKey(NamedTuple):
    id: str
    name: str
    family: str


def rule_files(folder: Path) -> list[Path]:
    """The ``*.toml`` rule files of ``folder``, sorted; a RuleError when it is not a folder."""
    if not folder.is_dir():
        raise RuleError(f"rules folder not found: {folder}", hint="pass an existing folder to --rules")
    # rules/*.toml holds rules (with their op sets and shared parameters); run-wide tables live in rules/policy/.
    return sorted(folder.glob("*.toml"))


def rule_keys(extra_dirs: list[str | Path] = ()) -> list[RuleKey]:
    """The id, name and family of each built-in rule and of those in ``extra_dirs``."""
    keys = []
    for folder in [rules_dir(), *map(Path, extra_dirs)]:
        for path in rule_files(folder):
            entries = read_toml(path).get("rule", [])
            for raw in entries if isinstance(entries, list) else []:
                if isinstance(raw, dict) and all(isinstance(raw.get(k), str) for k in RuleKey._fields):
                    keys.append(RuleKey(raw["id"], raw["name"], raw["family"]))
    return keys


def names_rule(rule, sel: str) -> bool:
    """True when ``sel`` is the rule's id or a prefix of it (AMP2), its name, or its family; any case."""
    sel = sel.strip()
    return bool(sel) and (rule.id.upper().startswith(sel.upper()) or sel.lower() in (rule.name.lower(), rule.family))


def find_rule(rules: list, key: str):
    """The rule whose id or name is ``key`` (any case), or a RuleError."""
    for rule in rules:
        if key.strip().upper() == rule.id.upper() or key.strip().lower() == rule.name.lower():
            return rule
    raise RuleError(f"unknown rule {key!r}", hint="list the rules with: ampaudit rules")


def validate_selectors(rules: list, selectors: list[str] | None, option: str) -> None:
    """Each --select/--ignore entry must name something, so a typo is an error and not a silent no-op."""
    for sel in selectors or []:
        sel = sel.strip()
        if sel.upper() == "ALL" or sel.lower() in FAMILIES:
            continue
        if not any(names_rule(r, sel) for r in rules):
            raise RuleError(f"{option} {sel!r} matches no rule", hint="see ampaudit rules for ids, names and families")
