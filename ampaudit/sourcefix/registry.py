"""Source fixers: one per ``source_fix`` kind a rule names in its TOML entry, registered by decorator.

    source_fix = {kind = "upcast_op", safety = "safe", dtype_ops = ["softmax"], cast_back = true}   # rules/*.toml

    @source_fixer("upcast_op")           # its parameters: rules/policy/fixes.toml [source_fix]
    def upcast_op(ctx: FixContext) -> list[Edit] | Refusal: ...

A fixer reads one finding (``ctx.finding``) and the parsed file its line is in (``ctx.src``), and returns the edits
it would make (each a ``{old node: new node}`` replacement with a description and its safety), or a
:class:`Refusal` that says why a source edit cannot express the fix and what to do instead. It changes nothing
itself: the driver applies, orders and verifies the edits. ``phase`` orders them: "expr" edits keep every line
where it is and run first; "block" edits (new ``with`` blocks) run last, bottom of the file first.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from ampaudit.findings import Finding
from ampaudit.registry import Registry
from ampaudit.sourcefix.cst_tools import Source


@dataclass
class Edit:
    """One change to one file: what a fixer would do for one finding."""

    rule: str
    kind: str
    file: str
    line: int
    safety: str                                  # "safe": FP32 results unchanged; "unsafe": they may change
    description: str
    mapping: dict = field(default_factory=dict, repr=False)   # old cst node -> new cst node, in ctx.src
    module: str = ""
    phase: str = "expr"
    covers: list[str] = field(default_factory=list)           # more rule ids this edit addresses
    scope: str = "line"                                       # "class": a class's forward, for all its instances

    def as_dict(self) -> dict:
        return {"rule": self.rule, "kind": self.kind, "file": self.file, "line": self.line, "safety": self.safety,
                "module": self.module, "description": self.description, "covers": self.covers}


@dataclass
class Refusal:
    """A finding a source edit cannot fix, and what does."""

    rule: str
    file: str | None
    line: int | None
    module: str
    reason: str
    instead: str

    def as_dict(self) -> dict:
        return {"rule": self.rule, "file": self.file, "line": self.line, "module": self.module,
                "reason": self.reason, "instead": self.instead}


@dataclass
class FixContext:
    """What a fixer may read: the finding, its rule's ``source_fix`` table, the parsed file, the audit's graph
    node for the finding (None when the capture has none), the model, and probed module inputs."""

    finding: Finding
    params: dict
    file: str
    policy: Any                                  # ampaudit.policy.Policy
    source_for: Callable[[str], Source] = None   # the current parse of any file (edits go to its nodes)
    node: Any = None                             # fx.Node with meta["amp"], or None
    nodes: dict = field(default_factory=dict)    # every graph node by name (for finding.fix_nodes)
    model: Any = None                            # the user's model (an nn.Module)
    inputs: dict = field(default_factory=dict)   # module path -> ModuleInputs (the fp32_module fixer's probe)
    allowed: Callable[[str], bool] = lambda file: True   # may this file be edited (the findings' own files)
    capture: str = "fx"                          # how the audit captured the model (only fx graphs are rewritten)

    @property
    def src(self) -> Source:
        """The finding's file, parsed as it stands now."""
        return self.source_for(self.file)

    @property
    def line(self) -> int:
        return int(self.finding.location["line"])

    @property
    def safety(self) -> str:
        return self.params.get("safety", "safe")

    def edit(self, mapping: dict, description: str, *, line: int | None = None, safety: str | None = None,
             phase: str = "expr", file: str | None = None) -> Edit:
        return Edit(rule=self.finding.rule, kind=self.params["kind"], file=file or self.file, line=line or self.line,
                    safety=safety or self.safety, description=description, mapping=mapping,
                    module=self.finding.module, phase=phase)

    def refuse(self, reason: str, instead: str) -> Refusal:
        loc = self.finding.location or {}
        if self.capture != "fx":
            from ampaudit.rules.engine import untraceable

            instead = untraceable(instead, self.finding.module)
        return Refusal(self.finding.rule, loc.get("file"), loc.get("line"), self.finding.module, reason, instead)


@dataclass(frozen=True)
class SourceFixer:
    kind: str
    fn: Callable[[FixContext], "list[Edit] | Refusal"]
    needs_inputs: bool = False                   # the driver probes the module's forward inputs first


SOURCE_FIXERS: Registry = Registry("source fixer", providers=("ampaudit.sourcefix.fixers_expr",
                                                              "ampaudit.sourcefix.fixers_block"))


def source_fixer(kind: str, *, needs_inputs: bool = False) -> Callable:
    """Register ``fn`` as the source fixer of ``kind`` (the ``source_fix.kind`` rules name; its parameters are
    declared in rules/policy/fixes.toml, which the rule loader checks rule files against)."""
    return SOURCE_FIXERS.register(kind, lambda fn: SourceFixer(kind, fn, needs_inputs))


def load_builtin_fixers():
    """The registry of source fixers by kind, the built-in ones registered."""
    return SOURCE_FIXERS.load()


def keep_fp32_instead(module: str | None, where: str = "") -> str:
    """What to do instead of an edit fix will not make: keep ``module`` in fp32 (``where``: e.g. " in your code,"),
    or the graph rewrite."""
    return f"ampaudit.keep_fp32(model, ['{module or '<module>'}']){where} or the graph rewrite (ampaudit fix -o DIR)"
