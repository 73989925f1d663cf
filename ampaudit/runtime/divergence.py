"""How far each module's low-precision output drifts from FP32: a shadow FP32 forward on the same weights.

    rows = compare_to_fp32(model, (x,), {}, dtype=torch.float16)      # offline, one batch (runtime.compare)
    # [{"module": "mlp.fc", "rel_l2": 3e-4, "cosine": 0.99999, "max_abs": 0.002, "sqnr_db": 70.1,
    #   "local_rel_l2": ..., "absmax": 12.5, "headroom_bits": 12.3, "underflow_share": 0.0, ...}, ...]

``ampaudit.watch`` (``runtime.schedule``) drives one :class:`DivergenceProbe` per check: ``begin`` (before the
real forward; records outputs, and parameter gradients if ``capture_grads``), ``end_forward``, ``shadow`` (the
FP32 forward, after backward and before the optimizer step; skipped if the parameters changed), ``grads`` (the
FP32 backward from the captured upstream gradient), ``events`` (one host read), ``close``; then the next check.

Three scopes per module, each with rel_l2 = |a-b|/|b|, cosine, max_abs and SQNR = 20 log10(|b|/|a-b|)
(b is the FP32 reference):
- ``global``: the real (autocast) output against the FP32 shadow's: error accumulated from the input on.
- ``local``: the module's *own* error: the module alone under autocast (off where its caller had turned it off: a
  module kept in FP32 so is re-run in FP32), fed the shadow's FP32 inputs rounded to the dtypes its inputs had in
  the real run (fed FP32, a module that computes in bf16 only *because bf16 arrives* would read 0), against its FP32
  output as the module's output dtype holds it (rounding the exact answer is the dtype's range, not the module's
  code: fp16 subnormals), where finite; ``input_rel_l2`` beside it is what its inputs (a composite's: also its
  children's outputs) lost by that rounding before it saw them (at most a unit roundoff in the dtype's normal
  range), ``output_rel_l2`` what storing the exact answer in its output dtype loses. A composite (the root too) is
  re-run with the submodules it calls computed in FP32 and handed back rounded to their real dtypes
  (:mod:`ampaudit.runtime.own_rerun`): the error of its own code, so a parent never inherits a child's fault. That
  costs an FP32 forward of its subtree, so ``begin(composites=...)`` picks which composites a check re-runs;
  ``local="leaves"`` keeps leaves only. Run right after the module's shadow call, with the RNG state it saw (same
  dropout masks); skipped for modules whose inputs their own forward modified in place. Modules in
  ``AUTOCAST_NEUTRAL`` (exact types whose ops autocast never lowers) that the real run fed fp32 get their zero
  result without the re-run.
- ``grad``: per parameter, the real gradient against the FP32 one, obtained by pushing the *same* upstream
  gradient (d loss / d output, captured during the real backward) through the FP32 graph, so the loss
  function is not needed. ``max_abs`` is in the units of the real gradients (scaled if a loss scaler is on).

Outputs above ``METRIC_SAMPLE`` elements are compared on evenly spaced elements (``metric_batch``). The shadow
runs with autocast off, in IEEE FP32 even where TF32 or bf16 FP32 math is allowed (``fp32.ieee_fp32``), on the
same inputs (upcast) and RNG state; buffers (BatchNorm running stats) are put back afterwards (after the FP32
backward, which needs them unchanged). It needs FP32 parameters (autocast training).
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn as nn

from torch.nn.modules.module import register_module_forward_hook

from ampaudit.notes import note
from ampaudit.dtypes import is_low
from ampaudit.runtime.fp32 import as_stored, ieee_fp32, rounded_to, rounds_to, upcast
from ampaudit.runtime.module_stack import module_names
from ampaudit.runtime.replay_state import buffer_snapshot, float_tensors, rng_replayed
from ampaudit.wrappers import unwrap
from ampaudit.runtime.metric_batch import METRIC_SAMPLE, MetricBatch, batched_sums, sample, sample_copy
from ampaudit.runtime.divergence_results import (ROUNDING_OF as _ROUNDING_OF, Sampled, module_ranges, range_of,
                                                 read_events, sampled_pairs)
from ampaudit.runtime.own_rerun import AUTOCAST_NEUTRAL, NEUTRAL_DEVICES, ChildrenInFP32, rounding_pairs
from ampaudit.runtime.shadow_calls import ShadowCalls

METRICS = ("rel_l2", "cosine", "max_abs", "sqnr_db")

_ZERO_ERROR = (0.0, 0.0, 0.0, 0.0, 0.0)  # metric sums of two identical tensors: rel_l2 0, max_abs 0


class DivergenceProbe:
    """One divergence check of ``root`` (see the module docstring for the order of calls)."""

    def __init__(self, root: nn.Module, *, device_type: str = "cpu", dtype: torch.dtype = torch.float16,
                 local: bool | str = True, ranges: bool = False, names: dict[nn.Module, str] | None = None):
        self.root = unwrap(root)
        self.names = names if names is not None else module_names(self.root)
        self.device_type, self.dtype = device_type, dtype
        self.local, self.ranges = local, ranges
        leaves = {m for m in self.names if next(m.children(), None) is None}
        # local=True: every module, the root too (a composite's own code, children in FP32); "leaves":
        # modules without children (one forward's worth of work instead of one per nesting level).
        self._local_mods = (leaves if local == "leaves" else set(self.names)) if local else set()
        self._composites = self._local_mods - leaves
        self._neutral = ({m for m in self._local_mods if type(m) in AUTOCAST_NEUTRAL}
                         if device_type in NEUTRAL_DEVICES else set())
        self._handles: list[Any] = []
        self._grad_handles: list[Any] = []
        self._real_grads: dict[str, torch.Tensor] = {}
        self._in_local = False
        self._own = ChildrenInFP32(device_type, self.names)     # a composite's re-run: its children in FP32
        self._range: list[tuple[str, torch.Tensor, torch.Tensor]] = []
        self._restore_buffers: Any = None          # set by a gradient-scope shadow until ``grads``
        self._reset()
        self.usable = self._usable()

    def _usable(self) -> bool:        # FP32 weights: a model cast to half has no FP32 to compare with
        return all(p.dtype == torch.float32 for p in self.root.parameters() if p.is_floating_point())

    def _reset(self) -> None:
        # Per-check state: a probe is reused check after check (``begin`` ... ``close``).
        self._last_real: tuple | None = None      # (tensor, clone): containers return their child's output
        self._last_ref: tuple | None = None       # (real clone, shadow tensor, sums)
        self._last_range: tuple | None = None     # (shadow tensors, their versions, counts, absmax)
        self._real: dict[str, list[list[torch.Tensor]]] = {}
        self._in_dtypes: dict[str, list[list[torch.dtype]]] = {}   # per call: dtypes of its floating inputs
        self._amp_on: dict[str, list[bool]] = {}    # per call: whether autocast was on where it was called
        self._calls: dict[str, int] = {}
        self._inputs: dict[str, list[tuple]] = {}
        # (event fields, sums: a device tensor, a row of ``_batch``, or a tuple of plain numbers)
        self._pending: list[tuple[dict, Any]] = []
        self._batch = MetricBatch(METRIC_SAMPLE)
        self._shadow_out: list[torch.Tensor] = []
        self._in_shadow = False
        self._calls_kept: ShadowCalls | None = None     # during a shadow with composite re-runs
        self.active = self._recorded = False
        self._param_versions, self._param_names = [], {}
        self._run_local_now = bool(self._local_mods)
        self._composites_now = set(self._composites)
        self._run_composites_now = bool(self._composites)
        self._out_dtypes: dict[str, list[torch.dtype]] = {}      # per module: its real first call's output dtypes
        self.capture_grads = False       # set by ``begin``: whether ``grads`` will have real gradients

    # --- real forward --------------------------------------------------------------------------------
    def begin(self, *, capture_grads: bool, local: bool = True,
              composites: bool | frozenset[nn.Module] = True) -> None:
        """Before the real forward: record module outputs; optionally the real parameter gradients.
        ``local=False`` skips this check's local re-runs (of the modules the constructor's ``local`` chose);
        ``composites``: which composites are re-run with them (True: all; False: none, the leaves only; or a
        set of modules): a composite's re-run costs an FP32 forward of its subtree."""
        self._reset()
        self._range = []
        self.usable = self._usable()
        if not self.usable:
            return
        self.active = self._recorded = True
        self.capture_grads = capture_grads
        self._run_local_now = local and bool(self._local_mods)
        chosen = self._composites if composites is True else self._composites & set(composites or ())
        self._composites_now = chosen if self._run_local_now else set()
        self._run_composites_now = bool(self._composites_now)
        self._param_names = {p: n for n, p in self.root.named_parameters() if p.requires_grad}
        # An optimizer step bumps the parameters' version counters: a shadow after it compares other weights.
        self._param_versions = [p._version for p in self._param_names]
        # One global hook instead of one per module: registering and removing a few dozen hooks per check
        # cost more than the recording. Global hooks run before a module's own, so the root's output is
        # recorded before the caller's root hook ends the recording.
        self._handles.append(register_module_forward_hook(self._record_real))
        if capture_grads:
            for p, name in self._param_names.items():
                self._grad_handles.append(p.register_hook(self._grad_catcher(name)))

    def _record_real(self, mod: nn.Module, args: Any, out: Any) -> None:
        name = self.names.get(mod)
        if name is None or not self.active:
            return
        if self._local_mods and mod in self._local_mods:
            self._in_dtypes.setdefault(name, []).append(
                [a.dtype for a in args if a.is_floating_point()] if all(type(a) is torch.Tensor for a in args)
                else [t.dtype for t in float_tensors(args)])
            # Called with autocast off (T5's `wo` kept in FP32): its re-run must not compute what it never did.
            self._amp_on.setdefault(name, []).append(torch.is_autocast_enabled(self.device_type))
        # Copied: the caller may modify the output in place later (``out += identity``). Only the elements
        # the metrics read are copied (``_sample``: at most METRIC_SAMPLE), with the shape they came from.
        clones = []
        # One tensor (the common case) skips pytree flattening.
        outs = (out,) if type(out) is torch.Tensor and out.is_floating_point() else float_tensors(out)
        if self._run_composites_now and name not in self._out_dtypes:
            self._out_dtypes[name] = [t.dtype for t in outs]   # what a composite's own re-run rounds it to
        for t in outs:
            if self._last_real is not None and self._last_real[0] is t:
                clones.append(self._last_real[1])
            else:
                c = Sampled(t.shape, sample_copy(t, METRIC_SAMPLE))
                self._last_real = (t, c)
                clones.append(c)
        self._real.setdefault(name, []).append(clones)

    def _grad_catcher(self, name: str):
        def hook(grad: torch.Tensor) -> None:
            prev = self._real_grads.get(name)
            self._real_grads[name] = grad.detach() if prev is None else prev + grad.detach()
        return hook

    def end_forward(self) -> None:
        """After the real forward: stop recording (a checkpointed backward re-runs forwards)."""
        self.active = False
        for h in self._handles:
            h.remove()
        self._handles.clear()

    # --- shadow forward ------------------------------------------------------------------------------
    def shadow(self, args: tuple, kwargs: dict, *, rng_state: dict | None, grad: bool) -> None:
        """After the real forward, or after its backward (``watch`` waits for it: the real activations are
        freed by then): the FP32 forward with global (and local) comparisons per module. Skipped if the
        parameters were modified since ``begin``."""
        if self.active:
            self.end_forward()
        if not self._recorded:
            return
        self._recorded = False
        if [p._version for p in self._param_names] != self._param_versions:
            self._real.clear()
            return
        if self._run_local_now:
            # Their inputs are kept for the re-run; in a composite's re-run the same hooks turn its callees FP32.
            for mod in (self._local_mods if self._run_composites_now else self._local_mods - self._composites):
                self._handles.append(mod.register_forward_pre_hook(self._shadow_pre, with_kwargs=True))
        self._handles.append(register_module_forward_hook(self._shadow_post))
        # After _shadow_post's hook: a composite's re-run (in it) reads the frame this one closes.
        # Only CPU answers are ever kept (ShadowCalls): on another device the bookkeeping would be all cost.
        on_cpu = all(p.device.type == "cpu" for p in self.root.parameters())
        self._calls_kept = ShadowCalls(self.names) if self._run_composites_now and on_cpu else None
        kept = self._calls_kept.hook() if self._calls_kept is not None else []
        grad_ctx = torch.enable_grad() if grad else torch.no_grad()
        self._in_shadow = True
        self._last_real = None
        restore = buffer_snapshot(self.root)
        try:
            with rng_replayed(rng_state), grad_ctx, torch.autocast(self.device_type, enabled=False), ieee_fp32():
                out = self.root(*upcast(args), **upcast(kwargs))
        finally:
            self._in_shadow = False
            for h in kept:
                h.remove()
            self._calls_kept = None
            # The FP32 graph saved some buffers (BatchNorm's running stats): putting them back bumps their
            # version, which its backward would refuse. With the gradient scope they wait for ``grads``.
            if grad:
                self._restore_buffers = restore
            else:
                restore()
        self._real.clear()
        self._last_ref = self._last_range = None
        self._shadow_out = [t for t in float_tensors(out) if t.requires_grad] if grad else []

    def _own_mod(self, mod: nn.Module) -> bool:
        # Whether ``mod``'s own error is re-run on this check.
        return mod in self._local_mods and (mod not in self._composites or mod in self._composites_now)

    def _shadow_pre(self, mod: nn.Module, args: tuple, kwargs: dict) -> Any:
        if self._in_local:
            return self._own.pre(mod, args, kwargs)
        if self._calls_kept is not None and kwargs:
            self._calls_kept.note_kwargs(mod, kwargs)
        if not self._own_mod(mod):
            return None
        if mod in self._neutral and not self._low_fed(self.names[mod], self._calls.get(self.names[mod], 0)):
            return
        flat = float_tensors((args, kwargs))
        state = torch.get_rng_state()
        cuda = {t.device.index or 0 for t in flat if t.is_cuda}
        cuda_state = {d: torch.cuda.get_rng_state(d) for d in cuda}
        self._inputs.setdefault(self.names[mod], []).append(
            (args, kwargs, [t._version for t in flat], state, cuda_state))

    def _shadow_post(self, mod: nn.Module, args: Any, out: Any) -> Any:
        if self._in_local:
            return self._own.post(mod, out)
        name = self.names.get(mod)
        if name is None or not self._in_shadow:
            return None
        call = self._calls.get(name, 0)
        self._calls[name] = call + 1
        refs = [out] if type(out) is torch.Tensor and out.is_floating_point() else float_tensors(out)
        reals = self._real.get(name, [])
        tag = {"module": name} if call == 0 else {"module": name, "call": call}
        if call < len(reals):
            pairs = sampled_pairs(reals[call], refs)
            last = self._last_ref
            if len(pairs) == 1 and last is not None and last[0] is pairs[0][0] and last[1] is pairs[0][1]:
                sums = last[2]                            # same tensors as the child just compared
            else:
                sums = self._batch.add(pairs)
                if len(pairs) == 1:
                    self._last_ref = (pairs[0][0], pairs[0][1], sums)
            if sums is not None:
                self._pending.append(({**tag, "scope": "global"}, sums))
            reals[call] = []
        if self.ranges and refs:
            # Empty outputs (a detector with no detections) have no range; a statistic that fails costs that
            # statistic, not the audit, and the report says which module lacks it.
            try:
                sized = [r for r in refs if r.numel()]
                if sized:
                    counts, amax, self._last_range = range_of(sized, self.dtype, self._last_range)
                    self._range.append((name, counts, amax))
            except Exception as exc:
                note(f"range statistics of {name or 'the top module'} skipped: {type(exc).__name__}: "
                     f"{' '.join(str(exc).split())[:120]}")
        if not self._run_local_now or not self._own_mod(mod):
            return None
        if mod in self._neutral and refs and not self._low_fed(name, call):
            self._pending.append(({**tag, "scope": "local"}, _ZERO_ERROR))
            return None
        stack = self._inputs.get(name)
        if stack:
            a, k, versions, state, cuda_state = stack.pop()
            flat = float_tensors((a, k))
            if [t._version for t in flat] == versions:
                dtypes = self._in_dtypes.get(name, [])
                fp32 = a
                a = rounded_to(a, dtypes[call]) if call < len(dtypes) else a
                amp = self._amp_on.get(name, [])[call:call + 1] or [True]
                try:
                    self._run_local(mod, a, k, state, cuda_state, refs, tag, fp32=fp32, autocast=amp[0])
                except Exception as exc:  # noqa: BLE001 - one module's re-run costs its own error, not the check
                    note(f"own error of {name or 'the top module'} skipped: its re-run on its real input dtypes "
                         f"raised {type(exc).__name__}: {' '.join(str(exc).split())[:120]}")
        return None

    def _low_fed(self, name: str, call: int) -> bool:
        # A neutral module fed fp32 stays fp32 (own error 0 without a re-run); fed fp16/bf16 it computes there.
        dtypes = self._in_dtypes.get(name, [])
        return call < len(dtypes) and any(is_low(d) for d in dtypes[call])

    def _run_local(self, mod: nn.Module, args: tuple, kwargs: dict, state: torch.Tensor,
                   cuda_state: dict, refs: list[torch.Tensor], tag: dict, fp32: tuple = (), autocast=True) -> None:
        self._in_local = True
        if mod in self._composites:
            self._own.start(mod, args, fp32, self._out_dtypes)
        kept = self._calls_kept
        served = (contextlib.nullcontext() if kept is None else
                  kept.serving(mod, self._own) if mod in self._composites else kept.quiet())
        try:
            with rng_replayed({"cpu": state, "cuda": cuda_state}), torch.no_grad(), \
                    torch.autocast(self.device_type, dtype=self.dtype, enabled=autocast), served:
                # Its forward alone: the inputs were recorded after its forward pre-hooks and the reference
                # output before its forward hooks, so running them again would apply a user's hook twice.
                lo = mod.forward(*args, **kwargs)
        finally:
            self._own.stop()
            self._in_local = False
        # Against the FP32 answer as the module's output dtype holds it: rounding the exact result is the
        # dtype's range (values in fp16's subnormals lose digits in any module that outputs them; AMP503 reports
        # them), not the module's code; a pass-through module fed such values would read as a culprit.
        # Rounded on the elements the metrics read (``sample``: the same ones of ``a`` and ``b``, elementwise the
        # same numbers), not over the whole output.
        stored = [(a, as_stored(sample(b, METRIC_SAMPLE), a.dtype), b) for a, b in zip(float_tensors(lo), refs)
                  if a.shape == b.shape]
        sums = self._batch.add([(a, s) for a, s, _ in stored])
        if sums is None:
            return
        self._pending.append(({**tag, "scope": "local"}, sums))
        # What rounding alone costs around it: its inputs (a composite's: also its children's outputs) rounded
        # before it saw them, and the exact answer stored in its output dtype. In the dtype's normal range each
        # is at most a unit roundoff; in its subnormals far more (attribution excuses an own error they explain).
        inputs = rounding_pairs(args, fp32) + (self._own.handed() if mod in self._composites else [])
        output = [(s, b) for a, s, b in stored if rounds_to(b.dtype, a.dtype)]
        for key, pairs in (("input_rel_l2", inputs), ("output_rel_l2", output)):
            part = self._batch.add(pairs) if pairs else None
            if part is not None:
                self._pending.append(({_ROUNDING_OF: key}, part))

    # --- gradients -----------------------------------------------------------------------------------
    def grads(self, upstream: list[torch.Tensor | None]) -> None:
        """Push the real upstream gradient through the FP32 graph; compare per parameter."""
        outs, self._shadow_out = self._shadow_out, []
        self._remove_grad_hooks()         # they would also see the FP32 gradients computed below
        pairs = [(o, g.float()) for o, g in zip(outs, upstream) if g is not None and g.shape == o.shape]
        params = [p for p in self._param_names if self._param_names[p] in self._real_grads]
        try:
            if not pairs or not params:
                return
            with torch.enable_grad(), ieee_fp32():
                g32 = torch.autograd.grad([o for o, _ in pairs], params, [g for _, g in pairs],
                                          allow_unused=True)
        finally:
            self._put_buffers_back()
        named = [(self._param_names[p], ref) for p, ref in zip(params, g32)
                 if ref is not None and ref.numel() and ref.shape == self._real_grads[self._param_names[p]].shape]
        if named:
            rows = batched_sums([(self._real_grads[n], ref) for n, ref in named])
            for (name, _), row in zip(named, rows):
                module = name.rsplit(".", 1)[0] if "." in name else ""
                self._pending.append(({"module": module, "param": name, "scope": "grad"}, row))
        self._real_grads.clear()

    # --- results -------------------------------------------------------------------------------------
    def events(self) -> list[dict]:
        """Fields of one ``divergence`` event per (module, scope[, param]); one host read for all."""
        return read_events(self._pending, self._batch)

    def ranges_by_module(self) -> dict[str, dict]:
        """FP32 reference magnitudes per module, judged against the target dtype (with ``ranges=True``)."""
        return module_ranges(self._range, self.dtype)

    def _put_buffers_back(self) -> None:
        restore, self._restore_buffers = self._restore_buffers, None
        if restore is not None:
            restore()

    def _remove_grad_hooks(self) -> None:
        for h in self._grad_handles:
            h.remove()
        self._grad_handles.clear()

    def close(self) -> None:
        """Remove this check's hooks and drop what it holds; the probe can ``begin`` another check."""
        self._put_buffers_back()
        self._remove_grad_hooks()
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._real_grads.clear()
        self._reset()                    # keeps ``_range``: ``ranges_by_module`` reads it after close
