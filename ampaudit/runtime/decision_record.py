"""Record the decisions a forward makes, under autocast and in FP32, and count how many differ.

    rows = measure_decisions(model, (x,), {}, device_type="cpu", dtype=torch.bfloat16)
    # [{"module": "moe.router", "op": "topk", "source": "model.py:42", "kind": "topk",
    #   "what": "rows pick another top-k set", "decisions": 256, "flipped": 9, "share_flipped": 0.035,
    #   "used": True, "calls": 1}]

Two forwards of the model, under no_grad, with the same inputs and RNG state (buffers put back): one under
``torch.autocast(device_type, dtype)`` and one in IEEE FP32. A :class:`DecisionRecorder` (a ``TorchDispatchMode``)
sees every aten op of both; the decision ops (:mod:`ampaudit.runtime.decisions`, on floating inputs only) are
keyed by (module whose own forward runs the op, op, source line: the model's code,
:func:`~ampaudit.runtime.module_stack.model_location`) and numbered per key, and call *i* of the FP32
run is compared with call *i* of the autocast run (:func:`~ampaudit.runtime.decisions.flips`). The FP32 forward
is skipped when the autocast one made no decision: a model without decision ops costs one forward.

``used``: whether the forward itself goes on to read the decision (the routing indices gather the experts, the
mask selects, the rounded value is dequantized): an op other than a view or copy of it reads it. A decision that is
only returned (a classifier's predictions next to its logits) changes nothing the forward computes; it is
measured, and reported as not used. Found by storage: the decision outputs (and views and copies of them) are
kept alive until the end, so their storage cannot be reused by another tensor.

Used by ``check --calibrate`` (:mod:`ampaudit.analysis.calibrate`, rule AMP702) and, on the watch's divergence
checks, by :class:`DecisionCheck` (``decision`` trace events).
"""
from __future__ import annotations

import sys
import warnings
from typing import Any

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ampaudit.runtime.decisions import bind, decision_kinds, decision_of, flips, kept, what
from ampaudit.notes import note
from ampaudit.runtime.fp32 import ieee_fp32, upcast
from ampaudit.runtime.module_stack import ModuleStack, user_source
from ampaudit.runtime.replay_state import capture_rng, float_tensors, preserved
from ampaudit.wrappers import unwrap

# Ops that read no values of their input (shapes only) or pass a decision on unchanged (views and copies: the
# copy is followed instead); anything else that reads a decision uses it.
_SHAPE_ONLY = frozenset({"empty_like", "zeros_like", "ones_like", "full_like", "new_empty", "new_zeros", "new_ones",
                         "new_full", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset"})
_PASS_ON = frozenset({"view", "_unsafe_view", "reshape", "unsqueeze", "squeeze", "expand", "t", "transpose",
                      "permute", "select", "slice", "alias", "detach", "clone", "_to_copy", "flatten", "unbind",
                      "split", "split_with_sizes", "chunk", "view_as", "expand_as", "lift_fresh", "contiguous",
                      "unflatten", "movedim", "as_strided"})


def _storage(t: torch.Tensor) -> int | None:
    try:
        # The storage's base address, read without writing: a copy-on-write weight is not copied by asking.
        return t.const_data_ptr() - t.storage_offset() * t.element_size() if t.numel() else None
    except (RuntimeError, NotImplementedError):       # tensors without storage (subclasses, meta)
        return None


class DecisionRecorder(TorchDispatchMode):
    """Dispatch mode recording decision ops (``phase`` "low", the autocast run) and comparing them with the
    FP32 run's (``phase`` "ref"); see the module docstring. :meth:`rows` gives the result (one host read)."""

    def __init__(self, tracker: ModuleStack):
        super().__init__()
        self.tracker = tracker
        self.kinds = decision_kinds()
        self.phase = "low"
        self._low: dict[tuple, list[torch.Tensor]] = {}      # key -> the autocast run's decision per call
        self._kind: dict[tuple, str] = {}
        self._calls: dict[tuple, int] = {}
        self._tracked: dict[int, tuple] = {}                  # storage -> key of the decision it holds
        self._alive: list[torch.Tensor] = []                  # keeps those storages from being reused
        self.used: set[tuple] = set()
        self._counts: dict[tuple, list] = {}                  # key -> [count tensors, total, calls compared]

    @property
    def recorded(self) -> bool:
        """Whether the autocast run made any decision on floating values."""
        return bool(self._low)

    def compare(self) -> None:
        """Switch to the FP32 run: its decision ops are compared with the autocast run's."""
        self.phase, self._calls = "ref", {}
        self._tracked.clear()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if self._tracked and name not in _SHAPE_ONLY:
            self._follow(name, args, kwargs, out)
        kind = self.kinds.get(name)
        if kind is None:
            return out
        bound = bind(func, args, kwargs)
        choice = decision_of(kind, name, bound, out)
        if choice is None:
            return out
        # The model's line, not the caller's: frames from measure_decisions outward (check, the user's script)
        # are not the model's code, which a library model (transformers under site-packages) would fall back to.
        key = (self.tracker.current, name, user_source(sys._getframe(1), stop=measure_decisions.__code__,
                                                         packages=self.tracker.packages))
        call = self._calls.get(key, 0)
        self._calls[key] = call + 1
        if self.phase == "low":
            self._low.setdefault(key, []).append(kept(kind, choice))
            self._kind[key] = kind
            self._track(choice, key)
        else:
            low = self._low.get(key, [])
            result = flips(kind, name, bound, out, low[call]) if call < len(low) else None
            if result is not None:
                row = self._counts.setdefault(key, [[], 0, 0])
                row[0].append(result[0])
                row[1] += result[1]
                row[2] += 1
        return out

    def _track(self, t: torch.Tensor, key: tuple) -> None:
        s = _storage(t)
        if s is not None:
            self._tracked[s] = key
            self._alive.append(t)

    def _follow(self, name: str, args: tuple, kwargs: dict, out: Any) -> None:
        # Which decisions this op reads; a view or copy of one is followed, any other op uses it.
        keys = {self._tracked.get(_storage(t)) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        keys.discard(None)
        if not keys:
            return
        if name in _PASS_ON:
            for o in tree_flatten(out)[0]:
                if isinstance(o, torch.Tensor):
                    for key in keys:
                        self._track(o, key)
        elif self.phase == "low":
            self.used.update(keys)

    def rows(self) -> list[dict]:
        """One row per decision site compared (module, op, source, kind, what, decisions, flipped,
        share_flipped, used, calls), in the autocast run's order."""
        keys = [k for k in self._low if k in self._counts and self._counts[k][1]]
        sums = [torch.stack(self._counts[k][0]).sum() for k in keys]
        counts = torch.stack([s.to(sums[0].device) for s in sums]).tolist() if sums else []
        out = []
        for key, flipped in zip(keys, counts):
            module, op, source = key
            total, calls = self._counts[key][1], self._counts[key][2]
            kind = self._kind[key]
            out.append({"module": module, "op": op, "source": source, "kind": kind, "what": what(kind),
                        "decisions": total, "flipped": int(flipped), "share_flipped": flipped / total,
                        "used": key in self.used, "calls": calls})
        return out


def measure_decisions(model: nn.Module, args: tuple, kwargs: dict | None = None, *, device_type: str = "cpu",
                      dtype: torch.dtype = torch.bfloat16, rng_state: dict | None = None) -> list[dict]:
    """The decision sites of one forward of ``model`` under ``torch.autocast(device_type, dtype)`` against FP32
    (see the module docstring); ``[]`` when it makes none. ``rng_state`` (:func:`~ampaudit.runtime.replay_state.
    capture_rng`) is the RNG both runs start from (default: the current one). Buffers and RNG are left as they
    were. An exception of the forward propagates."""
    root = unwrap(model)
    args, kwargs = tuple(args), dict(kwargs or {})
    rng = rng_state if rng_state is not None else capture_rng(float_tensors((args, kwargs)))
    tracker = ModuleStack(root)
    recorder = DecisionRecorder(tracker)
    with preserved(root, rng), tracker, torch.no_grad():
        with torch.autocast(device_type, dtype=dtype, cache_enabled=False), recorder:
            root(*args, **kwargs)
    if not recorder.recorded:
        return []
    recorder.compare()
    with preserved(root, rng), tracker, torch.no_grad(), ieee_fp32():
        with torch.autocast(device_type, enabled=False), recorder:
            root(*upcast(args), **upcast(kwargs))
    return recorder.rows()


def measure_or_note(model: nn.Module, args: tuple, kwargs: dict | None = None, **kw: Any) -> list[dict]:
    """:func:`measure_decisions`, for ``check --calibrate``: a measurement that raises costs the decisions of this
    batch (a note says why), not the audit."""
    try:
        return measure_decisions(model, args, kwargs, **kw)
    except Exception as exc:  # noqa: BLE001 - the other calibration results stand
        first = " ".join(str(exc).split())[:160]
        note(f"decisions not compared with FP32: {type(exc).__name__}: {first}")
        return []


class DecisionCheckWarning(UserWarning):
    """A decision check failed; training goes on without that check's ``decision`` events."""


class DecisionCheck:
    """The decision part of the watch's divergence checks: ``check(...)`` after the FP32 shadow of a check
    returns the ``decision`` event fields. A model whose first check makes no decision on floating values is
    not measured again (its later checks cost nothing)."""

    def __init__(self, root: nn.Module, *, device_type: str):
        self.root, self.device_type = unwrap(root), device_type
        self.checks = 0
        self.idle = False

    def check(self, args: tuple, kwargs: dict, rng_state: dict | None, dtype: torch.dtype,
              step: int | None = None) -> list[dict]:
        """Measure this pass's decisions (the model's weights as in the pass: before the optimizer step); a
        check that raises gives a :class:`DecisionCheckWarning` and no events."""
        if self.idle:
            return []
        if any(p.is_floating_point() and p.dtype != torch.float32 for p in self.root.parameters()):
            return []        # a model cast to half has no FP32 to compare with (as the divergence probe)
        self.checks += 1
        try:
            rows = measure_decisions(self.root, args, kwargs, device_type=self.device_type, dtype=dtype,
                                     rng_state=rng_state)
        except Exception as exc:  # noqa: BLE001 - reported, and the training loop goes on
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            warnings.warn(f"ampaudit.watch: the decision check at step {step} failed ({type(exc).__name__}: "
                          f"{first[:200]}); training continues without it", DecisionCheckWarning, stacklevel=2)
            return []
        if not rows and self.checks == 1:
            self.idle = True
        return [{k: v for k, v in row.items() if k != "what"} for row in rows]
