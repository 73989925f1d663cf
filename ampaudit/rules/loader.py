"""Rules as data: load and validate ``rules/*.toml`` (and a user's ``--rules DIR``).

    rules = load_rules()                       # the built-in rules, validated
    rules = load_rules(extra_dirs=["my_rules"])
    rule = find_rule(rules, "AMP201")          # by id or name

A rule file holds ``[[rule]]`` tables with keys id, name, family, severity, matcher, message, why, fix,
references, and whatever parameters its matcher reads (``ops = [...]``, ``upcast_severity``, ``check``). Anything
malformed is a :class:`RuleError` naming the file, the rule and the key.
"""
from __future__ import annotations

import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ampaudit.errors import RuleError
from ampaudit.policy import read_toml, rules_dir
from ampaudit.rules.registry import load_builtin_matchers

FAMILIES = ("alignment", "sensitive-op", "normalization", "constant", "range", "nonfinite", "divergence")
SEVERITIES = ("info", "warning", "error")
REQUIRED = {"id": str, "name": str, "family": str, "severity": str, "matcher": str, "message": str, "why": str}
OPTIONAL = {"fix": str, "references": list, "upcast_severity": str, "ops": list, "check": str, "reduction": bool,
            "variants": dict, "min_share": float, "autofix": dict, "source_fix": dict}
# How ``ampaudit fix`` treats a rule's findings: ``kind`` names a registered fixer (ampaudit/rewrite/fixers.py) or
# "none"; ``safety`` is ruff's: safe fixes leave FP32 results unchanged, unsafe ones may change them.
# ``source_fix`` says the same for ``ampaudit fix --diff/--write``, which edits the user's own files: ``kind``
# names a registered source fixer (ampaudit/sourcefix/) or "none", and the rest are that fixer's parameters.
SAFETIES = ("safe", "unsafe")
# What a variant (``[rule.variants.NAME]``) may override; severity "off" drops the hit.
VARIANT_KEYS = {"severity": str, "message": str, "why": str, "fix": str}


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


def _placeholders(template: str) -> set[str]:
    return {fname.split(".")[0].split("[")[0] for _, fname, _, _ in string.Formatter().parse(template) if fname}


def _fix_entry(raw: dict, key: str, at: str, *, example: str, what: str) -> dict:
    """A rule's ``autofix`` / ``source_fix`` table: a kind, and a safety unless the kind is "none"."""
    entry = raw.get(key, {"kind": "none"})
    if not isinstance(entry.get("kind"), str):
        raise RuleError(f"{at}: key {key!r} needs a kind",
                        hint=f'e.g. {key} = {{kind = "{example}", safety = "safe"}}, or {{kind = "none"}}')
    if entry["kind"] != "none" and entry.get("safety") not in SAFETIES:
        raise RuleError(f"{at}: key {key!r} needs safety = \"safe\" or \"unsafe\"",
                        hint=f"safe: the {what} leaves FP32 results unchanged; unsafe: it may change them")
    return entry


def _validate(raw: dict, where: str, matchers: dict) -> Rule:
    rid = raw.get("id", "?")
    for key, typ in REQUIRED.items():
        if key not in raw:
            raise RuleError(f"{where}: rule {rid}: missing key {key!r}", hint="every rule needs " + ", ".join(REQUIRED))
        if not isinstance(raw[key], typ):
            raise RuleError(f"{where}: rule {rid}: key {key!r} must be a {typ.__name__}", hint="fix the rule file")
    for key, value in raw.items():
        if key in OPTIONAL and not isinstance(value, OPTIONAL[key]):
            raise RuleError(f"{where}: rule {rid}: key {key!r} must be a {OPTIONAL[key].__name__}",
                            hint="fix the rule file")
        if key not in REQUIRED and key not in OPTIONAL:
            raise RuleError(f"{where}: rule {rid}: unknown key {key!r}",
                            hint="allowed keys: " + ", ".join([*REQUIRED, *OPTIONAL]))
    if raw["family"] not in FAMILIES:
        raise RuleError(f"{where}: rule {rid}: key 'family' is {raw['family']!r}", hint=f"use one of {', '.join(FAMILIES)}")
    for key in ("severity", "upcast_severity"):
        if key in raw and raw[key] not in SEVERITIES + (("off",) if key == "upcast_severity" else ()):
            raise RuleError(f"{where}: rule {rid}: key {key!r} is {raw[key]!r}", hint=f"use one of {', '.join(SEVERITIES)}")
    m = matchers.get(raw["matcher"])
    if m is None:
        raise RuleError(f"{where}: rule {rid}: key 'matcher' names unknown matcher {raw['matcher']!r}",
                        hint=f"use one of {', '.join(sorted(matchers))}")
    _check_templates(raw, f"{where}: rule {rid}", m)
    _fix_entry(raw, "autofix", f"{where}: rule {rid}", example="island", what="fix")
    _fix_entry(raw, "source_fix", f"{where}: rule {rid}", example="upcast_op", what="edit")
    for name, variant in raw.get("variants", {}).items():
        at = f"{where}: rule {rid}: variant {name!r}"
        if not isinstance(variant, dict):
            raise RuleError(f"{at} must be a table", hint=f"write [rule.variants.{name}] with keys "
                            + ", ".join(VARIANT_KEYS))
        for key, value in variant.items():
            if key not in VARIANT_KEYS or not isinstance(value, VARIANT_KEYS[key]):
                raise RuleError(f"{at}: key {key!r} is not allowed or not a string",
                                hint="a variant may set " + ", ".join(VARIANT_KEYS))
        if variant.get("severity", "info") not in SEVERITIES + ("off",):
            raise RuleError(f"{at}: key 'severity' is {variant['severity']!r}",
                            hint=f"use one of {', '.join(SEVERITIES)} or off")
        _check_templates(variant, at, m)
    params = {k: v for k, v in raw.items() if k not in REQUIRED and k not in ("fix", "references")}
    return Rule(id=raw["id"], name=raw["name"], family=raw["family"], severity=raw["severity"], matcher=raw["matcher"],
                message=raw["message"], why=raw["why"], fix=raw.get("fix"), references=tuple(raw.get("references", [])),
                params=params, origin=where)


def _check_templates(raw: dict, at: str, m) -> None:
    for key in ("message", "fix", "why"):
        if key in raw:
            try:
                unknown = _placeholders(raw[key]) - m.fields
            except ValueError as exc:
                raise RuleError(f"{at}: key {key!r} is not a valid template: {exc}",
                                hint="escape braces as {{ and }}") from exc
            if unknown:
                raise RuleError(f"{at}: key {key!r} uses unknown field(s) {sorted(unknown)}",
                                hint=f"matcher {m.name} provides: {', '.join(sorted(m.fields))}")


def _rule_files(folder: Path) -> list[Path]:
    if not folder.is_dir():
        raise RuleError(f"rules folder not found: {folder}", hint="pass an existing folder to --rules")
    # rules/*.toml holds rules only; the tables the matchers read live in rules/policy/.
    return sorted(folder.glob("*.toml"))


def load_rules(extra_dirs: list[str | Path] = ()) -> list[Rule]:
    """The built-in rules plus those in ``extra_dirs``; ids and names must be unique."""
    matchers = load_builtin_matchers()
    rules: list[Rule] = []
    seen: dict[str, str] = {}
    for folder in [rules_dir(), *map(Path, extra_dirs)]:
        for path in _rule_files(folder):
            data = read_toml(path)
            entries = data.get("rule", [])
            if not isinstance(entries, list):
                raise RuleError(f"{path.name}: 'rule' must be an array of tables ([[rule]])", hint="fix the rule file")
            for raw in entries:
                rule = _validate(raw, path.name, matchers)
                for key in (rule.id, rule.name):
                    if key in seen:
                        raise RuleError(f"{path.name}: rule {rule.id}: {key!r} already defined in {seen[key]}",
                                        hint="give each rule a unique id and name")
                    seen[key] = path.name
                rules.append(rule)
    return rules


def find_rule(rules: list[Rule], key: str) -> Rule:
    for rule in rules:
        if key in (rule.id, rule.name) or key.upper() == rule.id:
            return rule
    raise RuleError(f"unknown rule {key!r}", hint="list the rules with: ampaudit rules")


def rule_selected(rule: Rule, select: list[str] | None, ignore: list[str] | None) -> bool:
    """ruff-style selection: a code, a code prefix (AMP2), a rule name or a family name."""

    def matches(sel: str) -> bool:
        sel = sel.strip()
        return bool(sel) and (rule.id.startswith(sel.upper()) or sel in (rule.name, rule.family) or sel == "ALL")

    if select and not any(matches(s) for s in select):
        return False
    return not (ignore and any(matches(s) for s in ignore))


def validate_selectors(rules: list[Rule], selectors: list[str] | None, option: str) -> None:
    """Each --select/--ignore entry must name something, so a typo is an error and not a silent no-op."""
    for sel in selectors or []:
        sel = sel.strip()
        if sel == "ALL" or sel in FAMILIES:
            continue
        if not any(r.id.startswith(sel.upper()) or r.name == sel for r in rules):
            raise RuleError(f"{option} {sel!r} matches no rule", hint="see ampaudit rules for ids, names and families")
