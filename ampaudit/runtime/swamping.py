"""Swamping: updates of low-precision training state that round away, measured on the watch's sampled steps.

A tensor that changes during training and is stored in fp16/bf16/fp8 without an FP32 master (an EMA or momentum
teacher copy of the weights, a buffer its forward updates in place, parameters stepped in bf16, bf16 optimizer
state) loses every update smaller than half an ulp of its value: round-to-nearest puts ``value + delta`` back on
``value``. An EMA at momentum 0.999 moves each weight by ~1e-3 of its distance to the student per step, far below
bf16's half ulp (2^-9 to 2^-8 of the value), so it barely moves at all.

    meter = SwampMeter(model, optimizer=opt, mastered=masters.model_params, skip=lambda: watch.replaying)
    meter.begin(step)            # a sampled step: intercept in-place writes from here on
    ...forward, backward, optimizer.step(), EMA updates...
    for event in meter.finish(): writer.write("swamping", **event)
    for event in meter.overflows: writer.write("state_overflow", **event)   # the step's state beyond its range

How: while a step is measured, a ``TorchDispatchMode`` sees every aten op. An op that writes (its schema marks the
argument ``Tensor(a!)``: ``add_``, ``mul_``, ``lerp_``, ``copy_``, the ``_foreach_*_`` family, the running
statistics of ``native_batch_norm``, ``out=`` variants) into a candidate tensor (a low-precision float parameter,
buffer or optimizer state that has no FP32 master: :mod:`ampaudit.runtime.swamp_targets`) is run a second time on
FP32 upcasts, into an FP32 copy of that tensor: what FP32 storage would hold. Pointwise ops, copies and views that
read a candidate or such an FP32 value carry their FP32 result alongside, so ``t.copy_(m * t + (1 - m) * s)`` is
measured as well as ``t.lerp_(s, 1 - m)``. At the end of the step, per tensor: ``share_rounded`` (of the elements
whose FP32 update is nonzero, those whose stored value did not move) and ``realized_ratio`` (norm of the stored
delta / norm of the FP32 delta). Cost: nothing on the other steps, nor on a model without low-precision state (the
mode is not entered); on a measured step one Python call per aten op, an FP32 copy and a start copy of each tensor
that changes, at most ``[swamping] max_elements`` elements per step (beyond that, tensors are measured in turn over
the sampled steps). The same FP32 copies name state whose stored value overflows while FP32 holds it finite
(``meter.overflows``, ``state_overflow`` events; :mod:`ampaudit.runtime.state_overflow`: a half model's BatchNorm
running_var).
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map
from torch.utils.weak import WeakTensorKeyDictionary

from ampaudit import dtypes
from ampaudit.dtypes import name_of
from ampaudit.policy import settings
from ampaudit.runtime.module_stack import writer_source
from ampaudit.runtime.state_overflow import describe_overflow, fp32_start, overflow
# The candidates and the write slots are re-exported: callers of the meter name them from here too.
from ampaudit.runtime.swamp_targets import (LOW_FLOATS, Candidate, candidates, low_precision, write_slots,
                                            written_tensors)

_aten = torch.ops.aten
_FP32_NOISE = 4 * dtypes.limits(torch.float32).eps
# Ops that carry an FP32 value along besides the pointwise ones: copies and views of the same elements.
_CARRY = frozenset({_aten.detach.default, _aten.alias.default, _aten.clone.default, _aten.view.default,
                    _aten._unsafe_view.default, _aten.t.default, _aten._to_copy.default,
                    _aten.lift_fresh.default})


@dataclass
class _Measure:
    cand: Candidate
    start: torch.Tensor          # the stored value at the first write of the step
    intended: torch.Tensor       # FP32: what FP32 storage would hold now
    source: str | None = None    # file:line of the user's code that first wrote it this step
    start_inf: torch.Tensor | None = None   # elements inf in storage at the first write (FP32 starts them at max)


@functools.lru_cache(maxsize=None)
def _carries(func: Any) -> bool:
    """Whether ``func`` maps values elementwise (or copies / views them), so an FP32 twin of its output exists."""
    return func in _CARRY or torch.Tag.pointwise in getattr(func, "tags", ())


class _Shadow(TorchDispatchMode):
    """Runs each write into a measured tensor a second time in FP32 (see the module docstring)."""

    def __init__(self, meter: "SwampMeter"):
        super().__init__()
        self.meter = meter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        writes, carries = write_slots(func), _carries(func)
        # Most ops of a step (GEMMs, reductions, the backward) neither write state nor carry values: pass them on.
        if not (writes or carries) or self.meter.skip():
            return func(*args, **kwargs)
        meter = self.meter
        if writes:
            hits = [m for t in written_tensors(func, args, kwargs) if (m := meter.measure_for(t)) is not None]
            if hits:
                meter.shadow_write(func, args, kwargs, hits)
                return func(*args, **kwargs)
        out = func(*args, **kwargs)
        if carries and meter.has_known:
            meter.carry(func, args, kwargs, out)
        return out


class SwampMeter:
    """Measures, on the steps it is begun for, how much of each low-precision tensor's FP32 update is stored.

    ``optimizer``: its low-precision states are candidates too (from the step after they exist). ``mastered``:
    parameters whose FP32 master takes the updates (O2's; FSDP's fp32 shards are never candidates). ``names``:
    id(optimizer parameter) -> parameter name (O2: the masters'). ``skip``: while it returns True (the watch's
    own replays, which restore what they touch) ops pass unmeasured. ``o2``: the run casts the model (the fixes say).
    """

    def __init__(self, model: nn.Module, *, optimizer: torch.optim.Optimizer | None = None,
                 mastered: Iterable[torch.Tensor] = (), names: dict[int, str] | None = None,
                 skip: Callable[[], bool] = lambda: False, o2: bool = False):
        self.model, self.optimizer, self.names, self.skip, self.o2 = model, optimizer, names, skip, o2
        self.overflows: list[dict] = []     # the last finished step's state_overflow events (fields)
        self._mastered = list(mastered)
        table = settings().get("swamping", {})
        self.share_line = float(table.get("share_rounded", 0.5))
        self.ratio_line = float(table.get("realized_ratio", 0.5))
        self.max_elements = int(table.get("max_elements", 1 << 26))
        self._known: dict[str, Candidate] = {}
        self._eligible: dict[tuple[int, int], Candidate] = {}
        self._measures: dict[tuple[int, int], _Measure] = {}
        self._carried = WeakTensorKeyDictionary()
        self._carried_ids: set[int] = set()
        self._mode: _Shadow | None = None
        self.step: int | None = None

    @property
    def active(self) -> bool:
        return self._mode is not None

    @property
    def has_known(self) -> bool:
        """Whether any value could have an FP32 twin (an eligible tensor, or a value already carried)."""
        return bool(self._eligible)
    def begin(self, step: int) -> bool:
        """Start measuring ``step``; False (and nothing entered) when the model holds no low-precision state."""
        if self._mode is not None:
            self.abort()
        found = candidates(self.model, optimizer=self.optimizer, mastered=self._mastered, names=self.names)
        if not found:
            return False
        for c in found:      # keep when each was last measured, across steps
            c.measured_at = self._known[c.name].measured_at if c.name in self._known else -1
        self._known = {c.name: c for c in found}
        budget, self._eligible = self.max_elements, {}
        for c in sorted(found, key=lambda c: c.measured_at):
            if c.tensor.numel() <= budget or not self._eligible:
                budget -= c.tensor.numel()
                c.measured_at = step
                self._eligible[(c.tensor.const_data_ptr(), c.tensor.numel())] = c
        self.step, self._measures = step, {}
        self._mode = _Shadow(self)
        self._mode.__enter__()
        return True

    # -- inside the mode -----------------------------------------------------------------------------------------
    def _lookup(self, t: torch.Tensor, table: dict) -> Any:
        """``table``'s entry for the candidate whose elements ``t`` holds: the tensor itself (``.data`` too), or a
        contiguous view of a contiguous one."""
        if t.dtype not in LOW_FLOATS:
            return None
        entry = table.get((t.const_data_ptr(), t.numel()))
        if entry is None:
            return None
        c = entry.cand.tensor if isinstance(entry, _Measure) else entry.tensor
        same = c.dtype == t.dtype and ((c.shape == t.shape and c.stride() == t.stride())
                                       or (c.is_contiguous() and t.is_contiguous()))
        return entry if same else None

    def measure_for(self, t: torch.Tensor) -> _Measure | None:
        """The measure of the eligible tensor ``t`` writes into (started now if this is its first write)."""
        m = self._lookup(t, self._measures)
        if m is None:
            cand = self._lookup(t, self._eligible)
            if cand is None:
                return None
            # The user's line is looked up once per tensor and measured step (a walk up the Python stack).
            intended, start_inf = fp32_start(cand.tensor)
            m = _Measure(cand, cand.tensor.detach().clone(), intended, writer_source(__file__), start_inf)
            self._measures[(t.const_data_ptr(), t.numel())] = m
        return m

    def _lift(self, x: Any) -> Any:
        """``x`` as FP32 would hold it: a measured tensor's FP32 copy, a carried value, or the upcast."""
        if not isinstance(x, torch.Tensor):
            return x
        m = self._lookup(x, self._measures)
        if m is not None:
            return m.intended if m.intended.shape == x.shape else m.intended.view(x.shape)
        carried = self._carried.get(x) if id(x) in self._carried_ids else None
        if carried is not None:
            return carried
        return x.float() if x.dtype in LOW_FLOATS else x

    def _known_value(self, x: Any) -> bool:
        if not isinstance(x, torch.Tensor):
            return False
        # The id set is a fast first look (the weak dictionary's lookup builds a weak reference per call); a
        # reused id only costs a needless FP32 twin.
        if id(x) in self._carried_ids and x in self._carried:
            return True
        return self._lookup(x, self._eligible) is not None

    def shadow_write(self, func: Any, args: tuple, kwargs: dict, hits: list[_Measure]) -> None:
        """Run ``func`` on FP32 values, writing into the FP32 copies of the measured tensors it writes."""
        try:
            lifted_args, lifted_kwargs = tree_map(self._lift, (args, kwargs))
            func(*lifted_args, **lifted_kwargs)
        except (RuntimeError, TypeError, ValueError, NotImplementedError):
            # This op has no FP32 twin here (an fp8-only kernel, a dtype it insists on): not measurable this step.
            for m in hits:
                self._measures.pop((m.cand.tensor.const_data_ptr(), m.cand.tensor.numel()), None)
                self._eligible.pop((m.cand.tensor.const_data_ptr(), m.cand.tensor.numel()), None)

    def carry(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        """Give ``out`` its FP32 value when ``func`` read a measured or carried value no larger than ``out``."""
        if not isinstance(out, torch.Tensor) or not out.is_floating_point():
            return
        known = [x for x in (*args, *kwargs.values()) if self._known_value(x)]
        # A broadcast into something larger (a bias added to activations) is not state being updated.
        if not known or out.numel() > max(x.numel() for x in known):
            return
        try:
            if func is _aten._to_copy.default:      # .to(bf16) is the rounding being measured: keep FP32
                value = self._lift(args[0]).to(device=out.device)
                value = value.float() if value.dtype in LOW_FLOATS else value
            else:
                lifted_args, lifted_kwargs = tree_map(self._lift, (args, kwargs))
                value = func(*lifted_args, **lifted_kwargs)
        except (RuntimeError, TypeError, ValueError, NotImplementedError):
            return
        if isinstance(value, torch.Tensor) and value.shape == out.shape:
            self._carried[out] = value
            self._carried_ids.add(id(out))

    # -- the step's result ---------------------------------------------------------------------------------------
    def abort(self) -> None:
        """Leave the mode without a result (the step raised, or the run ends)."""
        mode, self._mode = self._mode, None
        if mode is not None:
            mode.__exit__(None, None, None)
        self._measures, self._carried, self._carried_ids = {}, WeakTensorKeyDictionary(), set()

    def finish(self, *, every: bool = False) -> list[dict]:
        """Leave the mode; one ``swamping`` event (fields, without ``event``) per tensor over a line. ``every``:
        one row per tensor written, with ``flagged`` (over a line) and ``moved`` (False: FP32 would not move it;
        no numbers then), what ``check --calibrate`` reports of one forward."""
        measures, step = list(self._measures.values()), self.step
        self.abort()
        out, self.overflows = [], []
        for m in measures:
            where = {"source": m.source} if m.source else {}
            if (lost := overflow(m.start_inf, m.cand.tensor, m.intended)) is not None:
                self.overflows.append({"step": step, **describe_overflow(m.cand, lost, self.model, o2=self.o2),
                                       **where})
            row = measure_update(m.start, m.cand.tensor.detach(), m.intended)
            if row is None:
                if every:
                    out.append({"step": step, "tensor": m.cand.name, "module": m.cand.module, "kind": m.cand.kind,
                                "dtype": name_of(m.start.dtype), "flagged": False, "moved": False, **where})
                continue
            flagged = row["share_rounded"] >= self.share_line or row["realized_ratio"] <= self.ratio_line
            if flagged or every:
                out.append({"step": step, **describe(m.cand, row, o2=self.o2), **where,
                            **({"flagged": flagged, "moved": True} if every else {})})
        return out


def measure_update(start: torch.Tensor, final: torch.Tensor, intended: torch.Tensor) -> dict | None:
    """The numbers of one tensor over one step: ``start`` and ``final`` stored values, ``intended`` the FP32
    value; None when FP32 would not have moved it. ``update_rel`` is the RMS of the FP32 update over that of the
    values it moves (a typical relative update)."""
    s = start.float()
    want, got = intended.float() - s, final.float() - s
    # FP32 arithmetic has rounding of its own (m*t + (1-m)*t is not exactly t): a few fp32 ulps is no update.
    # NaN compares False, so a non-finite update is not counted as one.
    moving = want.abs() > _FP32_NOISE * s.abs()
    keep = moving.to(want.dtype)
    counts = torch.stack([moving.sum().float(), (moving & (got == 0)).sum().float(),
                          torch.linalg.vector_norm(got * keep), torch.linalg.vector_norm(want * keep),
                          torch.linalg.vector_norm(s * keep)])
    n, rounded, got_norm, want_norm, value_norm = counts.tolist()     # one device sync per tensor
    if n == 0 or want_norm == 0:
        return None
    return {"share_rounded": rounded / n, "realized_ratio": got_norm / want_norm, "elements": int(n),
            "numel": start.numel(), "update_rel": want_norm / value_norm if value_norm > 0 else None,
            "half_ulp_rel": dtypes.unit_roundoff(start.dtype), "dtype": name_of(start.dtype)}


def describe(c: Candidate, row: dict, *, o2: bool = False) -> dict:
    """The event's fields: the numbers, ``tensor``, ``module``, ``kind``, ``why`` / ``fix`` (``o2``: for an O2 run)."""
    dtype, rel, half = row["dtype"], row["update_rel"], row["half_ulp_rel"]
    cast = "after the O2 cast" if o2 else f"where the model is made {dtype}"
    rounded = f"{row['share_rounded']:.0%} of them below half a {dtype} ulp"
    if rel is None:
        size = f"updates, {rounded}"
    elif rel < half:
        size = f"updates of ~{rel:.1e} of the value (RMS), below half a {dtype} ulp ({half:.1e} of it)"
    else:   # large on average, yet most elements' updates (or most of the movement) rounded away
        size = f"updates of ~{rel:.1e} of the value (RMS), {rounded} ({half:.1e} of the value)"
    if c.kind == "optimizer_state":
        why = f"optimizer state kept in {dtype}: its running averages take {size}"
        fix = ("keep optimizer states in float32 (build the optimizer over FP32 master weights), or use one with "
               "Kahan summation or stochastic rounding of its states")
    elif c.kind == "buffer":
        why = f"buffer updated in place in {dtype} with no FP32 copy: {size}"
        fix = (f"keep the buffer in float32 (e.g. {c.module or 'model'}.{c.name.rsplit('.', 1)[-1]} = "
               f"....float() {cast}: ops read it in their own dtype), or accumulate in an FP32 copy")
    elif c.frozen:
        why = f"no FP32 master: a copy of the weights updated in place (EMA / momentum teacher) in {dtype}: {size}"
        fix = (f"keep {c.owner or c.module or 'this module'} in float32 (.float() {cast}; an EMA needs no "
               "low-precision copy), or give it an FP32 master and round into it after each update; Kahan "
               "summation or stochastic rounding also keep the small updates")
    else:
        why = f"no FP32 master: the parameter is stepped in {dtype}, and lr*grad makes {size}"
        fix = ("train it with FP32 master weights (opt level O2 / FSDP's fp32 shards), or use an optimizer with "
               "Kahan summation or stochastic rounding (torchao's bf16_stochastic_round)")
    return {"tensor": c.name, "module": c.module, "kind": c.kind, **row, "why": why, "fix": fix}


__all__ = ["LOW_FLOATS", "Candidate", "SwampMeter", "candidates", "describe", "low_precision", "measure_update",
           "written_tensors"]
