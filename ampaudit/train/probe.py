"""What ``check --calibrate`` learns by running the model as training will: its state stored as the opt level
stores it, the in-place updates of one training-mode forward measured, and (``--train-steps N``) N steps of the
built-in :class:`~ampaudit.train.trainer.Trainer` on a copy, in memory.

    rows = forward_updates(model, batches, policy, opt_level="O2")   # one swamping row per tensor the forward wrote
    events = train_events(model, policy, TrainHooks(train_data, loss_fn, make_optimizer), steps=34, opt_level="O2")

Both run on a deep copy: the user's model, its buffers and the RNG states are left as they were, and nothing is
written to disk (the trace is a :class:`~ampaudit.runtime.trace.MemoryTrace`; the loss scaler
never halts, so no halt checkpoint is written). The measures are the runtime's own: the swamping meter
(:mod:`ampaudit.runtime.swamping`) and the watch's precursor meters, on every step.
"""
from __future__ import annotations

import copy
import itertools
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from ampaudit.api import TRAINING
from ampaudit.dtypes import name_of
from ampaudit.errors import InputError, UsageError
from ampaudit.policy import Policy
from ampaudit.runtime.replay_state import float_tensors, model_device, rng_snapshot
from ampaudit.simulate import target_autocast
from ampaudit.train.masters import LOW_PRECISION, cast_model_o2, check_opt_level, o2_mastered
from ampaudit.train.probe_loop import user_loop_events

# A forward of the copy that fails is a note, not an error: the calibration itself already ran the model.
_FAILED = (RuntimeError, TypeError, ValueError, IndexError)


def stored_copy(model: nn.Module, dtype: torch.dtype, opt_level: str) -> tuple[nn.Module, list[nn.Parameter]]:
    """A deep copy of ``model`` stored as a run at ``opt_level`` stores it, and its parameters that have an FP32
    master: O2 casts it as the trainer does (:func:`~ampaudit.train.masters.cast_model_o2`: BatchNorm stays fp32)
    and masters its trainable low-precision parameters (:func:`~ampaudit.train.masters.o2_mastered`); O1 keeps
    every tensor in the dtype the model holds it in, with no master."""
    twin = copy.deepcopy(model)
    if check_opt_level(opt_level) == "O2":
        cast_model_o2(twin, dtype)
        return twin, o2_mastered(twin)
    return twin, []


def forward_updates(model: nn.Module, batches: list[tuple], policy: Policy, *, opt_level: str = "O1",
                    device_type: str | None = None) -> tuple[list[dict], str | None]:
    """``(rows, note)``: per low-precision parameter or buffer without an FP32 master that a training-mode
    forward of ``batches`` (``(args, kwargs[, target])``, one after another, under the target's autocast)
    writes in place, the swamping meter's row of the batch where it lost the most (``flagged``: over the
    ``[swamping]`` lines; ``moved`` False: FP32 would not have moved it either). ``note`` says why a forward
    could not be measured."""
    from ampaudit.runtime.swamping import SwampMeter, low_precision

    level = check_opt_level(opt_level)
    stored_low = any(low_precision(t) for t in (*model.parameters(), *model.buffers()))
    if policy.low not in LOW_PRECISION or (level == "O1" and not stored_low):
        return [], None     # O1 keeps an fp32 model fp32: nothing it updates can round away (no copy is made)

    device_type = device_type or model_device(model)
    twin, mastered = stored_copy(model, policy.low, level)
    twin.train()
    meter = SwampMeter(twin, mastered=mastered, o2=level == "O2")
    worst: dict[str, dict] = {}
    restore_rng, note = rng_snapshot(), None
    try:
        for i, batch in enumerate(batches, 1):
            if not meter.begin(i):
                break       # nothing stored in low precision without a master
            try:
                with torch.no_grad(), target_autocast(policy, device_type):
                    twin(*batch[0], **batch[1])
            except _FAILED as exc:
                meter.abort()
                note = (f"the training-mode forward of the model stored for {opt_level} raised "
                        f"{type(exc).__name__}: {' '.join(str(exc).split())[:160]}; its in-place updates were "
                        "not measured")
                break
            for row in meter.finish(every=True):
                seen = worst.get(row["tensor"])
                if seen is None or _loses_more(row, seen):
                    worst[row["tensor"]] = row
    finally:
        restore_rng()
    return list(worst.values()), note


def _loses_more(row: dict, seen: dict) -> bool:
    if row["flagged"] != seen["flagged"]:
        return row["flagged"]
    if row["moved"] != seen["moved"]:
        return row["moved"]
    return row.get("share_rounded", 0.0) > seen.get("share_rounded", 0.0)


@dataclass
class TrainHooks:
    """What training a copy needs from the model file (``ampaudit train`` reads the same functions):
    ``train_data`` (None: the example inputs, repeated), ``loss_fn`` (None or no ``train_data``: the mean of the
    floating outputs), ``optimizer`` / ``scheduler`` factories (``make_optimizer`` / ``make_scheduler``), ``lr``."""

    train_data: Callable | None = None
    loss_fn: Callable | None = None
    optimizer: Callable | None = None
    scheduler: Callable | None = None
    lr: float | None = None


def mean_of_outputs(output: Any, target: Any) -> torch.Tensor:
    """The loss of a model file without ``train_data``/``loss_fn``: the sum of its floating outputs' means (fp32)."""
    parts = [t.float().mean() for t in float_tensors(output) if t.numel()]
    if not parts:
        raise InputError("the forward returned no floating tensor to train on",
                         hint="give the model file train_data() and loss_fn(output, target)")
    return torch.stack(parts).sum()


def _data(hooks: TrainHooks, example: tuple[tuple, dict]) -> tuple[Callable, Callable, str]:
    """``(train_data factory, loss_fn, words)``: the model file's ``train_data`` (with its ``loss_fn``, else the
    mean of the outputs), else its example inputs repeated with the mean of the outputs (no target to give a
    ``loss_fn``), as bench/both_paths.py trains a file without them."""
    if hooks.train_data is not None:
        if hooks.loss_fn is not None:
            return hooks.train_data, hooks.loss_fn, "train_data() and loss_fn"
        return hooks.train_data, mean_of_outputs, "train_data() with the mean of the outputs as the loss (no loss_fn)"
    args, kwargs = example
    if args and kwargs:
        raise UsageError("train_steps without train_data() needs inputs that are all positional or all keyword",
                         hint="give the model file train_data() yielding (inputs, target)")
    inputs = kwargs if kwargs else tuple(args)
    return (lambda: itertools.repeat((inputs, None)), mean_of_outputs,
            "the example inputs, repeated, with the mean of the outputs as the loss (no train_data())")


def train_events(model: nn.Module, policy: Policy, hooks: TrainHooks, *, steps: int, opt_level: str = "O1",
                 example: tuple[tuple, dict] = ((), {}), device_type: str | None = None) -> tuple[list[dict], str]:
    """``(events, note)``: the trace events of ``steps`` optimizer steps of the built-in Trainer on a copy of
    ``model`` (target dtype ``policy.low`` at ``opt_level``, a CUDA target simulated on CPU as calibration does),
    the watch sampling every step; ``note`` says what it trained on, and how it ended."""
    from ampaudit.runtime.trace import MemoryTrace
    from ampaudit.train.trainer import Trainer

    if policy.low not in LOW_PRECISION:
        raise UsageError(f"train_steps trains under fp16 or bf16 autocast, not {name_of(policy.low)}",
                         hint="use dtype=float16 or bfloat16 with train_steps")
    train_data, loss_fn, words = _data(hooks, example)
    device_type = device_type or model_device(model)
    if check_opt_level(opt_level) == "O1" and o2_mastered(model):     # trainable fp16/bf16 weights, no master
        events, done = user_loop_events(model, policy, train_data, loss_fn, hooks, steps=steps,
                                        device_type=device_type)
        ended = "" if done >= steps else f"; the data ran out after {done} step(s)"
        return events, (f"trained a copy {done} step(s) as a plain loop steps its {name_of(policy.low)} weights (no "
                        f"FP32 master: the built-in trainer refuses them at O1) on {words}{ended}, the runtime's "
                        "swamping and precursor meters on every step")
    trace = MemoryTrace()
    twin, restore_rng = copy.deepcopy(model), rng_snapshot()
    twin.train()            # a check may be given a model in eval mode; training runs in training mode
    try:
        with warnings.catch_warnings(), target_autocast(policy, device_type, enter_autocast=False):
            warnings.simplefilter("ignore")     # the trainer's start warnings are the trace's preflight event
            trainer = Trainer(twin, loss_fn, train_data, dtype=name_of(policy.low), device=device_type,
                              opt_level=opt_level, trace=trace, trace_every=1,
                              optimizer=hooks.optimizer, scheduler=hooks.scheduler, lr=hooks.lr,
                              max_consecutive_skips=None, handle_signals=False, progress=False,
                              meta={"target": "check --calibrate --train-steps"})
            with trainer:
                result = trainer.fit(steps=steps)
    finally:
        restore_rng()
    ended = "" if result.steps >= steps else f"; the data ran out after {result.steps} step(s)"
    return trace.events, (f"trained a copy {result.steps} step(s) at {opt_level} in {name_of(policy.low)} on {words}"
                    f"{ended}, the runtime's swamping and precursor meters on every step")


@TRAINING.register("calibrate")
def measure_training(cal: Any, model: nn.Module, data: Any, policy: Policy, *, opt_level: str, steps: int,
                     lr: float | None, example: tuple[tuple, dict]) -> list[str]:
    """Fill calibration ``cal``'s opt level, ``swamping`` rows (``origin``: "forward", "training") and, after
    ``steps`` training steps (judged as ``ampaudit report`` judges their trace:
    :func:`~ampaudit.report.trace_verdicts.training_verdicts`), ``precursors`` and ``trained``; the notes to
    report. ``data``: the :class:`~ampaudit.analysis.calibrate.CalibrationData` calibration ran on."""
    cal.opt_level = opt_level
    rows, note = forward_updates(model, data.batches, policy, opt_level=opt_level)
    cal.swamping = [{**r, "origin": "forward"} for r in rows]
    notes = [note] if note else []
    if steps:
        from ampaudit.report.trace_verdicts import training_verdicts

        hooks = TrainHooks(data.train_data, data.loss_fn, data.optimizer, data.scheduler, lr)
        events, said = train_events(model, policy, hooks, steps=steps, opt_level=opt_level, example=example)
        verdicts = training_verdicts(events)
        cal.swamping += [{**r, "origin": "training"} for r in verdicts["swamping"]]
        cal.precursors = verdicts["precursors"]
        cal.trained = {"steps": verdicts["steps"], "diverged_step": verdicts["diverged_step"]}
        notes.append(said)
    return notes


TRAINING.register("opt_level")(check_opt_level)

__all__ = ["TrainHooks", "measure_training", "forward_updates", "mean_of_outputs", "stored_copy", "train_events"]
