"""What a rule entry may say, checked completely at load: one :class:`RuleError` naming the file, rule and key.

    check_rule(raw, "sensitive_ops.toml", matcher)   # raises RuleError, or returns the rule's parameters

A rule entry (``[[rule]]`` in rules/*.toml) has the keys of :data:`REQUIRED` and :data:`OPTIONAL`, and the
parameters its matcher declares (``ampaudit.rules.registry.matcher``: a type, or a tuple of the allowed values,
so ``check = "overflw"`` is refused). Its variants are ones the matcher's hits name, or ``on_<device>``; its
message, why and fix use only fields the matcher provides, and no format spec on a field that can be unknown
("?"). ``autofix`` and ``source_fix`` name a fix kind of rules/policy/fixes.toml (the kinds the fixers of
ampaudit/rewrite/fixers.py and ampaudit/sourcefix/ register) with its safety and only the parameters that fixer
reads. ``docs`` is the rule's page
(ampaudit/docs_gen.py): what it checks, an example that fires and the same code fixed.
"""
from __future__ import annotations

import string
from functools import lru_cache
from typing import Any

from ampaudit.errors import RuleError
from ampaudit.policy import DEVICES, read_toml, rules_dir
from ampaudit.rule_index import FAMILIES  # noqa: F401  (defined there: selectors read it without torch)
from ampaudit.rules.registry import OPS

SEVERITIES = ("info", "warning", "error")
REQUIRED = {"id": str, "name": str, "family": str, "severity": str, "matcher": str, "message": str, "why": str}
OPTIONAL = {"fix": str, "references": list, "variants": dict, "autofix": dict, "source_fix": dict, "docs": dict}
# How ``ampaudit fix`` treats a rule's findings: ``kind`` names a registered fixer (ampaudit/rewrite/fixers.py) or
# "none"; ``safety`` is ruff's: safe fixes leave FP32 results unchanged, unsafe ones may change them.
# ``source_fix`` says the same for ``ampaudit fix --diff/--write``, which edits the user's own files: ``kind``
# names a registered source fixer (ampaudit/sourcefix/) or "none", and the rest are that fixer's parameters
# (``info = true``: its info findings are edited too).
SAFETIES = ("safe", "unsafe")
# slot: (the keys every kind reads, an example kind, what it does)
FIX_SLOTS = {"autofix": ({"kind", "safety"}, "island", "fix"),
             "source_fix": ({"kind", "safety", "info"}, "upcast_op", "edit")}


@lru_cache(maxsize=None)
def fix_kinds() -> dict[str, dict[str, frozenset[str]]]:
    """``{"autofix": {kind: parameters}, "source_fix": {...}}`` from rules/policy/fixes.toml."""
    data = read_toml(rules_dir() / "policy" / "fixes.toml")
    return {slot: {kind: frozenset(params) for kind, params in data.get(slot, {}).items()} for slot in FIX_SLOTS}
# What a variant (``[rule.variants.NAME]``) may override; severity "off" drops the hit.
VARIANT_KEYS = {"severity": str, "message": str, "why": str, "fix": str}
DOCS_KEYS = ("what", "example", "fixed")
TEMPLATE_KEYS = ("message", "fix", "why")


def _type_name(spec: Any) -> str:
    if spec == OPS:
        return "list of op names"
    if isinstance(spec, tuple):
        return "one of " + ", ".join(repr(v) for v in spec)
    return spec.__name__


def check_param(value: Any, spec: Any, at: str, key: str) -> None:
    """``value`` of parameter ``key`` against the matcher's declaration ``spec``."""
    if spec == OPS:
        ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
    elif isinstance(spec, tuple):
        ok = value in spec
    elif spec is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    else:
        ok = isinstance(value, spec) and not (spec is int and isinstance(value, bool))
    if not ok and isinstance(spec, tuple):
        raise RuleError(f"{at}: key {key!r} is {value!r}", hint="use " + _type_name(spec))
    if not ok:
        name = _type_name(spec)
        raise RuleError(f"{at}: key {key!r} is {value!r}, not {'an' if name[0] in 'aeiou' else 'a'} {name}",
                        hint="fix the rule file")


def check_required(raw: dict, at: str) -> None:
    """The keys every rule entry has, with their types (``at``: "file: rule ID")."""
    for key, typ in REQUIRED.items():
        if key not in raw:
            raise RuleError(f"{at}: missing key {key!r}", hint="every rule needs " + ", ".join(REQUIRED))
        if not isinstance(raw[key], typ):
            raise RuleError(f"{at}: key {key!r} must be a {typ.__name__}", hint="fix the rule file")


def check_rule(raw: dict, at: str, m) -> dict:
    """Every key of the rule entry ``raw`` against ``m``, its matcher (:func:`check_required` passed); the rule's
    parameters (every key but the required ones, fix and references)."""
    params = {}
    for key, value in raw.items():
        if key in REQUIRED:
            continue
        if key in OPTIONAL:
            if not isinstance(value, OPTIONAL[key]):
                raise RuleError(f"{at}: key {key!r} must be a {OPTIONAL[key].__name__}", hint="fix the rule file")
        elif key in m.params:
            check_param(value, m.params[key], at, key)
        else:
            raise RuleError(f"{at}: unknown key {key!r}",
                            hint=f"matcher {m.name} reads " + (", ".join(sorted(m.params)) or "no parameters")
                            + "; every rule may set " + ", ".join(OPTIONAL))
        if key not in ("fix", "references"):
            params[key] = value
    if raw["family"] not in FAMILIES:
        raise RuleError(f"{at}: key 'family' is {raw['family']!r}", hint=f"use one of {', '.join(FAMILIES)}")
    if raw["severity"] not in SEVERITIES:
        raise RuleError(f"{at}: key 'severity' is {raw['severity']!r}", hint=f"use one of {', '.join(SEVERITIES)}")
    fields = m.fields | (m.param_fields() & set(raw))     # the rule's own scalar parameters, where it sets them
    check_templates(raw, at, m, fields)
    for slot in FIX_SLOTS:
        check_fix(raw, slot, at)
    for name, variant in raw.get("variants", {}).items():
        check_variant(name, variant, at, m, fields)
    if "docs" in raw:
        check_docs(raw["docs"], at)
    missing = sorted(m.required - set(raw))
    if missing:
        raise RuleError(f"{at}: missing key {missing[0]!r}, a parameter matcher {m.name} needs",
                        hint=f"set it in the rule or in the file's [params.{m.name}]; {m.name} needs "
                             + ", ".join(sorted(m.required)))
    return params


def check_variant(name: str, variant: Any, at: str, m, fields: frozenset[str]) -> None:
    at = f"{at}: variant {name!r}"
    allowed = sorted(m.variants) + [f"on_{d}" for d in DEVICES]
    if name not in allowed:
        raise RuleError(f"{at}: matcher {m.name} names no such variant",
                        hint="use one of " + ", ".join(allowed))
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
    check_templates(variant, at, m, fields)


def check_templates(raw: dict, at: str, m, known: frozenset[str]) -> None:
    """Each ``{field}`` of message, why and fix is one of ``known`` (what ``m`` provides, and the rule's scalar
    parameters); a field ``m`` may leave unknown ("?") takes no format spec (``{depth:d}`` would raise on "?")."""
    for key in TEMPLATE_KEYS:
        if key not in raw:
            continue
        try:
            parsed = [(f, spec, conv) for _, f, spec, conv in string.Formatter().parse(raw[key]) if f]
        except ValueError as exc:
            raise RuleError(f"{at}: key {key!r} is not a valid template: {exc}",
                            hint="escape braces as {{ and }}") from exc
        unknown = sorted({_field(f) for f, _, _ in parsed} - known)
        if unknown:
            raise RuleError(f"{at}: key {key!r} uses unknown field(s) {unknown}",
                            hint=f"matcher {m.name} provides: {', '.join(sorted(known))}")
        for f, spec, conv in parsed:
            if conv not in (None, "r", "s", "a"):
                raise RuleError(f"{at}: key {key!r} converts {{{f}!{conv}}}", hint="use !r, !s or !a, or none")
            if _field(f) in m.nullable and (spec or conv):
                raise RuleError(f"{at}: key {key!r} formats {{{f}{'!' + conv if conv else ''}"
                                f"{':' + spec if spec else ''}}}, a field matcher {m.name} may leave unknown ('?')",
                                hint=f"write {{{_field(f)}}} without a format spec")


def _field(name: str) -> str:
    return name.split(".")[0].split("[")[0]


def check_fix(raw: dict, slot: str, at: str) -> None:
    """A rule's ``autofix`` / ``source_fix`` table: a registered kind, a safety unless the kind is "none", and only
    the parameters that fixer reads."""
    common, example, what = FIX_SLOTS[slot]
    entry = raw.get(slot, {"kind": "none"})
    kinds = fix_kinds()[slot]
    kind = entry.get("kind")
    if not isinstance(kind, str):
        raise RuleError(f"{at}: key '{slot}' needs a kind",
                        hint=f'e.g. {slot} = {{kind = "{example}", safety = "safe"}}, or {{kind = "none"}}')
    if kind != "none" and kind not in kinds:
        raise RuleError(f"{at}: key '{slot}.kind' is {kind!r}",
                        hint=f'use one of {", ".join(sorted(kinds))} or "none", e.g. {slot} = '
                             f'{{kind = "{example}", safety = "safe"}}')
    if kind == "none":
        extra = sorted(set(entry) - {"kind"})
        if extra:
            raise RuleError(f"{at}: key '{slot}.{extra[0]}' is set, but kind is \"none\"", hint="remove it")
        return
    if entry.get("safety") not in SAFETIES:
        raise RuleError(f"{at}: key '{slot}' needs safety = \"safe\" or \"unsafe\"",
                        hint=f"safe: the {what} leaves FP32 results unchanged; unsafe: it may change them")
    allowed = common | kinds[kind]
    extra = sorted(set(entry) - allowed)
    if extra:
        raise RuleError(f"{at}: key '{slot}.{extra[0]}' is not a parameter of {what} kind {kind!r}",
                        hint=f"{kind} reads " + ", ".join(sorted(allowed)))


def check_docs(docs: dict, at: str) -> None:
    missing = [k for k in DOCS_KEYS if not isinstance(docs.get(k), str)]
    extra = sorted(set(docs) - set(DOCS_KEYS))
    if missing or extra:
        what = f"needs string key(s) {', '.join(missing)}" if missing else f"has unknown key {extra[0]!r}"
        raise RuleError(f"{at}: table 'docs' {what}", hint="[rule.docs] holds what, example and fixed")
