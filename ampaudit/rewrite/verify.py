"""Verification of a fix: FP32 outputs unchanged, autocast outputs against FP32 before and after, and a re-check.

    v = verify_outputs(original, fixed, args, kwargs, device_type="cpu", policy=Policy.load("cuda", "float16"))
    v.fp32_max_abs, v.before.rel_err, v.after.nonfinite

Relative error is max |y - y_fp32| / max |y_fp32| over each floating output (the error against the output's
scale; elementwise ratios explode near zero). The autocast forwards run under the target
(:func:`ampaudit.simulate.target_autocast`: a CUDA target's policy is simulated on a CPU). Every forward runs under
``torch.no_grad()`` with the same RNG seed, from the state both models had before the first
(:func:`ampaudit.runtime.replay_state.state_snapshot`: parameters, buffers, modes, the RNGs), and that state is put
back afterwards, so verifying changes nothing.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from ampaudit.dtypes import name_of
from ampaudit.findings import location_text
from ampaudit.policy import Policy
from ampaudit.runtime.replay_state import state_snapshot
from ampaudit.simulate import simulated, target_autocast

# FP32 outputs may differ by this much (relative) where the rewrite had to change op order (padded K dims).
FP32_TOLERANCE = 1e-6


@dataclass
class AmpRun:
    """One forward under autocast compared with FP32."""

    rel_err: float | None = None
    nonfinite: int = 0
    error: str | None = None          # the forward raised (e.g. a constant fp16 cannot hold)

    def describe(self) -> str:
        if self.error:
            return f"raises {self.error}"
        return f"max rel err {_fmt(self.rel_err)}, {self.nonfinite} non-finite"


@dataclass
class Verification:
    device_type: str
    dtype: str
    fp32_max_abs: float
    fp32_max_rel: float
    fp32_bitwise: bool
    before: AmpRun
    after: AmpRun
    remaining: list[dict] = field(default_factory=list)   # findings of the fixed families still there
    # ... on the ops of a wrapped body the rewrite leaves as written (recorded at the example shapes: fx keeps the
    # function opaque, so no island can reach inside); the re-check audits that body as check does
    unrewritten: list[dict] = field(default_factory=list)
    unaudited: int = 0           # parts of the fixed model the re-check could not look into (said in the notes)
    notes: list[str] = field(default_factory=list)
    target: str = ""             # the policy's device, when its autocast was simulated on ``device_type``

    @property
    def fp32_ok(self) -> bool:
        return self.fp32_bitwise or self.fp32_max_rel <= FP32_TOLERANCE

    @property
    def ok(self) -> bool:
        return (self.fp32_ok and self.after.error is None and self.after.nonfinite == 0 and not self.remaining
                and not self.unrewritten)

    def as_dict(self) -> dict:
        d = asdict(self)
        d["fp32_ok"], d["ok"] = self.fp32_ok, self.ok
        return d

    def lines(self) -> list[str]:
        fp32 = "bitwise equal" if self.fp32_bitwise else \
            f"max abs diff {_fmt(self.fp32_max_abs)} (rel {_fmt(self.fp32_max_rel)})"
        out = [f"FP32 outputs: {fp32}",
               f"{self.dtype} autocast on {self.device_type}{self._simulated()}, vs FP32: before {self.before.describe()}; "
               f"after {self.after.describe()}"]
        if self.remaining:
            rules = ", ".join(sorted({f['rule'] for f in self.remaining}))
            out.append(f"re-check: {len(self.remaining)} finding(s) of the fixed families remain ({rules})")
        if self.unrewritten:
            out.append(unrewritten_line(self.unrewritten))
        if not self.remaining and not self.unrewritten:
            out.append("re-check: clean for the fixed families" + (
                " in what it audited (the notes say what it could not look into)" if self.unaudited else ""))
        return out + self.notes

    def _simulated(self) -> str:
        return f" ({self.target}'s policy simulated)" if self.target and self.target != self.device_type else ""


def unrewritten_line(found: list[dict]) -> str:
    """The re-check's line for findings inside wrapped bodies the rewrite left as written: each rule, module and
    line (the first five), and the command that does fix them."""
    where = [f"{f['rule']} {f['module'] or '<top module>'}"
             + (f" ({location_text(f['location'], short=lambda p: Path(p).name)})" if f.get("location") else "")
             for f in found]
    more = f", and {len(where) - 5} more" if len(where) > 5 else ""
    return (f"re-check: {len(found)} finding(s) remain inside wrapped functions the rewrite leaves as written: "
            f"{', '.join(where[:5])}{more}; fix --diff edits their source")


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3g}"


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]


def run(model: nn.Module, args: tuple, kwargs: dict, *, device_type: str | None = None,
        policy: Policy | None = None) -> Any:
    """One seeded forward without grad; under ``policy``'s autocast (on ``device_type`` tensors) when given."""
    torch.manual_seed(0)
    with torch.no_grad():
        if policy is None:
            return model(*args, **kwargs)
        with target_autocast(policy, device_type or "cpu"):
            return model(*args, **kwargs)


def compare(out: Any, ref: Any) -> tuple[float, float, int]:
    """(max abs diff, max relative diff against ref's scale, non-finite count in out)."""
    a, b = _tensors(out), _tensors(ref)
    if len(a) != len(b):
        return math.inf, math.inf, 0
    max_abs, max_rel, bad = 0.0, 0.0, 0
    for x, y in zip(a, b):
        x, y = x.float(), y.float()
        if x.shape != y.shape:
            return math.inf, math.inf, 0
        bad += int((~torch.isfinite(x)).sum())
        diff = (x - y).abs()
        finite = torch.isfinite(diff)
        d = float(diff[finite].max()) if bool(finite.any()) else 0.0
        if not bool(finite.all()):
            d = math.inf
        scale = float(y.abs().max()) if y.numel() else 0.0
        max_abs = max(max_abs, d)
        max_rel = max(max_rel, d / scale if scale > 0 else (0.0 if d == 0 else math.inf))
    return max_abs, max_rel, bad


def _amp_run(model: nn.Module, args: tuple, kwargs: dict, ref: Any, device_type: str, policy: Policy) -> AmpRun:
    try:
        out = run(model, args, kwargs, device_type=device_type, policy=policy)
    except Exception as exc:  # the unfixed model may raise (masked_fill with a constant fp16 cannot hold)
        return AmpRun(error=f"{type(exc).__name__}: {' '.join(str(exc).split())[:120]}")
    _, rel, bad = compare(out, ref)
    return AmpRun(rel_err=rel, nonfinite=bad)


def _bitwise(out: Any, ref: Any) -> bool:
    a, b = _tensors(out), _tensors(ref)
    return len(a) == len(b) and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b))


def verify_outputs(original: nn.Module, fixed: nn.Module, args: tuple, kwargs: dict, *, device_type: str,
                   policy: Policy) -> Verification:
    """Compare ``fixed`` with ``original`` in FP32, and both under ``policy``'s autocast against FP32
    (``device_type``: where the models' tensors are)."""
    # A forward that writes state (an EMA teacher, BatchNorm statistics) would start the next one elsewhere.
    restore = state_snapshot(original, fixed)
    try:
        ref = run(original, args, kwargs)
        restore()
        out = run(fixed, args, kwargs)
        restore()
        before = _amp_run(original, args, kwargs, ref, device_type, policy)
        restore()
        after = _amp_run(fixed, args, kwargs, ref, device_type, policy)
    finally:
        restore()
    max_abs, max_rel, _ = compare(out, ref)
    return Verification(device_type=device_type, dtype=name_of(policy.low), fp32_max_abs=max_abs,
                        fp32_max_rel=max_rel, fp32_bitwise=_bitwise(out, ref), before=before, after=after,
                        target=policy.device if simulated(policy, device_type) else "")

