"""Constants the op's compute dtype cannot hold: -1e9 / finfo(float32).min masks, eps below fp16's subnormals."""
from __future__ import annotations

from typing import Iterator

import torch.fx as fx
from torch.utils._pytree import tree_flatten

from ampaudit.analysis.amp_prop import AMP_KEY
from ampaudit.policy import DTypeLimits, settings
from ampaudit.rules.registry import Hit, MatchContext, matcher

FIELDS = {"value", "as_low", "compute_dtype", "max", "subnormal", "normal", "consequence"}


def _classify(value: float, lim: DTypeLimits) -> str | None:
    a = abs(value)
    if a == 0 or a != a or a == float("inf"):
        return None
    if a > lim.max and lim.as_dtype(value) in (float("inf"), float("-inf")):
        return "overflow"
    if a < lim.subnormal / 2 or lim.as_dtype(value) == 0.0:
        return "underflow"
    if a < lim.normal:
        return "subnormal"
    return None


def _consequence(check: str, op: str, raising: set[str]) -> str:
    if check == "overflow":
        if op in raising:
            return f"; {op} raises 'value cannot be converted without overflow' under autocast"
        return "; the result is inf, and a fully masked softmax row becomes NaN"
    if check == "underflow" and op in ("add", "sub", "rsub", "clamp", "clamp_min", "maximum"):
        return "; the eps it adds vanishes, so what it guards can divide by zero"
    return ""


@matcher("constants", fields=FIELDS)
def constants(ctx: MatchContext, rule) -> Iterator[Hit]:
    cfg = settings()["constants"]
    ops, raising = set(cfg["ops"]), set(cfg["raising"])
    want = rule.param("check", "overflow")
    for node in ctx.nodes():
        info = node.meta[AMP_KEY]
        dtype = info.compute_dtype if info.op not in raising else info.dtype
        if info.op not in ops or not ctx.is_low(dtype):
            continue
        lim = DTypeLimits.of(dtype)
        for value in tree_flatten((node.args, node.kwargs))[0]:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or isinstance(value, fx.Node):
                continue
            if isinstance(value, int) and abs(value) <= lim.max:
                continue
            check = _classify(float(value), lim)
            if check != want:
                continue
            sev = "error" if check == "overflow" and info.op in raising else None
            yield Hit(node, {"value": float(value), "as_low": str(lim.as_dtype(float(value))),
                             "compute_dtype": str(dtype).replace("torch.", ""), "max": lim.max,
                             "subnormal": lim.subnormal, "normal": lim.normal,
                             "consequence": _consequence(check, info.op, raising)}, severity=sev)
