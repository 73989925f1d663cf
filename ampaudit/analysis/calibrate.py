"""Calibration: run the model on real inputs in FP32 and under the target's autocast, and measure what breaks.

    cal = calibrate(model, [(args, kwargs), ...], Policy.load("cuda", "float16"))
    cal.nonfinite     # first inf/NaN origins (module, op, source), in execution order; a raising forward too
    cal.modules       # per module: divergence from FP32 (global and local), absmax, headroom, underflow
    cal.out_dtypes    # per module: the dtype its output really has under the target's autocast
    cal.buffers       # running statistics beyond the dtype's range
    cal.decisions     # per decision op (argmax, topk, x > t, round, ...): the share that differs from FP32

Calibration runs where the model is, under the target's autocast (:func:`ampaudit.simulate.target_autocast`): on a
GPU its own autocast (what bench/gpu_day.py compares the simulation with). On a CPU, a CPU target runs under CPU
autocast as it is, and a CUDA target is simulated (:mod:`ampaudit.simulate`): CPU autocast lowers the GEMMs as CUDA's does, and the ops CUDA autocast keeps
in fp32 (softmax, exp, pow, sum, norm, layer_norm, ...) run in fp32 however the model reaches them, so the numbers
follow CUDA's policy table.

A module's range (overflow, headroom, underflow) is judged against the dtype its output is really stored in under
the target's autocast, recorded in the autocast run: a module that leaves autocast (an fp32 island, an op the
policy keeps in fp32) returns fp32 values, which lose nothing to the low dtype's range.

The backward differentiates what training would: the model file's ``loss_fn(output, target)`` on
``train_data()`` batches (:func:`calibration_data` picks them, for ``check`` and ``fix`` alike); without a loss, the
mean of the outputs, whose gradient (1/numel per element) is a mean loss's size. A sum's gradient of 1 per element,
summed over a 50257-wide head and every token, overflows fp16 where training does not. ``cal.backward`` says which
ran.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import nn
from ampaudit.dtypes import limits, narrower
from ampaudit.policy import Policy
from ampaudit.runtime.buffer_uses import overflowing_buffers
from ampaudit.runtime.module_stack import module_names
from ampaudit.runtime.replay_state import float_tensors, model_device
from ampaudit.simulate import target_autocast
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
    backward: str = ""     # what the backward differentiated, for the report (backward_label)
    # The run's storage (check --opt-level) and what training showed (check --train-steps): rows of
    # ampaudit.runtime.swamping (``origin`` "forward" or "training") and of ampaudit.report.trace_verdicts.
    opt_level: str = "O1"
    swamping: list[dict] = field(default_factory=list)
    precursors: list[dict] = field(default_factory=list)
    trained: dict | None = None      # {"steps", "diverged_step"} of the training steps, when they ran


def _merge(into: dict, row: dict) -> None:
    # Over several batches keep the worst value of each metric.
    worse_high = ("rel_l2", "max_abs", "local_rel_l2", "local_max_abs", "local_input_rel_l2", "local_output_rel_l2", "absmax", "overflow", "underflow_share",
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
              loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
              origin: str = "the given batches", device_type: str | None = None) -> Calibration:
    """Measure ``model`` on ``batches`` of ``(args, kwargs)`` or ``(args, kwargs, target)`` under ``policy``
    (see the module docstring). The backward runs too: of ``loss_fn(output, target)`` for batches with a
    target, else of the mean of the floating outputs (computed in fp32). ``origin`` names where the batches
    came from in ``cal.backward`` ("train_data()"). The forwards run under
    :func:`~ampaudit.simulate.target_autocast` on ``device_type`` (default: where the model's parameters are):
    on a GPU (model and batches already there) CUDA's own autocast, what the simulation is checked against
    (bench/gpu_day.py); on a CPU a CUDA target is simulated."""
    from ampaudit.runtime.compare import compare_to_fp32
    from ampaudit.runtime.decision_record import measure_or_note
    from ampaudit.runtime.locate import judge_against_fp32, locate_nonfinite

    batches = list(batches)
    device_type = device_type or model_device(unwrap(model))
    _note_untrained_norms(model)
    cal = Calibration(policy=policy, batches=0, backward=backward_label(loss_fn, batches, origin))
    # The measurements enter autocast around their forwards only; on CPU, a CUDA target is simulated.
    def policy_on():
        return target_autocast(policy, device_type, enter_autocast=False)
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
                if ev.get("fp32_too") or _machine_gap(ev, policy):
                    continue
                key = (ev.get("phase"), ev.get("module"), ev.get("op"), ev.get("source"), ev.get("kind"))
                if key not in {(e.get("phase"), e.get("module"), e.get("op"), e.get("source"), e.get("kind"))
                               for e in cal.nonfinite}:
                    cal.nonfinite.append(ev)
            if any(ev.get("kind") == "error" for ev in events):
                _require_fp32_forward(model, args, kwargs, f"{origin} batch {cal.batches}")
                continue  # the forward raises under autocast only: nothing to compare
            with policy_on():
                rows = compare_to_fp32(model, args, kwargs, dtype=policy.low, device_type=device_type)
            for row in rows:
                name = row["module"]
                if name not in cal.modules:
                    cal.order.append(name)
                    cal.modules[name] = {}
                _merge(cal.modules[name], row)
            with policy_on():
                merge_decisions(cal.decisions, measure_or_note(model, args, kwargs, device_type=device_type,
                                                               dtype=policy.low))
        # Buffers are judged against the low dtype: the message is about the model cast to it (model.half()).
        if batches:
            cal.buffers = overflowing_buffers(model, policy.low, *batches[0][:2])
            _judge_fp32_floor(cal, model, batches[0])
    finally:
        model.train(model_was_training)
    for name, row in cal.modules.items():
        judge_range(row, cal.out_dtypes.get(name), policy.low)
    return cal


def _judge_fp32_floor(cal: Calibration, model: nn.Module, batch: tuple) -> None:
    """How far FP32's own rounding moves each would-be divergence culprit's FP32 output (``fp32_moved``,
    :mod:`ampaudit.runtime.fp32_floor`); a note names those it moves past the line, which are not judged."""
    from ampaudit.notes import note
    from ampaudit.runtime.attribution import calibration_culprits, fp32_unstable
    from ampaudit.runtime.fp32_floor import fp32_moved

    names = [c.module for c in calibration_culprits(cal.order, cal.modules, cal.policy.low) if c.rule != "nonfinite"]
    if not names:
        return
    for name, moved in fp32_moved(unwrap(model), batch[0], batch[1], names).items():
        cal.modules[name]["fp32_moved"] = moved
    unstable = [n for n in cal.order if n in names and fp32_unstable(cal.modules[n], cal.policy.low)]  # model order
    if unstable:
        more = f" and {len(unstable) - 1} more" if len(unstable) > 1 else ""
        worst = max(cal.modules[n]["fp32_moved"] for n in unstable)
        by = f"up to {worst:.0%}" if worst < 10 else "over 1000%"
        note(f"own error of {unstable[0] or 'the top module'}{more} not judged: moving its FP32 inputs by one unit "
             f"in the last place moves its FP32 output by {by}, so FP32 does not determine it either "
             f"(a normalisation of a constant signal, as on untrained weights)")


def untrained_norms(model: nn.Module) -> list[str]:
    """The BatchNorm layers of ``model`` whose running statistics were never updated (no batch tracked, mean 0,
    variance 1): in eval mode, which calibration runs in, such a layer is an identity and normalises nothing."""
    found = []
    for name, mod in unwrap(model).named_modules():
        if not isinstance(mod, nn.modules.batchnorm._BatchNorm) or mod.running_mean is None:
            continue
        tracked = mod.num_batches_tracked
        if (tracked is None or int(tracked) == 0) and not bool(mod.running_mean.any()) \
                and bool((mod.running_var == 1).all()):
            found.append(name)
    return found


def _note_untrained_norms(model: nn.Module) -> None:
    # A model checked before its first training step (random init) keeps BatchNorm's initial statistics. In eval
    # mode its activations then drift layer by layer (a random-init resnet152 reaches inf in fp16, efficientnet's
    # fall into the subnormals) where training normalises by each batch: the findings are true of these weights in
    # eval mode, not of training, and the report must say which it measured.
    from ampaudit.notes import note

    names = untrained_norms(model)
    if names:
        more = f" and {len(names) - 1} more" if len(names) > 1 else ""
        note(f"calibrated in eval mode with {len(names)} BatchNorm layer(s) never updated ({names[0]}{more}: "
             "running mean 0, variance 1), which normalise nothing there: an untrained model's activations can "
             "drift to ranges training, normalising by each batch, never sees; calibrate trained weights for "
             "training's ranges")


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


def _require_fp32_forward(model: nn.Module, args, kwargs, where: str) -> None:
    """An InputError when the FP32 forward raises on this batch too: the batch does not fit the model (a
    train_data() of the wrong shape), which is no autocast fault to report."""
    from ampaudit.errors import InputError
    from ampaudit.runtime.replay_state import preserved

    try:
        with torch.no_grad(), preserved(unwrap(model), None):
            model(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the user's model on the user's data
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        raise InputError(f"the FP32 forward of {type(unwrap(model)).__name__} raises on {where}: "
                         f"{type(exc).__name__}: {first}",
                         hint="make train_data() yield what forward() takes (--calibrate runs the model on it)"
                         if "train_data" in where else "make the inputs fit forward()") from exc


def _machine_gap(ev: dict, policy: Policy) -> bool:
    """True (and a note) when ``ev`` is an op raising because this machine has no kernel for the low dtype
    (:func:`~ampaudit.machine.kernels.kernel_gap`): a fact about this CPU, not a finding about the target."""
    from ampaudit.machine.kernels import kernel_gap
    from ampaudit.notes import note

    gap = kernel_gap(ev.get("message"), policy.low) if ev.get("kind") == "error" else None
    if gap is None:
        return False
    note(gap.sentence(policy.device, stops_at=ev.get("module") or ""))
    return True


_HOLDS_FP32 = (torch.float32, torch.float64)


@contextlib.contextmanager
def output_dtypes(model: nn.Module, *, into: dict[str, torch.dtype]) -> Iterator[dict[str, torch.dtype]]:
    """While active, record in ``into`` the narrowest floating dtype each module of ``model`` returns (names as
    :func:`~ampaudit.runtime.module_stack.module_names` gives them; a module called twice keeps the narrower)::

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
            if prev is None or narrower(t.dtype, prev):
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
                   headroom_bits=(math.log2(limits(stored).max / a) if 0 < a < math.inf
                                  else (math.inf if a == 0 else -math.inf)))
        row["range_dtype"] = str(stored).replace("torch.", "")
    else:
        row["range_dtype"] = str(low).replace("torch.", "")
    return row


def batch_loss(loss_fn, target, *, proxy: str = "mean") -> Callable[[Any], torch.Tensor]:
    """What is differentiated for one batch: the model file's ``loss_fn`` on this batch's ``target``; without
    either, a ``proxy`` of the floating outputs (in fp32, dataclass outputs too): ``"mean"``, the sum of each
    output's mean (d proxy/d out = 1/numel, a mean loss's size: calibration's), or ``"sum"`` (gradient 1 per
    element: plan's, whose measurements are relative to FP32 and so independent of the scale)."""
    if loss_fn is not None and target is not None:
        return lambda out: loss_fn(out, target)
    if proxy not in ("mean", "sum"):
        raise ValueError(f"proxy must be 'mean' or 'sum', got {proxy!r}")

    def total(out):
        parts = [t.float().mean() if proxy == "mean" else t.float().sum()
                 for t in float_tensors(out) if t.requires_grad and t.numel()]
        return torch.stack(parts).sum() if parts else None
    return total


def backward_label(loss_fn, batches: list[tuple], origin: str) -> str:
    """What :func:`calibrate`'s backward differentiates on ``batches`` (from ``origin``), in words::

        backward_label(loss_fn, [(args, {}, y)], "train_data()")  # 'loss_fn(output, target) on train_data() batch 1'
    """
    targets = [len(b) > 2 and b[2] is not None for b in batches]
    if loss_fn is None or not any(targets):
        why = "no loss_fn" if loss_fn is None else f"{origin} gave no target for loss_fn"
        return f"mean of the outputs ({why})"
    n = len(batches)
    which = "batch 1" if n == 1 else f"batches 1-{n}"
    where = f"{origin} {which}" if origin.endswith("()") else f"{which} of {origin}"    # train_data() batch 1
    if all(targets):
        return f"loss_fn(output, target) on {where}"
    return f"loss_fn(output, target) on the {origin} batches with a target, else the mean of the outputs"


@dataclass
class CalibrationData:
    """The batches, loss and origin one calibration runs on (:func:`calibration_data`); ``note`` says why the
    default fell back to the example inputs, when it did."""

    batches: list[tuple]
    loss_fn: Callable[[Any, Any], torch.Tensor] | None
    origin: str
    note: str | None = None
    # What --train-steps trains with, from the model file as ``ampaudit train`` reads it (None: not there).
    train_data: Callable | None = None
    optimizer: Callable | None = None
    scheduler: Callable | None = None


def calibration_data(loaded: Any, count: int = 0, *, explicit_inputs: bool = False) -> CalibrationData:
    """What ``--calibrate`` runs on, for ``check`` and ``fix`` alike (one choice, so they agree): ``count``
    batches of the model file's ``train_data()`` (``--calibrate-batches``); by default (``count=0``) its first
    batch, differentiated through ``loss_fn``, when the file has both (and no ``--input``: ``explicit_inputs``);
    else the example inputs, with the mean of the outputs as the loss."""
    loss_fn = loaded.hook("loss_fn")
    train = {"train_data": loaded.hook("train_data"), "optimizer": loaded.hook("make_optimizer"),
             "scheduler": loaded.hook("make_scheduler")}
    if count > 0:
        return CalibrationData(batches_from(loaded, count), loss_fn, "train_data()", **train)
    example = CalibrationData([(loaded.args, loaded.kwargs)], loss_fn, "the example inputs", **train)
    if explicit_inputs or loss_fn is None or loaded.hook("train_data") is None:
        return example
    try:
        first = batches_from(loaded, 1)
    except Exception as exc:  # noqa: BLE001 - the user's train_data; the audit goes on, and says why
        text = (str(exc).strip().splitlines() or [""])[0][:160]
        example.note = f"train_data() raised {type(exc).__name__}: {text}; calibrated on the example inputs"
        return example
    if not first or len(first[0]) < 3 or first[0][2] is None:
        example.note = "train_data() gave no (inputs, target) batch; calibrated on the example inputs"
        return example
    return CalibrationData(first, loss_fn, "train_data()", **train)


def batches_from(loaded: Any, count: int) -> list[tuple]:
    """``count`` batches ``(args, kwargs, target)`` from the model file's ``train_data()``, else its example
    inputs once (no target: calibration's backward then differentiates the mean of the outputs)."""
    from ampaudit.errors import InputError

    if count <= 0:
        return [(loaded.args, loaded.kwargs)]
    fn = loaded.hook("train_data")
    if fn is None:
        raise InputError(f"--calibrate-batches needs train_data() in {loaded.display}",
                         hint="define train_data() yielding (inputs, target), or calibrate on example_inputs()")
    out = []
    for item in fn():
        out.append(as_batch(item))
        if len(out) >= count:
            break
    return out


def as_batch(item: Any) -> tuple:
    """One ``train_data()`` item (``(inputs, target)``, or bare inputs: a tensor, a tuple of them, a dict of
    keyword inputs) as ``(args, kwargs, target)``; an item already in that form (or ``(args, kwargs)``) as it is."""
    if (isinstance(item, (tuple, list)) and len(item) in (2, 3) and isinstance(item[0], (tuple, list))
            and isinstance(item[1], dict)):
        return tuple(item)
    pair = isinstance(item, (tuple, list)) and len(item) == 2
    inputs, target = (item[0], item[1]) if pair else (item, None)
    if isinstance(inputs, dict):
        return (), inputs, target
    return (tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)), {}, target
