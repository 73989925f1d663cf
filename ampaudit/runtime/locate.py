"""Find the op, module and source line that first turn finite values into inf/NaN (or raise).

    events = locate_nonfinite(model, (x,), {}, device_type="cpu", dtype=torch.float16)
    # [{"phase": "forward", "module": "mlp.act", "op": "aten.pow", "source": "net.py:9", "kind": "inf",
    #   "cause": "op", "dtype": "torch.float16"}]

Every aten op runs under a ``TorchDispatchMode``; after each op its floating outputs are checked. An op whose
outputs are non-finite while all its inputs were finite is an *origin* (``cause="op"``); ops that merely pass
inf/NaN along are ignored, so the first event is the culprit even when the inf stays inside a module whose
output is finite. Non-finite values that enter from outside the computation are reported once, with
``cause`` "parameter", "buffer" or "input". An op that raises (fp16 cannot hold a constant) gives
``kind="error"`` with the message, instead of a crash. A mask's "minus infinity" is no fault: a factory that makes
-inf, or a cast that turns only its input dtype's lowest value into -inf (a ``finfo(float32).min`` mask that
autocast's sdpa casts to fp16), and the ops that pass that -inf along are no origin; a NaN it makes (a fully masked
softmax row) is one.

Attribution: a stack of module forward hooks names the innermost module whose own forward runs the op; its
line is the innermost frame of the model's code (:func:`~ampaudit.runtime.module_stack.model_location`: the
user's own file, else an installed library's, as transformers' for its models), never replay's caller.
For backward ops, each autograd node is mapped to the module that was innermost when the node was created:
autograd numbers nodes in creation order, so module entries/exits are marked with the current sequence
number and a backward node's ``_sequence_nr()`` is looked up in those intervals. Backward source lines come
from anomaly mode's record of the forward stack, on a second replay made only when the first finds a backward
origin (recording every node's stack formats a traceback per op).

This checks every op (one host read per op), so it is for replays and offline checks, never every step:
``ampaudit.watch`` replays a step through :func:`replay` only when its cheap per-pass flag trips.
"""
from __future__ import annotations

import contextlib
import math
import sys
import traceback
import warnings
import weakref
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from ampaudit.dtypes import is_half, limits
from ampaudit.notes import note
from ampaudit.runtime.memory_guard import MemoryGuard, out_of_memory
from ampaudit.runtime.module_stack import ModuleStack, model_location, source_from_lines, user_source
from ampaudit.runtime.replay_state import float_tensors, preserved
from ampaudit.wrappers import unwrap

# Ops whose outputs are uninitialised memory: garbage there is not an overflow.
_UNINITIALISED = ("empty", "new_empty", "empty_like", "empty_strided", "new_empty_strided", "resize_")
# Casts whose inf may be a mask's sentinel carried over to a narrower dtype (see _saturated_cast).
_CASTS = ("_to_copy", "to", "_to_dtype", "convert_element_type")


def describe_nonfinite(ev: dict) -> str:
    """One line for a ``nonfinite`` event: "forward inf first produced in blocks.0 (aten.mul) at model.py:12"."""
    where = ev["module"] or "the top module"
    op = f" ({ev['op']})" if ev.get("op") else ""
    src = f" at {ev['source']}" if ev.get("source") else ""
    return f"{ev['phase']} {ev['kind']} first produced in {where}{op}{src}"


def _nonfinite(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t for t in tensors if t.numel() and not _finite(t)]


def _saturated_cast(func: Any, inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> bool:
    """True when a dtype cast turned only its input dtype's own lowest value (``finfo(float32).min``, the "minus
    infinity" of a dtype-aware attention mask) into -inf: the mask means the same in the narrower dtype."""
    if func.overloadpacket.__name__ not in _CASTS or len(inputs) != 1 or not inputs[0].numel():
        return False
    src, out = inputs[0], outputs[0]
    if src.shape != out.shape or not _finite(src):
        return False
    moved = ~torch.isfinite(out)
    return bool((src[moved] == -limits(src.dtype).max).all())   # IEEE: a float dtype's lowest is -max


def _finite(t: torch.Tensor) -> bool:
    try:
        # Its least and greatest values are elements of ``t`` and both propagate NaN, so they are finite exactly
        # when every element is: one reduction, one op through the dispatch modes below this one (tolist reads
        # the scalars without dispatching), where isfinite(t).all() is six (abs, ne, eq, mul, all, a host read),
        # four of them writing a tensor of t's size: 10x slower on a large activation.
        mn, mx = torch.aminmax(t)
        return math.isfinite(mn.tolist()) and math.isfinite(mx.tolist())
    except (RuntimeError, TypeError):
        pass  # no aminmax for this dtype (complex, fp8) or subclass: the elementwise check below
    try:
        return bool(torch.isfinite(t).all())
    except NotImplementedError:
        # A tensor subclass with no isfinite (torchao's Float8TrainingTensor, the scaled fp8 operand of an fp8
        # GEMM): it is storage, not a value the model computes; the GEMM's output is checked.
        return True


class NonFiniteLocator(TorchDispatchMode):
    """Dispatch mode recording origin ops of inf/NaN (and ops that raise) as event dicts in ``events``."""

    def __init__(self, tracker: ModuleStack, known: dict[int, str], *, max_events: int = 20):
        super().__init__()
        self.tracker = tracker
        self.known = known                  # data_ptr -> "parameter" | "buffer" | "input"
        self.max_events = max_events
        self.events: list[dict] = []
        self.error: dict | None = None
        self.guard: MemoryGuard | None = None       # stops a forward that keeps a graph before memory runs out
        self.paused = False
        self.phase = "forward"
        self._seen: set[tuple] = set()
        self._outside_reported: set[str] = set()
        # Tensors whose only non-finite values are a mask's -inf sentinel (a saturated cast and what it flows
        # into): ops passing it along are no origin, while a NaN it makes (a fully masked softmax row) is one.
        self._sentinels: dict[int, weakref.ref] = {}

    def _is_sentinel(self, t: torch.Tensor) -> bool:
        ref = self._sentinels.get(id(t))
        return ref is not None and ref() is t

    def _where(self) -> tuple[str, str, str | None]:
        # The phase is set by the caller, not read from autograd: a replay may run inside the autograd
        # engine's final callback, where the engine still reports a graph task.
        if self.phase == "backward":
            node = torch._C._current_autograd_node()
            module = self.tracker.owner_of_node(node)
            meta = node.metadata.get("traceback_") if node is not None else None
            source = (source_from_lines(meta, stop=replay.__code__, packages=self.tracker.packages)
                      if isinstance(meta, list) else None)
            return "backward", module if module is not None else self.tracker.current, source
        # Frames from replay's outward are its caller's (a script's check(model) line), not the model's.
        return "forward", self.tracker.current, user_source(sys._getframe(2), stop=replay.__code__,
                                                              packages=self.tracker.packages)

    def _record(self, func: Any, kind: str, cause: str, dtype: str | None, **extra: Any) -> dict | None:
        phase, module, source = self._where()
        key = (phase, module, str(func.overloadpacket), source, cause)
        if key in self._seen:
            return None
        self._seen.add(key)
        event = {"phase": phase, "module": module, "op": str(func.overloadpacket), "source": source,
                 "kind": kind, "cause": cause, "dtype": dtype, **extra}
        self.events.append(event)
        return event

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.paused or len(self.events) >= self.max_events:
            return func(*args, **kwargs)
        if self.guard is not None:
            self.guard.check()
        mutable = func._schema.is_mutable
        inputs = float_tensors((args, kwargs))
        bad_before = _nonfinite(inputs) if mutable else None
        try:
            out = func(*args, **kwargs)
        except Exception as exc:
            if self.error is None:
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                self.error = self._record(func, "error", "op", None, message=first[:300])
            raise
        if func.overloadpacket.__name__ in _UNINITIALISED:
            return out
        outputs = _nonfinite(float_tensors(out))
        if not outputs:
            return out
        bad_in = bad_before if mutable else _nonfinite(inputs)
        kind = "nan" if any(bool(torch.isnan(o).any()) for o in outputs) else "inf"
        from_sentinel = bool(bad_in) and all(self._is_sentinel(t) for t in bad_in)
        only_minus = all(not bool((o == float("inf")).any()) and not bool(torch.isnan(o).any()) for o in outputs)
        if only_minus and (from_sentinel or (not bad_in and _saturated_cast(func, inputs, outputs))):
            self._sentinels.update((id(o), weakref.ref(o)) for o in outputs)
            return out
        if from_sentinel:
            bad_in = []      # a NaN made from the sentinel alone (a fully masked row): this op is its origin
        dtype = str(outputs[0].dtype)
        if not inputs and not mutable:
            # A factory (scalar_tensor(-inf), full(..., -inf)) makes the value on purpose, as attention masks
            # do; a constant that merely overflows shows up where it is cast or combined with the activations.
            return out
        if not bad_in:
            # Whether the op ran in fp16/bf16, for the reader of the event. Whether it is a precision fault is
            # judge_against_fp32's call: an FP32 op can make an inf only the low-precision run has (its input
            # flushed to zero upstream), and one FP32 has too (T5's masked log(0)) is the model's own.
            low = any(is_half(t.dtype) for t in inputs) or any(is_half(o.dtype) for o in outputs)
            self._record(func, kind, "op", dtype, low_precision=low)
        else:
            # inf/NaN that came from outside the computation: report once per kind of source.
            for t in bad_in:
                origin = self.known.get(t.const_data_ptr())
                if origin is not None and origin not in self._outside_reported:
                    self._outside_reported.add(origin)
                    self._record(func, kind, origin, dtype)
        return out


def replay(root: nn.Module, args: tuple, kwargs: dict | None = None, *, device_type: str = "cpu",
           dtype: torch.dtype = torch.float16, autocast: bool = True, rng_state: dict | None = None,
           upstream: list[torch.Tensor | None] | None = None, loss: Callable[[Any], torch.Tensor] | None = None,
           max_events: int = 20) -> list[dict]:
    """Re-run ``root(*args, **kwargs)`` (and its backward into the parameters: given ``upstream`` gradients of
    its floating outputs, or a ``loss(output)`` to differentiate) under the locator; return origin events in
    execution order.

    Nothing is written: parameter ``.grad`` is untouched (``torch.autograd.grad``), buffers and RNG are
    restored. A forward that raises yields a ``kind="error"`` event instead of an exception. Short of memory (see
    :mod:`~ampaudit.runtime.memory_guard`) the forward is replayed alone: ``.backward_checked`` False, a note.
    """
    kwargs = kwargs or {}
    backward = loss is not None or (upstream is not None and any(g is not None for g in upstream))
    once = dict(device_type=device_type, dtype=dtype, autocast=autocast, rng_state=rng_state, upstream=upstream,
                loss=loss, max_events=max_events, backward=backward)
    # Anomaly mode (the forward stack of each autograd node: the backward events' source lines) formats a
    # traceback per op (the largest Python cost of a replay under cProfile) and is read only for a backward
    # event: a replay that finds one is run again with it. Same inputs, RNG and buffers, so the same events,
    # now with their lines.
    events = _replay_once(root, args, kwargs, anomaly=False, **once)
    if backward and events.backward_checked and any(ev.get("phase") == "backward" for ev in events):
        events = _replay_once(root, args, kwargs, anomaly=True, **once)
    return events


class Replayed(list):
    """A replay's events; ``backward_checked`` is False when a backward was asked for and memory ran short
    (:mod:`ampaudit.runtime.memory_guard`): the forward's events are all there, the backward's not."""

    backward_checked = True


def _replay_once(root: nn.Module, args: tuple, kwargs: dict, *, device_type: str, dtype: torch.dtype,
                 autocast: bool, rng_state: dict | None, upstream: list[torch.Tensor | None] | None,
                 loss: Callable[[Any], torch.Tensor] | None, max_events: int, backward: bool,
                 anomaly: bool) -> Replayed:
    known: dict[int, str] = {}
    for t in float_tensors((args, kwargs)):
        known[t.const_data_ptr()] = "input"
    for g in upstream or []:
        if g is not None:
            known[g.const_data_ptr()] = "input"
    for _, b in root.named_buffers():
        known[b.const_data_ptr()] = "buffer"
    for _, p in root.named_parameters():
        known[p.const_data_ptr()] = "parameter"
    tracker = ModuleStack(root, mark_nodes=backward)
    locator = NonFiniteLocator(tracker, known, max_events=max_events)
    tracker.locator = locator
    locator.guard = MemoryGuard.from_settings() if backward else None
    grad_ctx = torch.enable_grad() if backward else torch.no_grad()
    short = None
    with preserved(root, rng_state), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # anomaly mode announces itself
        stacks = torch.autograd.detect_anomaly(check_nan=False) if anomaly else contextlib.nullcontext()
        try:
            # No cast cache: a replay run inside the caller's autocast region must redo (and see) the casts.
            amp = torch.autocast(device_type, dtype=dtype, enabled=autocast, cache_enabled=False)
            with tracker, grad_ctx, stacks, amp, locator:
                out = root(*args, **kwargs)
        except Exception as exc:  # the forward raised: report where, not a traceback
            if not (backward and out_of_memory(exc)):
                if locator.error is None:
                    locator.events.append(_python_error(exc, tracker.current, tracker.packages))
                return Replayed(locator.events)
            short = _short_of_memory(exc, "forward")
        if short is None:
            events = _backward_events(root, out, locator, loss, upstream) if backward else Replayed(locator.events)
    if short is not None:
        # The graph kept for the backward did not fit: the forward alone, without one, now that the frames
        # holding the first attempt's activations (the exception's traceback) are gone.
        note(short)
        events = _replay_once(root, args, kwargs, device_type=device_type, dtype=dtype, autocast=autocast,
                              rng_state=rng_state, upstream=None, loss=None, max_events=max_events,
                              backward=False, anomaly=False)
        events.backward_checked = False
    return events


def _backward_events(root: nn.Module, out: Any, locator: NonFiniteLocator, loss: Callable[[Any], torch.Tensor] | None,
                     upstream: list[torch.Tensor | None] | None) -> Replayed:
    try:
        _backward(root, out, locator, loss, upstream)
    except Exception as exc:
        # An op that raises in the backward is an event (the locator recorded it); a backward that cannot run
        # at all (an op without a derivative, a loss that does not fit the output, memory that runs out) costs
        # the backward's events, not the audit.
        if out_of_memory(exc):
            note(_short_of_memory(exc, "backward"))
            events = Replayed(e for e in locator.events if e is not locator.error)
            events.backward_checked = False
            return events
        if locator.error is None:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            note(f"the backward pass was not checked: {type(exc).__name__}: {first[:160]}")
    return Replayed(locator.events)


def _short_of_memory(exc: BaseException, phase: str) -> str:
    why = (str(exc).strip() or type(exc).__name__).splitlines()[0][:160]
    where = "its forward kept the graph" if phase == "forward" else "it ran"
    return (f"the backward pass was not checked for inf/NaN: memory ran short while {where} ({why}); the forward "
            "was checked without it (run on a machine with more free memory, or lower [calibration] "
            "min_free_mib, to check the backward)")


def _backward(root: nn.Module, out: Any, locator: NonFiniteLocator, loss: Callable[[Any], torch.Tensor] | None,
              upstream: list[torch.Tensor | None] | None) -> None:
    params = [p for p in root.parameters() if p.requires_grad]
    if loss is not None:
        with torch.enable_grad():
            total = loss(out)
        pairs = [(total, None)] if isinstance(total, torch.Tensor) and total.requires_grad else []
    else:
        outs = [o for o in float_tensors(out) if o.requires_grad]
        pairs = [(o, g.to(o.dtype)) for o, g in zip(outs, upstream) if g is not None and g.shape == o.shape]
    if pairs and params:
        locator.phase = "backward"
        # Each parameter's gradient is dropped as soon as its last op made it (checked already): autograd.grad
        # would hold every one until the backward ends, the model's size again on top of its activations
        # (2.3 GB for a 570M-parameter ViT). Registered last, after any hook of the model's own, which sees it.
        handles = [p.register_hook(_dropped) for p in params]
        try:
            with locator, warnings.catch_warnings():
                warnings.simplefilter("ignore")
                torch.autograd.grad([o for o, _ in pairs], params, [g for _, g in pairs], allow_unused=True)
        finally:
            for h in handles:
                h.remove()


def _dropped(grad: torch.Tensor) -> torch.Tensor:
    # A gradient of the same shape, dtype and device that holds one element (a stride-0 view): what autograd
    # keeps of it until the backward ends.
    return torch.zeros((), dtype=grad.dtype, device=grad.device).expand(grad.shape)


def _origin(ev: dict) -> tuple:
    return (ev.get("phase"), ev.get("module"), ev.get("op"), ev.get("source"), ev.get("cause"))


def judge_against_fp32(root: nn.Module, events: list[dict], args: tuple, kwargs: dict | None = None,
                       **replay_kw: Any) -> list[dict]:
    """Mark each inf/NaN origin of a low-precision pass with ``fp32_too``: whether an FP32 replay of the same
    pass (same inputs, RNG and backward) has the same origin. Only ``fp32_too=False`` is a precision fault: an
    inf FP32 also makes (T5's masked ``log(0)``) is the model's own, whatever dtype the op ran in. Events of
    a forward that raised are never FP32's. ``replay_kw`` are :func:`replay`'s keywords (not ``autocast``). Returns
    the events, less the backward ones when FP32's backward ran short of memory (nothing to judge them by)."""
    if not any(ev.get("kind") in ("inf", "nan") for ev in events):
        return events
    replay_kw.pop("autocast", None)
    fp32 = replay(root, args, kwargs, autocast=False, **replay_kw)
    reference = {_origin(e) for e in fp32 if e.get("kind") in ("inf", "nan")}
    if not fp32.backward_checked:
        # FP32's backward did not fit in memory (its note says so): a backward origin cannot be judged.
        events = [ev for ev in events if ev.get("phase") != "backward"]
    for ev in events:
        ev["fp32_too"] = ev.get("kind") in ("inf", "nan") and _origin(ev) in reference
    return events


def judge_against_unscaled(root: nn.Module, events: list[dict], args: tuple, kwargs: dict | None = None, *,
                           scale: float | None, **replay_kw: Any) -> list[dict]:
    """Mark each backward inf/NaN origin that FP32 does not share (``fp32_too=False``) with ``scaled_only``:
    whether the same low-precision replay, its ``upstream`` gradients divided by the loss ``scale``, no longer
    has any backward inf/NaN that FP32 does not share. Such an overflow is a dynamic loss scaler probing too high a scale (it skips the step and lowers
    the scale, as designed), not the module's fault: the unscaled gradient fits the dtype. ``replay_kw`` are
    :func:`replay`'s keywords, ``upstream`` among them; nothing is replayed without a scale above 1."""
    upstream = replay_kw.pop("upstream", None)
    suspects = [ev for ev in events if ev.get("phase") == "backward" and ev.get("kind") in ("inf", "nan")
                and ev.get("fp32_too") is False]
    if not suspects or not scale or not math.isfinite(scale) or scale <= 1.0 or not upstream:
        return events
    unscaled = [None if g is None else g.float() / float(scale) for g in upstream]
    # Excused only if the unscaled replay has no backward inf/NaN of its own at all: an overflow that merely moved
    # to another op, or a new one, is still low precision's.
    shared = {_origin(e) for e in events if e.get("fp32_too")}
    left = {_origin(e) for e in replay(root, args, kwargs, upstream=unscaled, **replay_kw)
            if e.get("phase") == "backward" and e.get("kind") in ("inf", "nan")} - shared
    for ev in suspects:
        ev["scaled_only"] = not left
    return events


def _python_error(exc: BaseException, module: str, packages: frozenset[str]) -> dict:
    source = model_location(((e.filename, e.lineno or 0) for e in reversed(traceback.extract_tb(exc.__traceback__))),
                            packages=packages)
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return {"phase": "forward", "module": module, "op": None, "source": source, "kind": "error",
            "cause": "op", "dtype": None, "message": f"{type(exc).__name__}: {first}"[:300]}


def locate_nonfinite(model: nn.Module, args: tuple, kwargs: dict | None = None, *, device_type: str = "cpu",
                     dtype: torch.dtype = torch.float16, loss: Callable[[Any], torch.Tensor] | None = None,
                     ) -> list[dict]:
    """Run one forward of ``model`` under ``torch.autocast(device_type, dtype)`` (and with ``loss``, the
    backward of ``loss(output)``) and return its non-finite origins in execution order (each: phase, module,
    op, source, kind, cause, dtype); ``[]`` when clean.

    For ``check --calibrate``: a forward that raises under autocast gives a ``kind="error"`` event naming
    the module, op and line (``message`` holds the error). Buffers and RNG are left as they were.
    """
    return replay(unwrap(model), tuple(args), dict(kwargs or {}), device_type=device_type, dtype=dtype, loss=loss)
