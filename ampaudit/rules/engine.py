"""Run the selected rules over a propagated graph and turn their hits into findings.

    findings, suppressed = run_rules(ctx, rules)

A finding on a source line that carries ``# ampaudit: ignore`` or ``# ampaudit: ignore[AMP201,AMP101]`` is
suppressed (counted, not reported). Every hit is a finding (a module called twice has two); the report groups
repeated ones (``ampaudit.report.groups``). A hit that names a variant of its rule takes that variant's
severity, message, why and fix; a variant with severity "off" drops the hit. A rule's ``on_<device>`` variant
(``[rule.variants.on_cpu]``) takes every hit on that target device, whatever variant the hit named: the target's
hardware decides what the finding means (no Tensor Cores on a CPU).
"""
from __future__ import annotations

import linecache
import re
from pathlib import Path

from ampaudit.analysis.amp_prop import AMP_KEY
from ampaudit.graph_meta import SourceLoc, module_of, source_of
from ampaudit.errors import RuleError
from ampaudit.findings import Finding
from ampaudit.rules.loader import Rule
from ampaudit.rules.registry import MATCHERS, Hit, MatchContext, limit_fields
from ampaudit.user_code import library_path

_IGNORE_RE = re.compile(r"#\s*ampaudit:\s*ignore(?:\[([^\]]*)\])?", re.IGNORECASE)


def ignores(text: str, *rules: str) -> bool:
    """True when the source line ``text`` carries ``# ampaudit: ignore`` (every rule) or an
    ``# ampaudit: ignore[AMP201,softmax-reduced-precision]`` that lists one of ``rules`` (ids or names). The one
    reader of that syntax: check suppresses such findings, fix leaves such lines unedited. Case does not count."""
    m = _IGNORE_RE.search(text)
    if not m:
        return False
    if m.group(1) is None:
        return True
    return bool({s.strip().lower() for s in m.group(1).split(",")} & {r.lower() for r in rules})


def suppressed_by_comment(file: str | None, line: int | None, rule: Rule) -> bool:
    """True when the source line says ``# ampaudit: ignore`` (all rules) or names this rule's id or name."""
    if not file or not line:
        return False
    return ignores(linecache.getline(file, line), rule.id, rule.name)


def _variant(ctx: MatchContext, rule: Rule, hit: Hit) -> dict:
    """The overrides that apply to ``hit``: the rule's variant for the target device, else the hit's own."""
    return rule.variant(f"on_{ctx.policy.device}") or rule.variant(hit.variant)


def _finding(ctx: MatchContext, rule: Rule, hit: Hit) -> Finding:
    node = hit.node
    if node is None and hit.module is not None and hit.source is None:
        node = _first_node_of(ctx, hit.module)  # a measured finding: point at the module's first line
    info = node.meta.get(AMP_KEY) if node is not None else None
    src = hit.source or (source_of(node) if node is not None else None)
    module = hit.module if hit.module is not None else (info.module if info else "")
    op = hit.op or (info.op if info else "")
    # A detail the matcher could not measure is null in JSON and "?" in the text.
    params = {k: rule.params[k] for k in MATCHERS[rule.matcher].param_fields() if k in rule.params}
    fields = {"op": op, "module": module, "device": ctx.policy.device, "dtype": ctx.policy.dtype_name,
              "low": ctx.policy.short(), **limit_fields(ctx.policy.low), **params,
              **{k: "?" if v is None else v for k, v in hit.details.items()}}
    variant = _variant(ctx, rule, hit)
    fix_text = variant.get("fix", rule.fix)
    try:
        message = variant.get("message", rule.message).format(**fields)
        fix = fix_text.format(**fields) if fix_text else None
        why = variant.get("why", rule.why).format(**fields)
    except (KeyError, ValueError, IndexError) as exc:
        raise RuleError(f"{rule.origin}: rule {rule.id}: cannot fill its message: {exc}",
                        hint="check the {fields} of message, why and fix") from exc
    severity = variant.get("severity") or hit.severity or rule.severity
    return Finding(rule=rule.id, name=rule.name, family=rule.family, severity=severity,
                   module=module, op=op, message=message, fix=fix, why=" ".join(why.split()),
                   location=location_of(src) if src else None, details=dict(hit.details),
                   code=src.code if src else "", node=node.name if node is not None else None,
                   autofix=dict(rule.autofix), fix_nodes=[n.name for n in hit.also])


def location_of(src: SourceLoc) -> dict:
    """A finding's location: ``{"file", "line"}`` for a line of the user's (the path as captured, made relative to
    the project by :func:`relative_location`); for a line of an installed library (a transformers model's own
    code), ``{"file": "transformers/models/llama/modeling_llama.py", "line", "library": true}``: the path below
    site-packages, the same for every user, and marked, since it is not the user's to edit or to annotate (SARIF,
    GitHub and ``fix`` leave it alone: docs/locations.md)."""
    rel = library_path(src.file)
    if rel is None:
        return {"file": src.file, "line": src.line}
    return {"file": rel, "line": src.line, "library": True}


def _first_node_of(ctx: MatchContext, module: str):
    for n in ctx.gm.graph.nodes:
        if module_of(n, None) == module and source_of(n) is not None:
            return n
    return None


def run_rules(ctx: MatchContext, rules: list[Rule]) -> tuple[list[Finding], int]:
    """All findings of ``rules`` in graph order, and how many were suppressed by source comments."""
    order = {n: i for i, n in enumerate(ctx.gm.graph.nodes)}
    collected: list[tuple[int, Finding]] = []
    suppressed = 0
    for rule in rules:
        for hit in MATCHERS.load()[rule.matcher].fn(ctx, rule):
            if _variant(ctx, rule, hit).get("severity") == "off":
                continue
            f = _finding(ctx, rule, hit)
            loc = f.location or {}
            # A library's line carries no comment of the user's (and its path is no longer one to read).
            if not loc.get("library") and suppressed_by_comment(loc.get("file"), loc.get("line"), rule):
                suppressed += 1
                continue
            collected.append((order.get(hit.node, len(order)), f))
    # Static findings in graph order; measured ones (no node) after them, each family in execution order.
    collected.sort(key=lambda t: t[0])
    return [f for _, f in collected], suppressed


def untraceable(text: str, module: str | None) -> str:
    """``text`` (a fix or an instead) for a model torch.fx cannot capture: the graph rewrite's commands, which
    refuse such a model, replaced by what runs on it (rules/policy/settings.toml [recommend.untraceable])."""
    from ampaudit.policy import settings

    name = "<module>" if module is None else module       # keep_fp32(model, ['']) is the whole model
    # The top module's own ops ("" names it; None: not known) are better fixed in the source than all in fp32.
    for table in (["untraceable_top"] if module == "" else []) + ["untraceable"]:
        text = reworded(text, table, name)
    return text


def reworded(text: str, table: str, module: str = "") -> str:
    """``text`` with each phrase of rules/policy/settings.toml ``[recommend.<table>]`` replaced by its wording
    (``{module}`` in either filled with ``module``)."""
    from ampaudit.policy import settings

    for phrase, instead in settings().get("recommend", {}).get(table, {}).items():
        text = text.replace(phrase.format(module=module), instead.format(module=module))
    return text


def route_untraceable(findings: list[Finding]) -> None:
    """Each finding's fix as :func:`untraceable` words it, but for those ``fix -o`` / ``fix --pad`` still fix on
    such a model at module granularity (:func:`module_fixable`), whose commands run as recommended."""
    for f in findings:
        if f.fix and not module_fixable(f):
            f.fix = untraceable(f.fix, f.module)


def route_recorded(findings: list[Finding], gm) -> None:
    """Findings on the ops of a wrapped body recorded at the example inputs' shapes: ``fix -o`` leaves that body as
    written (its rewrite must hold for every input), so their fix texts name the source edit (``fix --diff``)
    instead, as for the top module's own ops ([recommend.untraceable_top])."""
    from ampaudit.graph_meta import recorded

    names = {n.name for n in gm.graph.nodes if recorded(n)}
    for f in findings:
        if f.fix and f.node in names:
            f.fix = reworded(f.fix, "untraceable_top", f.module)


def route_fixes(findings: list[Finding], capture_mode: str, gm) -> None:
    """Each finding's fix text as the module, the capture and the line allow: on the top module's own ops (which a
    fix naming "the module" would keep in fp32 as the whole model: [recommend.top]), on a model fx cannot trace
    (:func:`route_untraceable`), on a wrapped body recorded at the example shapes (:func:`route_recorded`), on a
    library's line (:func:`route_library`)."""
    for f in findings:
        if f.fix and f.module == "":
            f.fix = reworded(f.fix, "top")
    if capture_mode != "fx":
        route_untraceable(findings)
    else:
        route_recorded(findings, gm)
    route_library(findings)


def route_library(findings: list[Finding]) -> None:
    """Findings on an installed library's line: the fix texts that name ``fix --diff`` (which never edits a library's
    file) name the edit the user can make instead (rules/policy/settings.toml [recommend.library])."""
    for f in findings:
        if f.fix and f.library:
            f.fix = reworded(f.fix, "library")


def module_fixable(f: Finding) -> bool:
    """True when the fix of a model torch.fx cannot trace (ampaudit.rewrite.module_fix) covers ``f``: an island
    finding in a submodule (that module runs in fp32), a pad finding on a layer kind it pads
    (rules/policy/settings.toml [recommend.module_fix])."""
    from ampaudit.policy import settings

    kind = f.autofix.get("kind")
    if kind == "island":
        return bool(f.module)
    pads = settings().get("recommend", {}).get("module_fix", {}).get("pad_ops", [])
    return kind == "pad" and bool(f.module) and f.op in pads


def relative_location(f: Finding, base: Path) -> None:
    """Rewrite the finding's file path relative to ``base`` when it lies below it (stable in reports and SARIF).
    A library's location is already relative (to site-packages)."""
    if not f.location or f.location.get("library"):
        return
    try:
        f.location["file"] = str(Path(f.location["file"]).resolve().relative_to(base.resolve()))
    except ValueError:
        pass
