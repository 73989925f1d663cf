"""``ampaudit.fix``: rewrite a model into FP32 islands (and, opt-in, pad GEMM dims), verified.

    fixed, changes, report = ampaudit.fix(model, x, mask, device="cuda", dtype="float16")
    result = ampaudit.fix(model, x, device="cpu", pad=True)
    result.module(x); print(result.report.to_text())

The input model is left untouched: the fix works on a deep copy. The returned module is that copy with a
rewritten ``forward`` (class ``Fixed<Class>``): same parameter and buffer names, same ``state_dict`` keys, so
existing checkpoints load; with autocast off it computes exactly what the original computes.

A model torch.fx cannot trace keeps its own forward and is fixed on its module tree instead
(:mod:`ampaudit.rewrite.module_fix`: modules kept in fp32, layers padded by hooks), verified the same way:
``result.form == "modules"``, ``result.gm`` is None and ``result.plan`` holds what was applied.
"""
from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from ampaudit.errors import CaptureError, UsageError
from ampaudit.findings import Finding
from ampaudit.graph_meta import module_of, recorded
from ampaudit.rewrite.fixers import FIXERS, FixJob, island_devices, of_kind
from ampaudit.rewrite.flags import island_findings
from ampaudit.rewrite.report import FixReport
from ampaudit.wrappers import unwrap
from ampaudit.rewrite.verify import verify_outputs
from ampaudit.runtime.replay_state import model_device

KEEP_FP32_HINT = ("keep your eager model and run the flagged modules in fp32 with "
                  "ampaudit.keep_fp32(model, ['module.path', ...]), or edit your source with ampaudit fix --diff")


@dataclass
class FixResult:
    """What :func:`fix` returns; unpacks as ``module, changes, report``."""

    module: nn.Module
    changes: list[Any]
    report: FixReport
    gm: Any = field(default=None, repr=False)        # the rewritten fx.GraphModule (what the writer prints)
    devices: tuple[str, ...] = ("cpu",)
    plan: Any = None     # ModulePlan when torch.fx could not capture the model and the fix is module-level

    @property
    def form(self) -> str:
        """"graph" (the rewritten forward) or "modules" (keep_fp32 and padding on the module tree)."""
        return "graph" if self.plan is None else "modules"

    def __iter__(self) -> Iterator[Any]:
        return iter((self.module, self.changes, self.report))


def fix(model: nn.Module, *args, device: str = "cuda", dtype: str = "float16",
        select: Sequence[str] | None = None, ignore: Sequence[str] | None = None, pad: bool = False,
        verify: bool = True, calibrate: bool = False, rules_dirs: Sequence[str | Path] = (),
        target: str | None = None, data=None, **kwargs) -> FixResult:
    """Fix ``model`` (called as ``model(*args, **kwargs)``) for the ``device``/``dtype`` autocast target.
    ``calibrate=True`` measures on ``data`` (``calibration_data(loaded)``, as ``check --calibrate`` does), else on
    the example inputs."""
    from ampaudit.api import audit

    if not isinstance(model, nn.Module):
        raise UsageError(f"fix() needs an nn.Module, got {type(model).__name__}", hint="pass the model first")
    original = unwrap(model)
    if any(t.is_meta for t in list(original.parameters()) + list(original.buffers())):
        raise UsageError("fix needs the model's weights, but they are on the meta device",
                         hint="build the model with real weights (check audits meta models; fix rewrites and verifies)")
    work = copy.deepcopy(original)
    opts = dict(device=device, dtype=dtype, select=select, ignore=ignore, rules_dirs=rules_dirs, target=target,
                calibrate=calibrate, data=data, specialize=False)
    try:
        aud = audit(work, *args, capture_mode="fx", **opts, **kwargs)
    except CaptureError as exc:
        # The graph cannot be rewritten; the same findings are fixed on the module tree instead.
        return _fix_modules(original, work, args, kwargs, opts, pad=pad, verify=verify, why=exc.message)
    gm, policy = aud.capture.gm, aud.policy
    if aud.capture.root is not work:
        raise CaptureError(f"{type(original).__name__} is a single built-in layer; there is no forward to rewrite",
                           hint=KEEP_FP32_HINT)
    findings: list[Finding] = list(aud.report.findings)
    report = FixReport(target=target or type(original).__name__, policy=policy.describe(), before=aud.report,
                       calibrated=calibrate)
    # What check audits only at the example inputs' shapes, a rewrite that must hold for every input leaves alone.
    report.notes += [f"{note}; its body is left as written" + (" (ampaudit check audits it at the example inputs' "
                     "shapes)" if note in aud.recordable else "") for note in aud.opaque]
    job = FixJob(gm=gm, work=work, aud=aud, findings=findings, report=report)
    options = {"pad": pad}
    changes: list[Any] = []
    for fx_ in FIXERS.values():
        if fx_.option is None or options.get(fx_.option):
            changes += fx_.fn(job)
    devices = island_devices(policy.device)
    padded = {c.module: set(c.dims) for c in report.padding}
    report.unfixed = _unfixed(findings, job.flags, padded)

    from ampaudit.rewrite.build import install_forward

    fixed = install_forward(work, gm)
    if verify:
        report.verification = _verify(original, fixed, args, kwargs, policy, opts, padded)
    return FixResult(module=fixed, changes=changes, report=report, gm=gm, devices=devices)


def _fix_modules(original, work, args, kwargs, opts, *, pad: bool, verify: bool, why: str) -> FixResult:
    """The module-level fix (rewrite/module_fix.py) on what check captures when torch.fx cannot trace it."""
    from ampaudit.api import audit
    from ampaudit.rewrite.module_fix import apply_module_fix, plan_module_fix

    try:
        aud = audit(work, *args, capture_mode="auto", **opts, **kwargs)
    except CaptureError as exc:
        raise CaptureError(f"cannot fix {type(original).__name__}: {exc.message}", hint=KEEP_FP32_HINT) from exc
    if aud.capture.root is not work:
        raise CaptureError(f"{type(original).__name__} is a single built-in layer; there is nothing to fix at "
                           "module granularity", hint=KEEP_FP32_HINT)
    findings: list[Finding] = list(aud.report.findings)
    report = FixReport(target=opts["target"] or type(original).__name__, policy=aud.policy.describe(),
                       before=aud.report, calibrated=opts["calibrate"], form="modules")
    plan = plan_module_fix(work, findings, pad=pad)
    report.padding = apply_module_fix(work, plan.keep, plan.pad)
    report.islands, report.flagged_ops = plan.islands, len(island_findings(findings))
    report.notes += [f"fixed on the module tree, captured by {aud.capture.mode}: torch.fx cannot rewrite the "
                     f"graph ({why})"] + plan.notes
    padded = {c.module: set(c.dims) for c in report.padding}
    kept = set(plan.keep)
    report.unfixed = [f for f in _unfixed(findings, {}, padded)
                      if not (f.autofix.get("kind") == "island" and _below(f.module, kept))]
    if verify:
        report.verification = _verify(original, work, args, kwargs, aud.policy, opts, padded, mode=aud.capture.mode)
    return FixResult(module=work, changes=[*plan.islands, *report.padding], report=report,
                     devices=island_devices(aud.policy.device), plan=plan)


def _below(module: str | None, kept: set[str]) -> bool:
    return bool(module) and any(module == k or module.startswith(k + ".") for k in kept)


def _unfixed(findings: list[Finding], flags: dict, padded: dict[str, set[str]]) -> list[Finding]:
    """Warning/error findings this fix does not address (rules of kind none; alignment not padded)."""
    flagged = {n.name for n in flags}
    modules = {module_of(n) for n in flags}
    fixed = {id(f) for f in island_findings(findings) if f.node in flagged or (f.node is None and f.module in modules)}
    out = []
    for f in findings:
        if f.severity == "info" or id(f) in fixed:
            continue
        if f.autofix.get("kind") == "pad" and f.details.get("dim") in padded.get(f.module, ()):
            continue
        out.append(f)
    return out


def _verify(original, fixed, args, kwargs, policy, opts, padded, mode="fx"):
    from ampaudit.api import audit

    device_type = model_device(original)
    v = verify_outputs(original, fixed, args, kwargs, device_type=device_type, policy=policy)
    if device_type != policy.device and not v.target:
        v.notes.append(f"outputs compared under {device_type} autocast: the model's weights are on {device_type}, "
                       f"the target is {policy.device}")
    # The re-check audits as check does (specialize): a wrapped body the rewrite left as written is recorded at the
    # example inputs' shapes, and what it still holds is counted apart, not called clean.
    again = audit(fixed, *args, capture_mode=mode, **dict(opts, specialize=True), **kwargs)
    inside = {n.name for n in again.capture.gm.graph.nodes if recorded(n)}
    remaining = island_findings(again.report.findings)
    if padded:
        remaining += [f for f in of_kind(again.report.findings, "pad") if f.module in padded
                      and f.details.get("dim") in padded[f.module]]
    v.remaining = [_left(f) for f in remaining if f.node not in inside]
    v.unrewritten = [_left(f, location=f.location) for f in remaining if f.node in inside]
    v.unaudited = len(again.report.unaudited)
    return v


def _left(f: Finding, **extra) -> dict:
    """A finding the re-check still has, as the verification lists it."""
    return {"rule": f.rule, "module": f.module, "op": f.op, "message": f.message, **extra}
