"""Preflight of the training state that will change: every tensor updated during training is mastered or fp32.

A tensor stored in fp16/bf16/fp8 that changes in place with no FP32 master loses each update below half an ulp of
its value (swamping, :mod:`ampaudit.runtime.swamping`). Two checks, run by the trainer under O2 and FSDP (and by
``ampaudit train --preflight-only``) once the model has its training dtypes and the optimizer exists:

    checks = state_checks(model, train_data, dtype=torch.bfloat16, mastered=masters.mastered,
                          optimizer=opt, names={id(m): n for n, m in masters.named_parameters()})
    for c in checks: print(c.line())     # "warn updates: 2 tensor(s) change in place in low precision ..."

``updates``: one dry forward of the first batch (autocast, no_grad, training mode) under a dispatch mode that
records which low-precision parameters and buffers its ops write into (an EMA / momentum teacher, running
statistics, a counter); whatever it wrote (fp32 BatchNorm statistics too) is put back and the RNG restored, so
training starts as it would have.
Trainable low-precision parameters with no master are named too. Updates made outside the forward (a user's loop
between steps) are not seen here; the watch measures those on its sampled steps. ``optimizer state``: the dtype
of each state the optimizer keeps (exp_avg, exp_avg_sq, momentum_buffer ...), read from its state when it has one,
else from one dry step of the same optimizer class on small stand-ins of its parameters. Both warn, never refuse:
the run is valid, only its updates are lost.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from ampaudit.dtypes import name_of, unit_roundoff
from ampaudit.policy import settings
from ampaudit.runtime.swamp_targets import LOW_FLOATS, low_precision, written_tensors
from ampaudit.train.preflight_check import Check

SHOWN = 4
# The names of this module's checks (ampaudit report shows these from the trace's preflight event).
STATE_CHECKS = ("updates", "optimizer state")
# A stand-in parameter has at most this many elements (a slice of the first dimension of a larger one).
STANDIN_ELEMENTS = 1 << 16


class _WriteRecorder(TorchDispatchMode):
    """Records the watched tensors an op writes into, saving each one's value before its first write."""

    def __init__(self, watched: dict[int, tuple[str, str, torch.Tensor]]):
        super().__init__()
        self.watched, self.saved = watched, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for t in written_tensors(func, args, kwargs):
            key = t.data_ptr()
            if key in self.watched and key not in self.saved:
                self.saved[key] = t.detach().clone()
        return func(*args, **kwargs)


def updated_in_forward(model: nn.Module, batch: Any, *, dtype: torch.dtype,
                       skip: Iterable[torch.Tensor] = ()) -> list[tuple[str, str, torch.Tensor]]:
    """``(name, kind, tensor)`` of each low-precision parameter or buffer (less ``skip``) that one forward of
    ``batch`` writes into; the model and the RNG are left as they were."""
    from ampaudit.runtime.replay_state import rng_snapshot
    from ampaudit.train.data import split_batch

    skipped = {id(t) for t in skip}
    # Every parameter and buffer is watched, so whatever the dry forward writes (fp32 BatchNorm statistics and
    # counters too) is put back; only the low-precision ones are reported.
    watched: dict[int, tuple[str, str, torch.Tensor]] = {}
    for kind, named in (("param", model.named_parameters()), ("buffer", model.named_buffers())):
        for name, t in named:
            watched.setdefault(t.data_ptr(), (name, kind, t))
    if not any(low_precision(t) and id(t) not in skipped for _, _, t in watched.values()):
        return []
    first = next(iter(model.parameters()), None)
    device = first.device if first is not None else torch.device("cpu")
    args, kwargs, _ = split_batch(batch, device)
    recorder, restore_rng = _WriteRecorder(watched), rng_snapshot()
    try:
        with torch.no_grad(), torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32), recorder:
            model(*args, **kwargs)
    finally:
        with torch.no_grad():
            for key, value in recorder.saved.items():
                watched[key][2].copy_(value)
        restore_rng()
    return [watched[key] for key in recorder.saved
            if low_precision(watched[key][2]) and id(watched[key][2]) not in skipped]


def check_updates(model: nn.Module, batch: Any, *, dtype: torch.dtype,
                  mastered: Iterable[torch.Tensor] = (), o2: bool = True) -> Check:
    """``updates``: the tensors that change in place in low precision without an FP32 master. ``o2``: the run
    casts the model (opt level O2), which the fix names; else the model holds them so (FSDP's plain model)."""
    mastered = list(mastered)
    ids = {id(p) for p in mastered}
    stepped = [(n, "param", p) for n, p in model.named_parameters()
               if p.requires_grad and id(p) not in ids and low_precision(p)]
    try:
        found = stepped + updated_in_forward(model, batch, dtype=dtype, skip=mastered + [p for _, _, p in stepped])
    except (RuntimeError, TypeError, ValueError, IndexError) as exc:
        return Check("updates", "warn", f"the dry forward of the first batch failed ({type(exc).__name__}: "
                     f"{' '.join(str(exc).split())[:120]}), so updates made in forward were not looked for",
                     "check that train_data() yields what forward() takes")
    if not found:
        return Check("updates", "ok", "every tensor the forward updates in place, and every trainable parameter, "
                     "is float32 or has an FP32 master")
    words = {"param": "parameter", "buffer": "buffer"}
    shown = ", ".join(f"{n} ({words[k]}, {name_of(t.dtype)}"
                      + (", stepped without a master" if k == "param" and t.requires_grad else ", updated in forward")
                      + ")" for n, k, t in found[:SHOWN])
    more = f" and {len(found) - SHOWN} more" if len(found) > SHOWN else ""
    first = found[0][2]
    module = common_module([n for n, _, _ in found])
    half = unit_roundoff(first.dtype)
    return Check("updates", "warn", f"{len(found)} tensor(s) change during training in low precision without an "
                 f"FP32 master: {shown}{more}; an update smaller than half an ulp of the value ({half:.1e} of it in "
                 f"{name_of(first.dtype)}) rounds away",
                 f"keep them in float32{' after the O2 cast' if o2 else ''} "
                 f"(e.g. model{'.' + module if module else ''}.float()), or "
                 "give them an FP32 master; Kahan summation or stochastic rounding also keep small updates")


def common_module(names: list[str]) -> str:
    """The deepest module holding every tensor of ``names`` ("" for the root): teacher.0.weight, teacher.2.bias ->
    teacher."""
    return ".".join(os.path.commonprefix([n.split(".")[:-1] for n in names]))


def _quantized(value: Any) -> str | None:
    """The table's words for a quantized state class (torchao's low-bit optimizers), else None."""
    table = settings()["preflight"].get("quantized_states", {})
    return table.get(type(value).__name__) if isinstance(value, torch.Tensor) else None


def _state_dtypes(states: Iterable[tuple[str, dict]]) -> list[tuple[str, str]]:
    out = []
    for pname, state in states:
        for key, value in state.items() if isinstance(state, dict) else ():
            words = _quantized(value)
            if words is None and low_precision(value) and value.numel() > 1:
                words = name_of(value.dtype)
            if words is not None:
                out.append((f"{pname}.{key}", words))
    return out


def _dry_step(optimizer: torch.optim.Optimizer) -> list[tuple[str, dict]] | None:
    """The states one step of ``optimizer``'s class makes on stand-ins of its parameters (one per group and
    dtype); None when the class cannot be rebuilt from its param groups."""
    groups, standins = [], []
    for i, group in enumerate(optimizer.param_groups):
        by_dtype: dict[torch.dtype, torch.Tensor] = {}
        for p in group["params"]:
            by_dtype.setdefault(p.dtype, p)
        params = []
        for p in by_dtype.values():
            # Plain tensors of the same dtype and trailing shape (a sharded DTensor's slice would be collective).
            shape = tuple(p.shape)
            rows = max(1, min(shape[0], STANDIN_ELEMENTS // max(1, p[0].numel()))) if shape else None
            t = nn.Parameter(torch.randn((rows, *shape[1:]) if shape else (), dtype=p.dtype, device=p.device) * 0.02)
            t.grad = torch.randn_like(t) * 1e-3
            params.append(t)
            standins.append((f"group{i}.{name_of(p.dtype)}", t))
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": params})
    try:
        twin = type(optimizer)(groups)
        twin.step()
    except Exception:  # noqa: BLE001 - any class we cannot rebuild is checked at its first sampled step instead
        return None
    return [(name, twin.state.get(t, {})) for name, t in standins]


def check_optimizer_state(optimizer: torch.optim.Optimizer | None, names: dict[int, str] | None = None) -> Check:
    """``optimizer state``: states kept in fp16/bf16/fp8 or quantized, whose running averages lose updates."""
    if optimizer is None:
        return Check("optimizer state", "ok", "no optimizer to check")
    cls = type(optimizer).__name__
    names = names or {}
    if optimizer.state:
        found = _state_dtypes((names.get(id(p), f"param{i}"), s) for i, (p, s) in enumerate(optimizer.state.items()))
        how = "its states"
    else:
        states = _dry_step(optimizer)
        if states is None:
            return Check("optimizer state", "ok", f"{cls}'s states are not built yet and the class could not be "
                         "stepped on stand-ins; the watch measures them on its sampled steps")
        found, how = _state_dtypes(states), "one dry step on stand-ins of its parameters"
    if not found:
        return Check("optimizer state", "ok", f"{cls} keeps its states in float32 ({how})")
    shown = ", ".join(f"{n} ({w})" for n, w in found[:SHOWN])
    more = f" and {len(found) - SHOWN} more" if len(found) > SHOWN else ""
    return Check("optimizer state", "warn", f"{cls} keeps optimizer state in low precision ({how}): {shown}{more}; "
                 "running averages such as exp_avg_sq (beta2 0.999) take updates below half an ulp and stall",
                 "build the optimizer over FP32 master weights (opt level O2), keep its states float32, or use one "
                 "with Kahan summation / stochastic rounding")


def check_updates_of(model: nn.Module, train_data: Callable[[], Iterable], *, dtype: torch.dtype,
                     mastered: Iterable[torch.Tensor] = (), o2: bool = True) -> Check:
    """:func:`check_updates` on the first batch of ``train_data()`` (read with the RNG restored)."""
    from ampaudit.train.data import first_batch

    batch = first_batch(train_data)
    if batch is None:
        return Check("updates", "warn", "train_data() yielded no batch, so updates made in forward were not looked "
                     "for", "make it yield (inputs, target) pairs")
    return check_updates(model, batch, dtype=dtype, mastered=mastered, o2=o2)


def state_checks(model: nn.Module, train_data: Callable[[], Iterable] | None, *, dtype: torch.dtype,
                 mastered: Iterable[torch.Tensor] = (), optimizer: torch.optim.Optimizer | None = None,
                 names: dict[int, str] | None = None, o2: bool = True) -> list[Check]:
    """Both checks (module docstring); without ``train_data`` the forward's updates are not looked for."""
    checks = ([check_updates_of(model, train_data, dtype=dtype, mastered=mastered, o2=o2)]
              if train_data is not None else [])
    return checks + [check_optimizer_state(optimizer, names)]


def planned_state_checks(model: nn.Module, *, dtype: torch.dtype, fsdp: bool, optimizer: Any = None,
                         train_data: Any = None) -> list[Check]:
    """:func:`state_checks` of the run ``ampaudit train --preflight-only`` describes, on the model as loaded:
    under O2 (not ``fsdp``) the model is cast as the trainer casts it (in place) and ``optimizer`` (a factory)
    is built over FP32 masters of its trainable parameters, which are then mastered."""
    from ampaudit.train.data import as_factory
    from ampaudit.train.masters import cast_model_o2

    params = [p for p in model.parameters() if p.requires_grad]
    o2 = not fsdp and dtype in LOW_FLOATS
    if o2:
        cast_model_o2(model, dtype)
    targets = [nn.Parameter(p.detach().float()) for p in params] if o2 else params
    # The trainer's default optimizer when the model file has none (ampaudit.train.setup.build_optimizer).
    opt = (optimizer if callable(optimizer) else torch.optim.AdamW)(targets) if targets else None
    names = {id(t): n for t, (n, p) in zip(targets, [(n, p) for n, p in model.named_parameters() if p.requires_grad])}
    return state_checks(model, as_factory(train_data) if train_data is not None else None, dtype=dtype,
                        mastered=params if o2 else (), names=names, o2=o2,
                        optimizer=opt if isinstance(opt, torch.optim.Optimizer) else None)


__all__ = ["check_optimizer_state", "STATE_CHECKS", "check_updates", "check_updates_of", "planned_state_checks", "state_checks",
           "updated_in_forward"]
