"""Each nn.Linear's error in float8, bf16 and fp16 against FP32, forward and backward, measured on data.

    measures = measure_layers(model, [((x,), {}, y)], recipe="tensorwise", loss_fn=F.cross_entropy)
    m = measures[0]
    m.module, m.in_features, m.out_features, m.tokens           # "blocks.0.mlp.fc1", 256, 1024, 4096
    m.metrics["float8"]["grad_weight"]                          # {"sqnr_db": 27.9, "rel_l2": 0.040}
    m.stats["input"]["flushed_share"]                           # 0.31: why float8 loses (an outlier feature)
    m.to_dict()                                                 # JSON-ready (inf/nan as strings)

nn.Linear is the GEMM module measured: it is what torchao's float8 training converts (convolutions and the
matmuls inside attention are no float8 candidates there). Method: the model runs once per batch in FP32; a
forward hook keeps each Linear call's input and the gradient edge of its output, and one ``autograd.grad`` of
the batch's loss yields the gradient arriving at each output (grad_output), with no ``.grad`` written. Then
each call is re-run alone on that FP32 input and pushed back with that FP32 grad_output: in FP32 (the
reference), as torchao's ``Float8Linear`` (``convert_to_float8_training``, so the float8 numerics are torchao's
own, emulated on CPU), and under ``torch.autocast`` in bf16 and fp16. Output, grad_input and grad_weight are
compared to the reference; over batches and calls the worst number is kept. A layer's error is its own: the
inputs and gradients it gets are FP32's, not those of a model whose other layers are lowered too.

fp16 gradients are measured as ``torch.amp.GradScaler`` makes them: grad_output multiplied by its initial
2**16, halved while the layer's fp16 backward overflows, and the gradients divided back. bf16 and float8
need no scaler (float8 scales each tensor itself).
"""
from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge

from ampaudit.analysis.calibrate import batch_loss
from ampaudit.errors import AmpAuditError, InputError, UsageError
from ampaudit.notes import note
from ampaudit.precision import fp8
from ampaudit.precision.recipes import Recipe, recipe, recipe_names
from ampaudit.runtime.replay_state import kept
from ampaudit.runtime.trace import jsonable
from ampaudit.wrappers import unwrap

__all__ = ["DTYPES", "LayerMeasure", "error_metrics", "measure_call", "measure_layers"]

DTYPES: dict[str, torch.dtype | None] = {"float8": None, "bfloat16": torch.bfloat16, "float16": torch.float16}
ROLES = ("output", "grad_input", "grad_weight")

# Over batches and calls the worst value of each number is kept: the lowest SQNR, the highest of the rest.
_WORST: dict[str, Callable[[float, float], float]] = {
    "sqnr_db": min, "rel_l2": max, "row_sqnr_db": min,
    "amax": max, "scale": min, "flushed_share": max, "clipped_share": max, "dynamic_range_bits": max, "subnormal_share": max,
    "scale_range_bits": max,
}

# The float8 casts torchao makes in one Linear (float8_linear.matmul_with_hp_or_float8_args): stats key,
# operand, the Float8LinearConfig field that configures the cast, and the axis an axiswise scale is taken
# along, on the operand as a 2-D matrix (input M x K, weight N x K, grad_output M x N): the reduction dim
# of the GEMM the cast feeds. A "_for_" cast is reported only where it differs from the operand's first
# (axiswise: another axis); a tensorwise scale is the same whichever GEMM it feeds.
_CASTS = (
    ("input", "input", "cast_config_input", -1),                                  # output = input @ W.t
    ("weight", "weight", "cast_config_weight", -1),
    ("grad_output", "grad_output", "cast_config_grad_output", -1),                # grad_input = go @ W
    ("weight_for_grad_input", "weight", "cast_config_weight_for_grad_input", 0),
    ("grad_output_for_grad_weight", "grad_output", "cast_config_grad_output_for_grad_weight", 0),
    ("input_for_grad_weight", "input", "cast_config_input_for_grad_weight", 0),   # grad_weight = go.t @ input
)

_GRAD_SCALER_INIT = 2.0 ** 16     # torch.amp.GradScaler's init_scale
_GRAD_SCALER_BACKOFFS = 40        # down to 2**-24: past that, an fp16 backward that overflows stays overflowed


@dataclass
class LayerMeasure:
    """One Linear: its GEMM's shape and what each dtype does to it (see the module docstring).

    ``metrics[dtype][role]`` = {"sqnr_db", "rel_l2"} for dtype in the ``dtypes`` measured and role in
    output, grad_input, grad_weight (the grad roles are absent when no gradient reaches the layer's output).
    ``stats[cast]`` = :func:`ampaudit.precision.fp8.cast_stats` of input, weight and grad_output as the recipe
    casts them for float8 (empty when float8 is not measured). A recipe name in ``dtypes`` (rules/policy/recipes.toml,
    emulated as :mod:`ampaudit.planning.emulate` says) is measured the same way, under its own name, with its cast
    statistics (of the first batch's calls) in ``metrics[recipe]["stats"]``; ``unsupported[recipe]`` says why one could not run the layer."""

    module: str
    in_features: int
    out_features: int
    tokens: int = 0
    metrics: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)
    stats: dict[str, dict[str, float]] = field(default_factory=dict)
    unsupported: dict[str, str] = field(default_factory=dict)     # recipe -> why it cannot run this layer

    def to_dict(self) -> dict:
        return jsonable(dataclasses.asdict(self))


def error_metrics(ref: torch.Tensor, got: torch.Tensor) -> dict[str, float]:
    """``sqnr_db`` = 10 log10(|ref|^2 / |ref - got|^2) (inf when equal), ``rel_l2`` = |ref - got| / |ref| and
    ``row_sqnr_db`` (the median row's SQNR), in float64. ``got`` non-finite: -inf / inf; ``ref`` non-finite: NaN (nothing to compare against)."""
    if not bool(torch.isfinite(ref).all()):
        return {"sqnr_db": math.nan, "rel_l2": math.nan, "row_sqnr_db": math.nan}
    if not bool(torch.isfinite(got).all()):
        return {"sqnr_db": -math.inf, "rel_l2": math.inf, "row_sqnr_db": -math.inf}
    r = ref.detach().double()
    diff = got.detach().double() - r
    signal = float(r.square().sum())
    noise = float(diff.square().sum())
    if noise == 0:
        return {"sqnr_db": math.inf, "rel_l2": 0.0, "row_sqnr_db": math.inf}
    if signal == 0:
        return {"sqnr_db": -math.inf, "rel_l2": math.inf, "row_sqnr_db": -math.inf}
    return {"sqnr_db": 10 * math.log10(signal / noise), "rel_l2": math.sqrt(noise / signal),
            "row_sqnr_db": _median_row_sqnr(r, diff)}


def _median_row_sqnr(ref: torch.Tensor, diff: torch.Tensor) -> float:
    """The median over rows (tokens; a weight gradient's output features) of each row's SQNR. The tensor's own
    SQNR is weighted by energy: a few large rows (an attention sink's massive activations) can hide that every
    other row lost half its bits."""
    r2 = ref.reshape(-1, ref.shape[-1]).square().sum(-1) if ref.dim() else ref.square().reshape(1)
    d2 = diff.reshape(-1, diff.shape[-1]).square().sum(-1) if diff.dim() else diff.square().reshape(1)
    keep = r2 > 0
    if not bool(keep.any()):
        return -math.inf
    ratio = r2[keep] / d2[keep]                     # inf where a row is exact
    return float(10 * torch.log10(ratio.median()))


def _keep_worst(into: dict, new: dict) -> None:
    for key, value in new.items():
        if isinstance(value, dict):
            _keep_worst(into.setdefault(key, {}), value)
            continue
        old = into.get(key)
        if old is None or math.isnan(value):
            into[key] = value
        elif not math.isnan(old):           # NaN stays: one batch could not be judged
            into[key] = _WORST[key](old, value)


def _detached_linear(lin: nn.Linear) -> nn.Linear:
    """A plain nn.Linear on ``lin``'s weight and bias storage, cut from its autograd: what torchao swaps and
    F.linear runs, whatever ``lin``'s subclass adds. Nothing here writes the storage; sharing it saves a
    copy of every weight."""
    with torch.device("meta"):
        plain = nn.Linear(lin.in_features, lin.out_features, bias=lin.bias is not None)
    plain.weight = nn.Parameter(lin.weight.detach())
    if lin.bias is not None:
        plain.bias = nn.Parameter(lin.bias.detach())
    return plain


def _run(layer: nn.Module, x: torch.Tensor, grad_output: torch.Tensor | None, *,
         autocast: torch.dtype | None = None, scale: float = 1.0) -> dict[str, torch.Tensor]:
    """``layer``'s output on ``x`` and, given ``grad_output`` (multiplied by ``scale``, divided back out of
    the results), grad_input and grad_weight; all as fp32."""
    x = x.detach().requires_grad_(True)
    amp = torch.autocast(x.device.type, dtype=autocast, enabled=autocast is not None)
    with torch.enable_grad(), amp:
        y = layer(x)
    out = {"output": y.detach().float()}
    if grad_output is not None:
        # The gradient arriving at a lowered output is in that output's dtype, as in training; a scaled one
        # is born scaled (the loss was multiplied), so the scale is applied before the cast.
        go = (grad_output * scale).to(y.dtype)
        gi, gw = torch.autograd.grad(y, (x, layer.weight), go)
        out["grad_input"] = gi.float() / scale
        out["grad_weight"] = gw.float() / scale
    return out


def _run_fp16_scaled(layer: nn.Module, x: torch.Tensor, grad_output: torch.Tensor | None) -> dict:
    scale = _GRAD_SCALER_INIT
    for _ in range(_GRAD_SCALER_BACKOFFS):
        out = _run(layer, x, grad_output, autocast=torch.float16, scale=scale)
        if grad_output is None or all(bool(torch.isfinite(out[r]).all()) for r in ("grad_input", "grad_weight")):
            return out
        if not bool(torch.isfinite(out["output"]).all()):
            return out          # the forward itself overflows fp16: a smaller loss scale cannot help
        scale /= 2
    return out


def _cast_stats(cfg: Any, x: torch.Tensor, weight: torch.Tensor, grad_output: torch.Tensor | None) -> dict:
    operands = {"input": x.reshape(-1, x.shape[-1]), "weight": weight.detach(),
                "grad_output": None if grad_output is None else grad_output.reshape(-1, grad_output.shape[-1])}
    out = {}
    for key, operand, config_field, axis in _CASTS:
        cast = getattr(cfg, config_field)
        axiswise = cast.scaling_granularity.value == "axiswise"
        if operands[operand] is None or cast.scaling_type.value == "disabled" or (key != operand and not axiswise):
            continue
        out[key] = fp8.cast_stats(operands[operand], dtype=cast.target_dtype,
                                  granularity=cast.scaling_granularity,
                                  round_scales_to_power_of_2=cfg.round_scales_to_power_of_2, axiswise_dim=axis)
    return out


def _measure_recipe(lin: nn.Linear, r: Recipe, x: torch.Tensor, grad_output: torch.Tensor | None,
                    ref: dict[str, torch.Tensor], with_stats: bool) -> dict:
    from ampaudit.planning import emulate

    got = _run(emulate.recipe_linear(_detached_linear(lin), r), x, grad_output)
    out: dict = {role: error_metrics(ref[role], got[role]) for role in ROLES if role in ref}
    if not with_stats:
        return out
    if r.family == "float8":
        out["stats"] = _cast_stats(fp8.config(r.torchao), x, lin.weight, grad_output)
    else:
        out["stats"] = emulate.quant_stats(r, x, lin.weight, grad_output)
    return out


def measure_call(lin: nn.Linear, x: torch.Tensor, grad_output: torch.Tensor | None, *,
                 dtypes: Sequence[str] = tuple(DTYPES), config: Any = None,
                 recipe_stats: bool = True) -> tuple[dict, dict]:
    """``(metrics, stats)`` of one call of ``lin`` on FP32 input ``x`` with FP32 ``grad_output`` (None: forward
    only); ``config``: torchao's Float8LinearConfig, needed when "float8" is in ``dtypes``."""
    plain = _detached_linear(lin)
    x = x.float()
    grad_output = None if grad_output is None else grad_output.float()
    ref = _run(plain, x, grad_output)
    metrics: dict[str, dict] = {}
    for name in dtypes:
        if name in recipe_names():
            metrics[name] = _measure_recipe(lin, recipe(name), x, grad_output, ref, recipe_stats)
            continue
        if name == "float8":
            float8 = fp8.import_torchao()
            got = _run(float8.convert_to_float8_training(_detached_linear(lin), config=config), x, grad_output)
        elif name == "float16":
            got = _run_fp16_scaled(plain, x, grad_output)
        else:
            got = _run(plain, x, grad_output, autocast=DTYPES[name])
        metrics[name] = {role: error_metrics(ref[role], got[role]) for role in ROLES if role in ref}
    stats = _cast_stats(config, x, plain.weight, grad_output) if "float8" in dtypes else {}
    return metrics, stats


def _linears(root: nn.Module, modules: Iterable[str] | None) -> list[tuple[str, nn.Linear]]:
    found = [(name, m) for name, m in root.named_modules() if isinstance(m, nn.Linear)]
    if not found:
        raise UsageError(f"{type(root).__name__} has no nn.Linear: nothing to plan",
                         hint="ampaudit plan chooses float8 per nn.Linear (torchao converts only those)")
    if modules is None:
        return found
    wanted = list(modules)
    names = {name for name, _ in found}
    unknown = [m for m in wanted if m not in names]
    if unknown:
        shown = ", ".join(name for name, _ in found[:5]) + (", ..." if len(found) > 5 else "")
        raise UsageError(f"no nn.Linear named {', '.join(map(repr, unknown))} in {type(root).__name__}",
                         hint=f"name Linear modules by their dotted path ({shown})")
    return [(name, m) for name, m in found if name in set(wanted)]


def _check_materialised(root: nn.Module) -> None:
    if any(t.is_meta for t in (*root.parameters(), *root.buffers())):
        raise UsageError(f"{type(root).__name__} is on the meta device: it has no values to measure",
                         hint="load its weights (to_empty() and load_state_dict()) before measuring")


def _record(root: nn.Module, linears: list[tuple[str, nn.Linear]], batch: tuple,
            loss_fn: Callable | None) -> dict[str, list[list]]:
    """name -> per call [FP32 input, grad_output or None] of one FP32 forward and backward of ``batch``."""
    args, kwargs = tuple(batch[0]), dict(batch[1])
    target = batch[2] if len(batch) > 2 else None
    calls: dict[str, list[list]] = {}
    edges: list[tuple[list, Any]] = []

    def hook_for(name: str) -> Callable:
        def hook(mod, h_args, h_kwargs, output):
            x = h_args[0] if h_args else h_kwargs.get("input")
            if not isinstance(x, torch.Tensor) or not isinstance(output, torch.Tensor):
                return
            # A clone: the model may write into its activations after the call. The gradient edge, not the
            # tensor: an in-place op on the output (ReLU(inplace=True)) must not change what is asked for.
            call = [x.detach().clone(), None]
            calls.setdefault(name, []).append(call)
            if output.requires_grad:
                edges.append((call, get_gradient_edge(output)))
        return hook

    handles = [lin.register_forward_hook(hook_for(name), with_kwargs=True) for name, lin in linears]
    try:
        with torch.enable_grad():
            try:
                out = root(*args, **kwargs)
            except AmpAuditError:
                raise
            except Exception as exc:
                first = (str(exc).strip().splitlines() or [""])[0][:200]
                raise InputError(f"the FP32 forward of {type(root).__name__} raised {type(exc).__name__}: {first}",
                                 hint="check that the batches fit forward()") from exc
            total = batch_loss(loss_fn, target, proxy="sum")(out)
    finally:
        for h in handles:
            h.remove()
    if edges and isinstance(total, torch.Tensor) and total.requires_grad:
        with torch.enable_grad():      # the caller's no_grad must not cut the reduction off the graph
            total = total.float().sum()
        grads = torch.autograd.grad(total, [e for _, e in edges], allow_unused=True)
        for (call, _), g in zip(edges, grads):
            call[1] = None if g is None else g.detach()
    return calls


def _runnable(m: LayerMeasure, lin: nn.Linear, x: torch.Tensor, dtypes: Sequence[str]) -> tuple[str, ...]:
    """``dtypes`` less the recipes that cannot run this call (the reason kept in ``m.unsupported``)."""
    from ampaudit.planning import emulate

    out = []
    for name in dtypes:
        if name in recipe_names() and name not in m.unsupported:
            why = emulate.unsupported(recipe(name), tokens=x.numel() // max(lin.in_features, 1),
                                      k=lin.in_features, n=lin.out_features)
            if why:
                m.unsupported[name] = why
                m.metrics.pop(name, None)          # an earlier call's numbers do not stand for the layer
        if name not in m.unsupported:
            out.append(name)
    return tuple(out)


def measure_layers(model: nn.Module, batches: Iterable[tuple], *, recipe: str = "tensorwise",
                   loss_fn: Callable[[Any, Any], torch.Tensor] | None = None, modules: Iterable[str] | None = None,
                   dtypes: Sequence[str] = tuple(DTYPES)) -> list[LayerMeasure]:
    """One :class:`LayerMeasure` per nn.Linear of ``model`` (``modules``: only those dotted names), in module
    order, from ``batches`` of ``(args, kwargs)`` or ``(args, kwargs, target)``.

    The backward differentiates ``loss_fn(output, target)`` for batches with a target, else the sum of the
    floating outputs. ``recipe``: torchao's float8 recipe (:data:`ampaudit.precision.fp8.RECIPES`) of "float8";
    ``dtypes``: some of "float8", "bfloat16", "float16" and recipe names (rules/policy/recipes.toml). The model runs in the mode it is in; its parameters, gradients,
    buffers and the RNG are as before afterwards. A Linear whose forward never runs (MultiheadAttention's
    out_proj: its weight is used directly) is left out, with a note.
    """
    dtypes = tuple(dtypes)
    bad = [d for d in dtypes if d not in DTYPES and d not in recipe_names()]
    if bad:
        raise UsageError(f"cannot measure dtype {', '.join(map(repr, bad))}",
                         hint=f"use {', '.join(DTYPES)} or a recipe ({', '.join(recipe_names())})")
    if recipe not in fp8.RECIPES:
        raise UsageError(f"unknown float8 recipe {recipe!r}", hint=f"use one of {', '.join(fp8.RECIPES)}")
    config = fp8.config(recipe) if "float8" in dtypes else None
    root = unwrap(model)
    _check_materialised(root)
    names = [name for name, _ in _linears(root, modules)]
    if not all(p.dtype == torch.float32 for p in root.parameters() if p.is_floating_point()):
        # The reference must be FP32: a model held in another dtype is measured as an FP32 copy of itself.
        note("the model's weights are not all float32: measured on a float32 copy")
        root = copy.deepcopy(root).float()
    linears = [(name, root.get_submodule(name)) for name in names]
    results = {name: LayerMeasure(name, lin.in_features, lin.out_features) for name, lin in linears}
    ran: set[str] = set()
    count = 0
    # Parameters (an EMA teacher updated in forward), BatchNorm statistics, modes and the RNGs as they were,
    # whatever the mode.
    with kept(root):
        for batch in batches:
            count += 1
            calls = _record(root, linears, batch, loss_fn)
            for name, lin in linears:
                for x, grad_output in calls.pop(name, []):
                    ran.add(name)
                    m = results[name]
                    m.tokens = max(m.tokens, x.numel() // max(lin.in_features, 1))
                    # A recipe's cast statistics come from the first batch: they cost more than its run
                    # (BENCHMARKS.md, "Recipes": planning time), and say why; the SQNR over every batch decides.
                    metrics, stats = measure_call(lin, x, grad_output, dtypes=_runnable(m, lin, x, dtypes),
                                                  config=config, recipe_stats=count == 1)
                    _keep_worst(m.metrics, metrics)
                    _keep_worst(m.stats, stats)
    if not count:
        raise InputError("no batches to measure on", hint="pass at least one (args, kwargs) batch")
    for name in names:
        if name not in ran:
            note(f"{name}: not measured: never called on these batches (or its weight is used without calling "
                 f"it, as MultiheadAttention does with out_proj)")
    return [results[name] for name in names if name in ran]
