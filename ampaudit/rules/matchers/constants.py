"""Constants the op's compute dtype cannot hold: -1e9 / finfo(float32).min masks, eps below fp16's subnormals.

Two kinds of constant are judged: the numbers a listed op takes (``x + 1e-8``, ``masked_fill(m, -1e9)``), and the
parameters named in the rule's ``default_params`` (``eps``) of the functions and modules in its ``eps_used_in``
(``[params.constants]`` in rules/constants.toml), whether the caller wrote them or left the default (``F.normalize(x)`` has
eps=1e-12). A parameter is judged in the dtype the function really uses it in: F.normalize clamps the norm with its
eps, so on CUDA, where norm has an fp32 output, 1e-12 is safe; layer_norm adds its eps inside an fp32 kernel.
"""
from __future__ import annotations

import inspect
from typing import Any, Iterator

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten

from ampaudit.analysis.amp_prop import AMP_KEY
from ampaudit.dtypes import DTypeLimits, limits, name_of
from ampaudit.policy import settings
from ampaudit.rules.registry import OPS, Hit, MatchContext, matcher

FIELDS = {"value", "as_low", "compute_dtype", "max", "subnormal", "normal", "consequence", "origin", "param"}
# ops: the ops whose scalar arguments are judged; raising: those that write the constant into a tensor of their
# dtype and raise when it does not fit; default_params / eps_used_in: the parameters judged, and where each
# function uses them.
PARAMS = {"check": ("overflow", "underflow", "subnormal"), "ops": OPS, "raising": OPS, "default_params": list,
          "eps_used_in": dict}
_NO_DEFAULT = object()


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


@matcher("constants", fields=FIELDS, params=PARAMS, variants={"default"},
         required={"ops", "raising", "default_params", "eps_used_in"})
def constants(ctx: MatchContext, rule) -> Iterator[Hit]:
    cfg = rule.params
    ops, raising = set(cfg["ops"]), set(cfg["raising"])
    want = rule.param("check", "overflow")
    for node in ctx.nodes():
        info = node.meta[AMP_KEY]
        dtype = info.compute_dtype if info.op not in raising else info.dtype
        if info.op not in ops or not ctx.is_low(dtype):
            continue
        lim = limits(dtype)
        for value in tree_flatten((node.args, node.kwargs))[0]:
            value = _scalar_of(value)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or isinstance(value, fx.Node):
                continue
            if isinstance(value, int) and abs(value) <= lim.max:
                continue
            check = _classify(float(value), lim)
            if check != want:
                continue
            sev = "error" if check == "overflow" and info.op in raising else None
            yield Hit(node, _details(value, lim, _consequence(check, info.op, raising)), severity=sev)
    yield from _parameter_constants(ctx, cfg, want)


def _scalar_of(value):
    """A number held in a 0-dim tensor made for it (dispatch captures record ``clamp_min_(x, scalar_tensor(1e-8))``
    for cosine_similarity's eps) is that number; anything else is itself."""
    if isinstance(value, fx.Node) and AMP_KEY in value.meta and value.meta[AMP_KEY].op == "scalar_tensor" \
            and value.args and isinstance(value.args[0], (int, float)):
        return value.args[0]
    return value


def _details(value: float, lim: DTypeLimits, consequence: str, origin: str = "", param: str = "") -> dict:
    return {"value": float(value), "as_low": str(lim.as_dtype(float(value))),
            "compute_dtype": name_of(lim.dtype), "max": lim.max, "subnormal": lim.subnormal,
            "normal": lim.normal, "consequence": consequence, "origin": origin, "param": param}


def _parameter_constants(ctx: MatchContext, cfg: dict, want: str) -> Iterator[Hit]:
    """The eps of the functions and modules listed in the rule's ``eps_used_in``, given or defaulted."""
    used_in = cfg.get("eps_used_in", {})
    for node in ctx.nodes():
        info = node.meta[AMP_KEY]
        if info.op not in used_in or used_in[info.op] == "opmath":
            continue  # unknown functions are not judged; "opmath" kernels use the eps in fp32
        dtype = _eps_dtype(ctx, info, used_in[info.op])
        if not ctx.is_low(dtype):
            continue
        lim = limits(dtype)
        for name, value, default in call_params(ctx, node, cfg["default_params"]):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or _classify(float(value), lim) != want:
                continue
            defaulted = default is not _NO_DEFAULT and value == default
            origin = f" ({name}, the default of {info.op})" if defaulted else f" ({name} of {info.op})"
            consequence = "; the guard vanishes, so an all-zero input divides 0 by 0" if want == "underflow" else ""
            yield Hit(node, _details(value, lim, consequence, origin, name), variant="default" if defaulted else None)


def _eps_dtype(ctx: MatchContext, info, where: str) -> torch.dtype | None:
    """The dtype the op ``where`` (the one that meets the eps) computes in, fed this node's input."""
    category = ctx.policy.category(where)
    if category in ("fp32", "fp32_output"):
        return torch.float32
    if category == "lower":
        return ctx.policy.low
    first = next((d for d in info.input_dtypes if isinstance(d, torch.dtype) and d.is_floating_point), None)
    return first or info.compute_dtype


def call_params(ctx: MatchContext, node: fx.Node, names) -> Iterator[tuple[str, Any, Any]]:
    """``(name, value, default)`` for each parameter in ``names`` the call has: the argument given, else the
    function's default (``_NO_DEFAULT`` when it has none); for a module, its attribute and its __init__ default."""
    if node.op == "call_module":
        owner = ctx.owner(node)
        for name in names:
            if owner is not None and hasattr(owner, name):
                yield name, getattr(owner, name), _init_default(type(owner), name)
        return
    params = _signature(node)
    for name in names:
        for index, (pname, default) in enumerate(params):
            if pname != name:
                continue
            if name in node.kwargs:
                yield name, node.kwargs[name], default
            elif index < len(node.args):
                yield name, node.args[index], default
            elif default is not _NO_DEFAULT:
                yield name, default, default
            break


def _init_default(cls: type, name: str) -> Any:
    try:
        p = inspect.signature(cls.__init__).parameters.get(name)
    except (TypeError, ValueError):
        return _NO_DEFAULT
    return _NO_DEFAULT if p is None or p.default is inspect.Parameter.empty else p.default


def _signature(node: fx.Node) -> list[tuple[str, Any]]:
    """The call's parameters in positional order (self first for methods), with their defaults: from the Python
    signature, else the aten schema (torch.cosine_similarity and other builtins have no Python signature)."""
    target = node.target
    schema = getattr(target, "_schema", None)  # an aten OpOverload (export and dispatch captures)
    if schema is None and node.op == "call_function":
        try:
            return [(n, _NO_DEFAULT if p.default is inspect.Parameter.empty else p.default)
                    for n, p in inspect.signature(target).parameters.items()]
        except (TypeError, ValueError):
            pass
    if schema is None:
        name = str(target) if node.op == "call_method" else getattr(target, "__name__", "")
        schemas = torch._C._jit_get_schemas_for_operator(f"aten::{name}") if name else []
        schema = next((s for s in schemas if len(s.arguments) >= len(node.args)), None)
    if schema is None:
        return []
    return [(a.name, a.default_value if a.has_default_value() else _NO_DEFAULT) for a in schema.arguments]
