"""Fixers: what ``ampaudit fix`` does for each fix kind a rule names (``autofix = {kind = ..., safety = ...}`` in
its TOML entry), registered by decorator the way matchers are.

    @fixer("island")                       # runs on every fix
    def islands(job: FixJob) -> list: ...  # the changes it made; it fills its part of job.report

    @fixer("pad", option="pad")            # runs only with fix(..., pad=True) / --pad
    def pad(job: FixJob) -> list: ...

A finding is a fixer's when ``finding.autofix["kind"]`` is its kind; no fixer names a rule id or family. Adding
a fix kind is one registered function, declared with its parameters in rules/policy/fixes.toml (which the rule
loader checks rule files against without importing the fixers), and the kind in the rules that want it.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx as fx
from torch import nn

from ampaudit.dtypes import is_low
from ampaudit.findings import Finding
from ampaudit.registry import Registry
from ampaudit.rewrite.report import FixReport


@dataclass
class FixJob:
    """What a fixer may read and change: the graph being rewritten (of ``work``, a copy of the user's model),
    the audit and its findings (every hit of the selected rules), and the report the fixers fill."""

    gm: fx.GraphModule
    work: nn.Module
    aud: Any                               # ampaudit.api.Audit
    findings: list[Finding]
    report: FixReport
    flags: dict = field(default_factory=dict)   # node -> rule ids an island fixer put in fp32


@dataclass(frozen=True)
class Fixer:
    kind: str
    fn: Callable[[FixJob], list]
    option: str | None                     # the fix() keyword that turns it on; None: always on


FIXERS: Registry = Registry("fixer")     # filled by the @fixer functions below


def fixer(kind: str, *, option: str | None = None) -> Callable:
    """Register ``fn`` as the fixer of ``kind``; with ``option`` it runs only when fix() gets ``option=True``."""
    return FIXERS.register(kind, lambda fn: Fixer(kind, fn, option))


def of_kind(findings: Sequence[Finding], kind: str) -> list[Finding]:
    """The findings whose rule asks for the fixer ``kind``."""
    return [f for f in findings if f.autofix.get("kind") == kind]


def island_devices(policy_device: str) -> tuple[str, ...]:
    """Autocast device types an island turns off: the target's, and the CPU's (where verification may run)."""
    return (policy_device,) if policy_device == "cpu" else (policy_device, "cpu")


def baseline_casts(flags: dict) -> int:
    """Casts of wrapping each flagged op on its own, as the rules' fix text reads: ``op(x.float()).to(x.dtype)``.

    Each low-dtype floating input gets an upcast, and each floating output a cast back.
    """
    from ampaudit.analysis.amp_prop import AMP_KEY

    total = 0
    low = is_low
    for node in flags:
        info = node.meta.get(AMP_KEY)
        inputs = [u for u in node.all_input_nodes if u.op not in ("placeholder", "get_attr")]
        total += sum(1 for u in inputs if low(getattr(u.meta.get(AMP_KEY), "dtype", None)))
        total += 1 if info is not None and low(info.dtype) else 0
    return total


@fixer("island")
def islands(job: FixJob) -> list:
    """FP32 islands around every node a rule of kind "island" hits, merged where cycle-safe (networkx)."""
    from ampaudit.rewrite.flags import flag_nodes
    from ampaudit.rewrite.island_insert import insert_islands
    from ampaudit.rewrite.island_partition import find_islands

    # The audit holds every hit as its own finding (the report only groups repeated ones for display), so every
    # node that hits a rule gets its island from job.findings alone.
    job.flags = flag_nodes(job.gm, job.findings, root=job.work)
    found = find_islands(job.gm, job.flags, root=job.work)
    job.report.casts_per_op = baseline_casts(job.flags)
    job.report.flagged_ops = len(job.flags)
    _, changes = insert_islands(job.gm, found, devices=island_devices(job.aud.policy.device))
    job.report.islands = changes
    return changes


@fixer("pad", option="pad")
def pad(job: FixJob) -> list:
    """Alignment padding of the layers rules of kind "pad" name; FP32 results unchanged."""
    from ampaudit.rewrite.pad import pad_dims

    _, changes = pad_dims(job.gm, job.work, job.findings)
    job.report.padding = changes
    return changes
