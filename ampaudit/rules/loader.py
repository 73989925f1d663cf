"""Rules as data: load and validate ``rules/*.toml`` (and a user's ``--rules DIR``).

    rules = load_rules()                       # the built-in rules, validated
    rules = load_rules(extra_dirs=["my_rules"])
    rule = find_rule(rules, "AMP201")          # by id or name

A rule file holds ``[[rule]]`` tables (the keys: :mod:`ampaudit.rules.schema`, which checks each completely),
and may hold two tables for its rules to share:

    [op_sets]                       # named op lists; a rule's op-list parameter names one as "@losses"
    losses = ["cross_entropy", "nll_loss"]

    [params.constants]              # parameters every rule of this file with matcher "constants" reads,
    ops = ["add", "masked_fill"]    # unless it sets its own

Op sets are shared by all loaded files, so a ``--rules DIR`` file may use the built-in ones or add its own. Rule
ids, names and selectors are case-insensitive. Anything malformed is a :class:`RuleError` naming the file, the
rule and the key.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ampaudit.errors import RuleError
from ampaudit.policy import read_toml, rules_dir
# The rule files, selectors and lookup by id need no matcher: they live in ampaudit.rule_index (no torch).
from ampaudit.rule_index import find_rule, rule_files, validate_selectors  # noqa: F401
from ampaudit.rule_index import names_rule as _names
from ampaudit.rules.registry import OPS, load_builtin_matchers
from ampaudit.rules.schema import check_param, check_required, check_rule

FILE_KEYS = ("rule", "op_sets", "params")


@dataclass(frozen=True)
class Rule:
    id: str
    name: str
    family: str
    severity: str
    matcher: str
    message: str
    why: str
    fix: str | None = None
    references: tuple[str, ...] = ()
    params: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)
    origin: str = ""

    def param(self, key: str, default: Any = None) -> Any:
        return self.params.get(key, default)

    @property
    def autofix(self) -> dict:
        """``{"kind": ..., "safety": ..., **fixer parameters}``; kind "none" when fix leaves the rule alone."""
        return self.params.get("autofix", {"kind": "none"})

    @property
    def source_fix(self) -> dict:
        """``{"kind": ..., "safety": ..., **fixer parameters}`` for ``fix --diff/--write``; kind "none" when it
        leaves the rule's findings alone."""
        return self.params.get("source_fix", {"kind": "none"})

    def variant(self, name: str | None) -> dict:
        """The overrides of variant ``name`` (``{}`` for None or a name the rule does not define)."""
        return self.params.get("variants", {}).get(name, {}) if name else {}

    def as_dict(self) -> dict:
        return {"id": self.id, "name": self.name, "family": self.family, "severity": self.severity,
                "message": self.message, "why": self.why, "fix": self.fix, "references": list(self.references),
                "matcher": self.matcher, **{k: v for k, v in self.params.items()}}


def _rule_of(raw: dict, where: str, matchers, shared: dict, op_sets: dict) -> Rule:
    at = f"{where}: rule {raw.get('id', '?')}"
    check_required(raw, at)
    m = matchers.get(raw["matcher"])
    if m is None:
        raise RuleError(f"{at}: key 'matcher' names unknown matcher {raw['matcher']!r}",
                        hint=f"use one of {', '.join(sorted(matchers))}")
    raw = {**shared.get(m.name, {}), **raw}
    params = check_rule(raw, at, m)
    for key, spec in m.params.items():
        if spec == OPS and key in params:
            params[key] = _expand(params[key], op_sets, f"{at}: key {key!r}")
    return Rule(id=raw["id"], name=raw["name"], family=raw["family"], severity=raw["severity"], matcher=raw["matcher"],
                message=raw["message"], why=raw["why"], fix=raw.get("fix"), references=tuple(raw.get("references", [])),
                params=params, origin=where)


def _expand(ops: list[str], op_sets: dict[str, tuple[list[str], str]], at: str) -> list[str]:
    """``ops`` with each "@set" replaced by that op set's ops, in order, without repeats."""
    out: list[str] = []
    for op in ops:
        if op.startswith("@"):
            if op[1:] not in op_sets:
                raise RuleError(f"{at} names unknown op set {op!r}",
                                hint="define it in a rule file's [op_sets]: " + (", ".join(sorted(op_sets)) or "none yet"))
            members = op_sets[op[1:]][0]
        else:
            members = [op]
        out += [o for o in members if o not in out]
    return out


def _file_tables(path: Path, data: dict, matchers, op_sets: dict) -> dict:
    """Check a rule file's top-level keys, add its ``[op_sets]`` to ``op_sets``; its ``[params.<matcher>]``."""
    for key in data:
        if key not in FILE_KEYS:
            raise RuleError(f"{path.name}: unknown top-level key {key!r}",
                            hint="a rule file holds [[rule]] tables, [op_sets] and [params.<matcher>]")
    if not isinstance(data.get("rule", []), list) or not all(isinstance(r, dict) for r in data.get("rule", [])):
        raise RuleError(f"{path.name}: 'rule' must be an array of tables ([[rule]])", hint="fix the rule file")
    for key in ("op_sets", "params"):
        if not isinstance(data.get(key, {}), dict):
            raise RuleError(f"{path.name}: {key!r} must be a table ([{key}])", hint="fix the rule file")
    for name, ops in data.get("op_sets", {}).items():
        if name in op_sets:
            raise RuleError(f"{path.name}: op set {name!r} already defined in {op_sets[name][1]}",
                            hint="give each op set a unique name")
        check_param(ops, OPS, f"{path.name}: op_sets", name)
        op_sets[name] = (ops, path.name)
    shared = data.get("params", {})
    for name, table in shared.items():
        m = matchers.get(name)
        if m is None or not isinstance(table, dict):
            raise RuleError(f"{path.name}: [params.{name}] names no matcher", hint=f"use one of {', '.join(sorted(matchers))}")
        for key, value in table.items():
            if key not in m.params:
                raise RuleError(f"{path.name}: [params.{name}]: unknown key {key!r}",
                                hint=f"matcher {name} reads " + (", ".join(sorted(m.params)) or "no parameters"))
            check_param(value, m.params[key], f"{path.name}: [params.{name}]", key)
    return shared


def load_rules(extra_dirs: list[str | Path] = ()) -> list[Rule]:
    """The built-in rules plus those in ``extra_dirs``; ids and names must be unique (whatever their case)."""
    matchers = load_builtin_matchers()
    files = [(path, read_toml(path)) for folder in [rules_dir(), *map(Path, extra_dirs)] for path in rule_files(folder)]
    op_sets: dict[str, tuple[list[str], str]] = {}
    shared = {path: _file_tables(path, data, matchers, op_sets) for path, data in files}
    rules: list[Rule] = []
    seen: dict[str, str] = {}
    for path, data in files:
        for raw in data.get("rule", []):
            rule = _rule_of(raw, path.name, matchers, shared[path], op_sets)
            for key in (rule.id.upper(), rule.name.lower()):
                if key in seen:
                    raise RuleError(f"{path.name}: rule {rule.id}: {key!r} already defined in {seen[key]}",
                                    hint="give each rule a unique id and name (case does not count)")
                seen[key] = path.name
            rules.append(rule)
    return rules


def rule_selected(rule: Rule, select: list[str] | None, ignore: list[str] | None) -> bool:
    """ruff-style selection: a code, a code prefix (AMP2), a rule name or a family name, in any case; ALL."""

    def matches(sel: str) -> bool:
        return sel.strip().upper() == "ALL" or _names(rule, sel)

    if select and not any(matches(s) for s in select):
        return False
    return not (ignore and any(matches(s) for s in ignore))
