"""Matchers: the named Python behind each data rule, registered by decorator.

    @matcher("linear_dims", fields={"kind", "shape", "dim", "value", "multiple", "padded", "gemms"})
    def linear_dims(ctx: MatchContext, rule: Rule) -> Iterator[Hit]: ...

A rule file names its matcher (``matcher = "linear_dims"``); at load time every ``{field}`` of the rule's message
and fix must be one the matcher declares, so a typo is an error naming the file and key, not a crash mid-audit.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.fx as fx

from ampaudit.analysis.amp_prop import AMP_KEY
from ampaudit.dtypes import is_low
from ampaudit.graph_meta import SourceLoc, owner
from ampaudit.policy import Policy

# Fields every hit has, whatever its matcher.
COMMON_FIELDS = {"op", "module", "device", "dtype", "low"}


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
    name: str
    fn: Callable[[MatchContext, Any], Iterator[Hit]]
    fields: frozenset[str]


MATCHERS: dict[str, Matcher] = {}


def matcher(name: str, *, fields: set[str]) -> Callable:
    """Register ``fn`` as the matcher ``name``; ``fields`` are the names its hits put in ``details``."""

    def register(fn: Callable) -> Callable:
        if name in MATCHERS:
            warnings.warn(f"matcher {name!r} registered twice; the later one wins", stacklevel=2)
        MATCHERS[name] = Matcher(name, fn, frozenset(fields) | COMMON_FIELDS)
        return fn

    return register


def load_builtin_matchers() -> dict[str, Matcher]:
    """Import the built-in matcher modules (each registers itself) and return the registry."""
    from ampaudit.rules.matchers import (  # noqa: F401
        alignment, calibrated, constants, integers, normalization, running_sums, sensitive,
    )
    from ampaudit.rules.matchers import decisions  # noqa: F401  (AMP702: decisions flipped by precision)

    return MATCHERS
