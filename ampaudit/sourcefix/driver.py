"""Plan the source edits for an audit's findings: pick each finding's fixer by its rule's ``source_fix`` kind,
run it on the current parse of the file, apply expression edits at once and block edits last (bottom of the
file first, so lines above stay put), and keep what could not be fixed with the reason.

    plan = plan_edits(aud, model, rules, args=args, kwargs=kwargs, unsafe=False)
    plan.texts            # {path: new source}; unchanged files are absent
    plan.edits, plan.refusals, plan.skipped_unsafe, plan.deferred

Nothing is written here: ``ampaudit.sourcefix.api`` verifies a plan and writes it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from ampaudit.findings import SEVERITY_RANK, Finding
from ampaudit.rules.engine import ignores
from ampaudit.sourcefix.cst_tools import Source
from ampaudit.sourcefix.registry import Edit, FixContext, Refusal, keep_fp32_instead, load_builtin_fixers
from ampaudit.user_code import is_user_file

# The measured rules' fixer: the module runs in fp32. It waits when a static fix in the same module may already
# remove the fault (verification then measures again and runs it only if the fault is still there).
MODULE_KIND = "fp32_module"


@dataclass
class Plan:
    texts: dict[str, str] = field(default_factory=dict)          # path -> edited source
    originals: dict[str, str] = field(default_factory=dict)      # path -> source before
    edits: list[Edit] = field(default_factory=list)
    refusals: list[Refusal] = field(default_factory=list)
    skipped_unsafe: list[Edit] = field(default_factory=list)
    deferred: list[Finding] = field(default_factory=list)        # measured findings left to verification

    @property
    def changed(self) -> dict[str, str]:
        return {p: t for p, t in self.texts.items() if t != self.originals.get(p)}


def is_library_file(path: str | Path) -> bool:
    """Code that is not the user's (an installed package's, torch's, ampaudit's, Python's): never edited."""
    return not is_user_file(str(path))


def wanted(f: Finding, params: dict, named: frozenset[str] | set[str] = frozenset()) -> bool:
    """The findings fix acts on: warnings and errors, and the info findings of a rule whose source_fix opts in
    (``info = true``) or that ``named`` holds (see :func:`named_rules`)."""
    if f.location is None:
        return False
    return SEVERITY_RANK[f.severity] >= SEVERITY_RANK["warning"] or bool(params.get("info")) or f.rule in named


def named_rules(rules, select) -> frozenset[str]:
    """Ids of the rules ``select`` names by id or name (not by prefix or family): asking for a rule itself asks
    for its info findings too (``fix --select AMP201 --diff`` edits the softmaxes a plain fix leaves alone)."""
    asked = {s.strip() for s in select or () if s and s.strip()}
    return frozenset(r.id for r in rules if r.id in asked or r.name in asked)


def source_fix_of(rule) -> dict:
    return rule.source_fix if rule is not None else {"kind": "none"}


def plan_edits(aud, model: nn.Module, rules, *, args: tuple = (), kwargs: dict | None = None,
               texts: dict[str, str] | None = None, unsafe: bool = False,
               canon: Callable[[str], str] = lambda p: p, inputs: dict | None = None,
               only: Callable[[Finding], bool] | None = None, named: frozenset[str] = frozenset()) -> Plan:
    """Edits for the findings of ``aud`` (an ampaudit.api.Audit of ``model``).

    ``texts`` starts files from given sources (a second round starts from the first's); ``canon`` maps a path
    the audit reports (a verification copy) to the user's file; ``only`` limits the findings considered;
    ``named`` are the rules whose info findings are fixed too (:func:`named_rules`).
    """
    fixers = load_builtin_fixers()
    by_id = {r.id: r for r in rules}
    rule_names = {r.id: r.name for r in rules}
    plan = Plan()
    current: dict[str, Source] = {}
    start = dict(texts or {})

    def source_for(path: str) -> Source:
        path = canon(str(Path(path).resolve()))
        if path not in current:
            text = start.get(path)
            if text is None:
                text = Path(path).read_text(encoding="utf-8")
            plan.originals.setdefault(path, text)
            current[path] = Source.parse(text)
        return current[path]

    findings = [f for f in aud.report.findings if wanted(f, source_fix_of(by_id.get(f.rule)), named)
                and (only is None or only(f))]
    # A library's line (location "library": its path is below site-packages, not a file here) is never edited;
    # nor is a file below site-packages the user's path points into.
    files = {_file_of(f, canon) for f in findings if not f.library}
    allowed = {p for p in files if not is_library_file(p)}
    nodes = {n.name: n for n in aud.capture.gm.graph.nodes}
    kinds = {id(f): source_fix_of(by_id.get(f.rule)) for f in findings}
    inputs = _with_probe_inputs(model, findings, kinds, fixers, inputs, args, kwargs)

    seen: set = set()
    static_modules: set[str] = set()
    fp32_modules: dict[str, Edit] = {}
    blocks: list[tuple[FixContext, object]] = []
    ordered = sorted(findings, key=lambda f: kinds[id(f)]["kind"] == MODULE_KIND)
    for f in ordered:
        params = kinds[id(f)]
        kind = params["kind"]
        file = _file_of(f, canon)
        refusal = _refused_before_fixing(f, kind, file, allowed, aud.capture.mode)
        if refusal is not None:
            plan.refusals.append(refusal)
            continue
        # One edit per line for the instances of one class (blocks.0.attn, blocks.1.attn); layers are their own.
        key = (f.rule, file, f.location["line"], f.op, str(f.details.get("dim")),
               f.module if kind in ("pad_to_multiple", MODULE_KIND) else "")
        if key in seen:
            continue
        seen.add(key)
        if _covered_already(plan, f, kind, static_modules, fp32_modules):
            continue
        ctx = FixContext(finding=f, params=params, file=file, policy=aud.policy, source_for=source_for,
                         node=nodes.get(f.node) if f.node else None, nodes=nodes, model=model, inputs=inputs,
                         allowed=lambda p: canon(str(Path(p).resolve())) in allowed, capture=aud.capture.mode)
        out = fixers[kind].fn(ctx)
        if isinstance(out, Refusal):
            _refuse(plan, out, canon)
            continue
        for edit in out:
            if edit.kind == MODULE_KIND:
                fp32_modules.update({p: edit for p in (_instances(model, f.module) if edit.scope == "class"
                                                       else {f.module})})
            if edit.phase == "block":
                blocks.append((ctx, edit))
                if edit.kind != MODULE_KIND:
                    static_modules.update(_same_code(model, f.module))
            elif _apply(plan, current, edit, unsafe, canon, rule_names):
                static_modules.update(_same_code(model, f.module))
    _apply_blocks(plan, current, blocks, fixers, static_modules, model=model, unsafe=unsafe, canon=canon,
                  rule_names=rule_names)
    plan.texts = {p: s.text for p, s in current.items()}
    return plan


def _with_probe_inputs(model: nn.Module, findings: list[Finding], kinds: dict, fixers, inputs: dict | None,
                       args: tuple, kwargs: dict | None) -> dict:
    """``inputs`` (module path -> what it received), completed by one probe run for the modules whose fixer
    needs inputs and that ``inputs`` lacks."""
    inputs = {} if inputs is None else inputs
    probe_paths = {f.module for f in findings if fixers.get(kinds[id(f)]["kind"]) is not None
                   and fixers[kinds[id(f)]["kind"]].needs_inputs}
    if probe_paths - set(inputs):
        inputs.update(probe_inputs(model, probe_paths - set(inputs), args, kwargs or {}))
    return inputs


def _file_of(f: Finding, canon: Callable[[str], str]) -> str:
    """The file of ``f``'s line as the plan keys it: the user's path resolved (and canonical), a library's as the
    report names it (``transformers/models/llama/modeling_llama.py``, never resolved against the working folder)."""
    return f.location["file"] if f.library else canon(str(Path(f.location["file"]).resolve()))


def _refused_before_fixing(f: Finding, kind: str, file: str, allowed: set[str], mode: str) -> Refusal | None:
    """Why ``f`` gets no edit whatever its fixer would say (the rule has none; its line is a library's), or None."""
    if kind == "none":
        return Refusal(f.rule, file, f.location["line"], f.module, "the rule has no source fix",
                       f.fix or "see ampaudit rules " + f.rule)
    if file not in allowed:
        return Refusal(f.rule, file, f.location["line"], f.module,
                       "the line is in an installed package, which fix never edits", _library_instead(f, kind, mode))
    return None


def _covered_already(plan: Plan, f: Finding, kind: str, static_modules: set[str],
                     fp32_modules: dict[str, Edit]) -> bool:
    """Whether an earlier edit settles ``f``: its module's code was edited in place (``f`` waits for the next
    round, in ``plan.deferred``), or its module already runs in fp32 (the edit then covers ``f``'s rule too)."""
    if kind != MODULE_KIND:
        return False
    if f.module in static_modules:
        plan.deferred.append(f)
        return True
    if f.module in fp32_modules:
        edit = fp32_modules[f.module]
        if f.rule not in edit.covers and f.rule != edit.rule:
            edit.covers.append(f.rule)
        return True
    return False


def _apply_blocks(plan: Plan, current: dict[str, Source], blocks: list[tuple[FixContext, Edit]], fixers,
                  static_modules: set[str], *, model: nn.Module, unsafe: bool, canon: Callable[[str], str],
                  rule_names: dict[str, str]) -> None:
    """Apply the block edits, planned while the line edits were applied, to the sources as they are now."""
    # Block edits change line numbers below them: recompute each on the current parse, last line first.
    for ctx, first in sorted(blocks, key=lambda b: (b[1].file, -b[1].line)):
        out = fixers[ctx.params["kind"]].fn(ctx)
        if isinstance(out, Refusal):
            _refuse(plan, out, canon)
            continue
        for edit in out:
            edit.covers = first.covers
            if _apply(plan, current, edit, unsafe, canon, rule_names) and edit.kind != MODULE_KIND:
                static_modules.update(_same_code(model, ctx.finding.module))


def _refuse(plan: Plan, out: Refusal, canon: Callable[[str], str]) -> None:
    out.file = canon(str(Path(out.file).resolve())) if out.file else None
    plan.refusals.append(out)


def _instances(model: nn.Module, path: str) -> set[str]:
    """``path`` and every other module of its class: a class's forward is one piece of code."""
    mod = _module(model, path)
    return {p for p, m in model.named_modules() if mod is not None and type(m) is type(mod)} | {path}


def _same_code(model: nn.Module, path: str) -> set[str]:
    """The modules a source edit in ``path``'s code reaches: every instance of its class, and their ancestors
    (a measured fault of a parent may be the child's)."""
    paths = _instances(model, path)
    out = set(paths)
    for p in paths:
        parts = p.split(".") if p else []
        out.update(".".join(parts[:i]) for i in range(len(parts)))
    return out


def _module(model: nn.Module, path: str):
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


def _apply(plan: Plan, current: dict[str, Source], edit: Edit, unsafe: bool, canon=lambda p: p,
           names: dict[str, str] | None = None) -> bool:
    names = names or {}
    edit.file = canon(str(Path(edit.file).resolve()))
    if edit.safety == "unsafe" and not unsafe:
        plan.skipped_unsafe.append(edit)
        return False
    src = current[edit.file]
    if _touches_ignored(src, edit, (edit.rule, names.get(edit.rule, edit.rule))):
        plan.refusals.append(Refusal(edit.rule, edit.file, edit.line, edit.module,
                                     "the line says # ampaudit: ignore", "nothing: the line asks to be left alone"))
        return False
    current[edit.file] = Source.parse(src.replace(edit.mapping))
    plan.edits.append(edit)
    return True


def _touches_ignored(src: Source, edit: Edit, names: tuple[str, ...]) -> bool:
    """True when a line the edit changes says ``# ampaudit: ignore``, bare or naming the edit's rule (``names``:
    its id and name)."""
    lines = src.text.splitlines()
    for node in edit.mapping:
        a, b = src.span(node)
        if edit.phase == "block":   # a block edit keeps the statements it wraps; its own first line is what it adds
            b = a
        if any(ignores(lines[i - 1], *names) for i in range(a, b + 1) if 0 < i <= len(lines)):
            return True
    return False


def _library_instead(f: Finding, kind: str, capture: str) -> str:
    from ampaudit.rules.engine import module_fixable, untraceable

    if kind == "pad_to_multiple":
        # The library's own option exists for its embeddings (a Hugging Face model's vocabulary); any Linear,
        # Embedding or Conv is padded by the module-tree rewrite, whatever captured the model.
        own = "the library's own option, resize_token_embeddings(n, pad_to_multiple_of=8), or " \
            if f.op == "embedding" else ""
        text = own + "ampaudit fix --pad -o DIR"
    else:
        text = keep_fp32_instead(f.module, " in your code,")
    return text if capture == "fx" or module_fixable(f) else untraceable(text, f.module)


def probe_inputs(model: nn.Module, paths: set[str], args: tuple, kwargs: dict) -> dict:
    """Which forward arguments of the modules at ``paths`` are floating tensors, from one FP32 run of the
    example inputs the audit used (the model's state and the RNGs put back)."""
    import inspect

    from ampaudit.runtime.replay_state import kept
    from ampaudit.sourcefix.fixers_block import ModuleInputs

    found: dict[str, ModuleInputs] = {}
    handles = []
    for path in paths:
        mod = _module(model, path)
        if mod is None:
            continue

        def hook(m, args, kwargs, path=path):
            if path in found:
                return
            info = ModuleInputs()
            info.positional = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.is_floating_point()]
            try:
                bound = inspect.signature(m.forward).bind(*args, **kwargs)
                info.names = [n for n, v in bound.arguments.items()
                              if isinstance(v, torch.Tensor) and v.is_floating_point()]
            except (TypeError, ValueError):
                pass
            found[path] = info

        handles.append(mod.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        with kept(model), torch.no_grad():
            model(*args, **kwargs)
    except Exception:  # the probe is best effort: a fixer without it refuses and says why
        pass
    finally:
        for h in handles:
            h.remove()
    return found
