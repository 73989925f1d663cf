"""Matchers: the named Python behind each data rule, registered by decorator.

    @matcher("linear_dims", fields={"kind", "shape", "dim", "value", "multiple", "padded", "gemms", "share"},
             params={"min_share": float}, variants={"small"}, nullable={"share"})
    def linear_dims(ctx: MatchContext, rule: Rule) -> Iterator[Hit]: ...

A matcher declares what a rule using it may say (:class:`Matcher`): the parameters it reads (a type, or a tuple
of the allowed values), the variants its hits name, the fields its messages may use and which of those can be
unknown (None in the JSON, "?" in the text: no format spec may apply to them). The rule loader checks a rule file
against that declaration at load, so a typo is one error naming the file, rule and key, not a crash mid-audit.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.fx as fx

from ampaudit.analysis.amp_prop import AMP_KEY
from ampaudit.dtypes import is_low, limits
from ampaudit.graph_meta import SourceLoc, owner
from ampaudit.policy import Policy
from ampaudit.registry import Registry

# Fields every hit has, whatever its matcher: where it is, the target, and the limits of the target's
# low-precision dtype (:func:`limit_fields`: ``max`` 65504 for fp16, the largest value whose square fits
# ``max_sqrt`` 256, whose cube ``max_cbrt`` 40.3, the largest input exp takes ``max_log`` 11.1, the smallest
# input 1/x takes ``max_inv`` 1.5e-5). A matcher whose hits judge another dtype provides its own ``max``.
COMMON_FIELDS = {"op", "module", "device", "dtype", "low", "max", "max_sqrt", "max_cbrt", "max_log", "max_inv"}


def limit_fields(dtype: torch.dtype) -> dict[str, float]:
    """The limits of ``dtype`` a message may name (see COMMON_FIELDS), from dtypes.limits."""
    big = limits(dtype).max
    return {"max": big, "max_sqrt": math.sqrt(big), "max_cbrt": big ** (1 / 3), "max_log": math.log(big),
            "max_inv": 1 / big}


@dataclass
class Hit:
    """One place a matcher found: the node (for module and source line), and the values the message names."""

    node: fx.Node | None
    details: dict[str, Any]
    severity: str | None = None          # overrides the rule's default
    module: str | None = None            # when there is no node (buffers)
    op: str | None = None
    source: SourceLoc | None = None
    # A named case of the rule (its ``[rule.variants.NAME]`` table): the severity, message, why and fix that
    # are true for what this hit is (BatchNorm with fp32 parameters is not BatchNorm with half ones).
    variant: str | None = None
    # Nodes a fix must change too, beyond ``node`` (the cumsum whose partial sums a subtraction reads).
    also: tuple = ()


@dataclass
class MatchContext:
    """What a matcher may read: the captured graph (nodes carry meta["amp"]), the model, the policy."""

    gm: fx.GraphModule
    root: torch.nn.Module
    policy: Policy
    calibration: Any = None              # an ampaudit.analysis.calibrate.Calibration with check --calibrate
    batch: int | None = None             # the per-rank micro-batch the model will train with (check --batch)

    def nodes(self) -> Iterator[fx.Node]:
        for n in self.gm.graph.nodes:
            if AMP_KEY in n.meta and n.op in ("call_module", "call_function", "call_method"):
                yield n

    def owner(self, node: fx.Node) -> torch.nn.Module | None:
        """The module whose own code ran ``node`` (the called module itself for call_module nodes)."""
        return owner(node, self.root)

    def is_low(self, dtype: torch.dtype | None) -> bool:
        """True for the dtypes the policy lowers to (fp16/bf16, and fp8 for GEMMs)."""
        return is_low(dtype)


@dataclass(frozen=True)
class Matcher:
    """A matcher and what a rule using it may say. Its messages may name ``fields`` and the rule's own scalar
    parameters (``{min_depth}``: :meth:`param_fields`)."""

    name: str
    fn: Callable[[MatchContext, Any], Iterator[Hit]]
    fields: frozenset[str]
    params: dict = dataclasses.field(default_factory=dict)   # key -> type, or tuple of allowed values
    variants: frozenset[str] = frozenset()                   # the variant names its hits may carry
    nullable: frozenset[str] = frozenset()                   # fields that may be unknown ("?")
    required: frozenset[str] = frozenset()                   # params a rule (or its file's [params]) must set

    def param_fields(self) -> frozenset[str]:
        """The parameters whose value is one number or word, which a message may name like a field."""
        return frozenset(k for k, spec in self.params.items() if spec in (int, float, str) or isinstance(spec, tuple))


MATCHERS: Registry = Registry("matcher", providers=tuple(
    f"ampaudit.rules.matchers.{m}" for m in ("alignment", "calibrated", "constants", "integers", "normalization",
                                            "running_sums", "sensitive", "decisions", "training")))


def matcher(name: str, *, fields: set[str], params: dict | None = None, variants: set[str] = frozenset(),
            nullable: set[str] = frozenset(), required: set[str] = frozenset()) -> Callable:
    """Register ``fn`` as the matcher ``name``: ``fields`` are the names its hits put in ``details``,
    ``params`` the rule keys it reads (a type, or a tuple of allowed values; an op list is ``OPS``) and
    ``required`` those it has no default for, ``variants`` the variant names its hits name, ``nullable`` the
    fields it may leave unknown (None)."""
    return MATCHERS.register(name, lambda fn: Matcher(name, fn, frozenset(fields) | COMMON_FIELDS, dict(params or {}),
                                                      frozenset(variants), frozenset(nullable), frozenset(required)))


# A parameter that lists op names: plain names, or "@set" for an op set of the rule files ([op_sets]).
OPS = "ops"


def load_builtin_matchers() -> Registry:
    """The registry of matchers, the built-in ones registered (each module registers itself on import)."""
    return MATCHERS.load()
