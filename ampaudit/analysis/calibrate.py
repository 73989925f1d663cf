"""Calibration: run the model on real inputs in FP32 and under the target's autocast, and measure what breaks.

    cal = calibrate(model, [(args, kwargs), ...], Policy.load("cuda", "float16"))
    cal.nonfinite     # first inf/NaN origins (module, op, source), in execution order; a raising forward too
    cal.modules       # per module: divergence from FP32 (global and local), absmax, headroom, underflow
    cal.out_dtypes    # per module: the dtype its output really has under the target's autocast
    cal.buffers       # running statistics beyond the dtype's range
    cal.decisions     # per decision op (argmax, topk, x > t, round, ...): the share that differs from FP32

Calibration runs on the CPU (``device_type="cuda"`` runs it on a GPU's own autocast instead: what
bench/gpu_day.py compares the simulation with). A CPU target runs under CPU autocast as it is. A CUDA target is
simulated (:mod:`ampaudit.simulate`): CPU autocast lowers the GEMMs as CUDA's does, and the ops CUDA autocast keeps
in fp32 (softmax, exp, pow, sum, norm, layer_norm, ...) run in fp32 however the model reaches them, so the numbers
follow CUDA's policy table.

A module's range (overflow, headroom, underflow) is judged against the dtype its output is really stored in under
the target's autocast, recorded in the autocast run: a module that leaves autocast (an fp32 island, an op the
policy keeps in fp32) returns fp32 values, which lose nothing to the low dtype's range.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import nn
from ampaudit.policy import Policy
from ampaudit.runtime.locate import float_tensors, module_names
from ampaudit.simulate import simulation
from ampaudit.wrappers import unwrap


@dataclass
class Calibration:
    """What calibration measured; the calibrated_* matchers turn it into findings."""

    policy: Policy
    batches: int
    nonfinite: list[dict] = field(default_factory=list)
    modules: dict[str, dict] = field(default_factory=dict)
    buffers: list[dict] = field(default_factory=list)
    order: list[str] = field(default_factory=list)   # modules in execution order
    out_dtypes: dict[str, torch.dtype] = field(default_factory=dict)   # narrowest floating output, under autocast
    decisions: list[dict] = field(default_factory=list)   # ampaudit.runtime.decision_record rows, summed over batches


def _merge(into: dict, row: dict) -> None:
    # Over several batches keep the worst value of each metric.
    worse_high = ("rel_l2", "max_abs", "local_rel_l2", "local_max_abs", "absmax", "overflow", "underflow_share",
                  "flush_share")
    worse_low = ("cosine", "sqnr_db", "local_cosine", "local_sqnr_db", "headroom_bits")
    for key, value in row.items():
        if not isinstance(value, (int, float)) or key not in into:
            into[key] = value
        elif key in worse_high:
            into[key] = value if math.isnan(value) or value > into[key] else into[key]
        elif key in worse_low:
            into[key] = value if math.isnan(value) or value < into[key] else into[key]


def calibrate(model: nn.Module, batches: Iterable[tuple], policy: Policy, *,
              loss_fn: Callable[[Any, Any], torch.Tensor] | None = None, device_type: str = "cpu") -> Calibration:
    """Measure ``model`` on ``batches`` of ``(args, kwargs)`` or ``(args, kwargs, target)`` under ``policy``
    (see the module docstring). The backward runs too: of ``loss_fn(output, target)`` for batches with a
    target, else of the sum of the floating outputs (computed in fp32). ``device_type="cuda"`` (model and
    batches already on the GPU) runs real CUDA autocast instead of the CPU simulation: what the simulation is
    checked against (bench/gpu_day.py)."""
    from ampaudit.runtime.compare import compare_to_fp32
    from ampaudit.runtime.decision_record import measure_or_note
    from ampaudit.runtime.locate import judge_against_fp32, locate_nonfinite

    cal = Calibration(policy=policy, batches=0)
    # On a real GPU its own autocast applies the policy; on CPU the simulation does.
    policy_on = (lambda: simulation(policy)) if device_type == "cpu" else contextlib.nullcontext
    model_was_training = model.training
    model.eval()  # calibration measures; it must not move BatchNorm statistics
    try:
        for batch in batches:
            args, kwargs = batch[0], batch[1]
            loss = batch_loss(loss_fn, batch[2] if len(batch) > 2 else None)
            cal.batches += 1
            with policy_on(), output_dtypes(model, into=cal.out_dtypes):
                events = locate_nonfinite(model, args, kwargs, device_type=device_type, dtype=policy.low, loss=loss)
            # A precision fault is non-finite under autocast and finite in FP32, whatever dtype the op ran in.
            events = judge_against_fp32(model, events, tuple(args), dict(kwargs), loss=loss)
            for ev in events:
                if ev.get("fp32_too"):
                    continue
                key = (ev.get("phase"), ev.get("module"), ev.get("op"), ev.get("source"), ev.get("kind"))
                if key not in {(e.get("phase"), e.get("module"), e.get("op"), e.get("source"), e.get("kind"))
                               for e in cal.nonfinite}:
                    cal.nonfinite.append(ev)
            if any(ev.get("kind") == "error" for ev in events):
                continue  # the forward raises under autocast: nothing to compare
            with policy_on():
                rows = compare_to_fp32(model, args, kwargs, dtype=policy.low, device_type=device_type)
            for row in rows:
                name = row["module"]
                if name not in cal.modules:
                    cal.order.append(name)
                    cal.modules[name] = {}
                _merge(cal.modules[name], row)
            with simulation(policy):
                merge_decisions(cal.decisions, measure_or_note(model, args, kwargs, device_type="cpu",
                                                               dtype=policy.low))
    finally:
        model.train(model_was_training)
    for name, row in cal.modules.items():
        judge_range(row, cal.out_dtypes.get(name), policy.low)
    # Buffers are judged against the low dtype: the message is about the model cast to it (model.half()).
    limit = torch.finfo(policy.low).max
    for name, buf in model.named_buffers():
        if buf.is_floating_point() and not buf.is_meta and buf.numel():
            # Largest finite magnitude: an inf or NaN already in FP32 (clamp bounds of +-inf that mean "no
            # clamp", as gemma4_vit's input_min/input_max) is the same value in the low dtype; nothing is lost.
            finite = buf.detach()[torch.isfinite(buf.detach())]
            value = float(finite.abs().max()) if finite.numel() else 0.0
            if value > limit:
                cal.buffers.append({"module": name.rpartition(".")[0], "buffer": name, "absmax": value})
    return cal


def merge_decisions(into: list[dict], rows: list[dict]) -> None:
    """Add one batch's decision rows to ``into``: counts summed per (module, op, source), used if used once."""
    index = {(r["module"], r["op"], r["source"]): r for r in into}
    for row in rows:
        seen = index.get((row["module"], row["op"], row["source"]))
        if seen is None:
            seen = index[(row["module"], row["op"], row["source"])] = dict(row)
            into.append(seen)
            continue
        for key in ("decisions", "flipped", "calls"):
            seen[key] += row[key]
        seen["used"] = seen["used"] or row["used"]
        seen["share_flipped"] = seen["flipped"] / seen["decisions"] if seen["decisions"] else 0.0


_HOLDS_FP32 = (torch.float32, torch.float64)


def _narrower(a: torch.dtype, b: torch.dtype) -> bool:
    fa, fb = torch.finfo(a), torch.finfo(b)
    return (fa.bits, fa.max) < (fb.bits, fb.max)


@contextlib.contextmanager
def output_dtypes(model: nn.Module, *, into: dict[str, torch.dtype]) -> Iterator[dict[str, torch.dtype]]:
    """While active, record in ``into`` the narrowest floating dtype each module of ``model`` returns (names as
    :func:`~ampaudit.runtime.locate.module_names` gives them; a module called twice keeps the narrower)::

        with torch.autocast("cpu", dtype=torch.float16), output_dtypes(model, into=seen):
            model(x)
        seen["attn"]      # torch.float32 when attn runs with autocast off
    """
    from torch.nn.modules.module import register_module_forward_hook

    names = module_names(unwrap(model))

    def record(mod: nn.Module, args: Any, out: Any) -> None:
        name = names.get(mod)
        if name is None:
            return
        for t in float_tensors(out):
            prev = into.get(name)
            if prev is None or _narrower(t.dtype, prev):
                into[name] = t.dtype

    handle = register_module_forward_hook(record)
    try:
        yield into
    finally:
        handle.remove()


def judge_range(row: dict, stored: torch.dtype | None, low: torch.dtype) -> dict:
    """Judge a module's measured range ``row`` (overflow, headroom_bits, underflow and flush shares of its FP32
    output, measured against ``low``) against ``stored``, the dtype its output has under autocast; sets
    ``row["range_dtype"]``. An output stored in fp32 (or wider) holds every FP32 value: no overflow, no
    underflow, headroom up to fp32's max. Another dtype (or unknown: the module did not run under autocast)
    keeps the judgement against ``low``."""
    if stored in _HOLDS_FP32 and "absmax" in row:
        a = row["absmax"]
        row.update(overflow=0, underflow_share=0.0, flush_share=0.0,
                   headroom_bits=(math.log2(torch.finfo(stored).max / a) if 0 < a < math.inf
                                  else (math.inf if a == 0 else -math.inf)))
        row["range_dtype"] = str(stored).replace("torch.", "")
    else:
        row["range_dtype"] = str(low).replace("torch.", "")
    return row


def batch_loss(loss_fn, target) -> Callable[[Any], torch.Tensor]:
    """What calibration differentiates: the model file's loss on this batch's target, else a sum of outputs."""
    if loss_fn is not None and target is not None:
        return lambda out: loss_fn(out, target)

    def total(out):
        parts = [t.float().sum() for t in float_tensors(out) if t.requires_grad]   # dataclass outputs too
        return torch.stack(parts).sum() if parts else None
    return total


def batches_from(loaded: Any, count: int) -> list[tuple]:
    """``count`` batches ``(args, kwargs, target)`` from the model file's ``train_data()``, else its example
    inputs once (no target: calibration's backward then differentiates a sum of the outputs)."""
    from ampaudit.errors import InputError

    if count <= 0:
        return [(loaded.args, loaded.kwargs)]
    fn = loaded.hook("train_data")
    if fn is None:
        raise InputError(f"--calibrate-batches needs train_data() in {loaded.display}",
                         hint="define train_data() yielding (inputs, target), or calibrate on example_inputs()")
    out = []
    for item in fn():
        pair = isinstance(item, (tuple, list)) and len(item) == 2
        inputs, target = (item[0], item[1]) if pair else (item, None)
        if isinstance(inputs, dict):
            out.append(((), inputs, target))
        else:
            out.append((tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,), {}, target))
        if len(out) >= count:
            break
    return out
