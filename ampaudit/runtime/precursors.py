"""Instability precursors measured on the watch's sampled passes (``precursor`` events of the trace).

    meter = PrecursorMeter(root, torch.bfloat16)
    meter.begin_pass(step)                   # root forward pre-hook of a sampled pass
    ...                                      # the model's forward: softmax / sdpa calls are recorded per module
    meter.observe_activation("blocks.0", t)  # module outputs, on the pass of an interval that takes exact counts
    meter.end_forward(outputs)               # root forward hook: the output logits
    events = meter.drain()                   # once per interval: ``precursor`` event fields; one host read

Signals (thresholds and citations: rules/policy/precursors.toml):
- ``attn_logit``: per module whose own code calls softmax on attention scores or scaled_dot_product_attention
  (also through ``F.multi_head_attention_forward``), the largest pre-softmax logit (signed max: additive masks
  are negative and do not count). Where sdpa never materializes the logits, ``q @ k^T * scale (+ mask)`` is
  recomputed here in FP32, in chunks of query rows.
- ``output_logit`` / ``output_lse``: the model's output when it looks like logits: the largest magnitude of a row's
  top logit (the output's max, or minus the lowest row max of a strided sample of rows: far-negative logits of
  tokens with ~0 probability do not count) and the mean log-sum-exp (log Z) over that sample; module ``""``, and
  ``producer`` the module that made it (:class:`~ampaudit.runtime.output_producer.OutputProducer`) when one did.
- ``massive_activation``: per module, on the pass of each interval that takes exact counts, its |output| max over
  the median |x| of a strided sample of that output.

Calls are seen through recording wrappers of the softmax and attention functions, in place only during a sampled
forward (:class:`LogitRecorder`), and attributed by a :class:`CallStack` (the innermost module of the model on the
Python call stack is the one whose own code made the call). What this module computes never
changes the model's outputs, and a failure to compute a signal skips that signal (a precursor must never break the
training step).
"""
from __future__ import annotations

import functools
import math
import sys
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from ampaudit.dtypes import dtype_of, limits
from ampaudit.policy import precursors as precursor_policy
from ampaudit.runtime.module_stack import module_names
from ampaudit.runtime.output_producer import OutputProducer
from ampaudit.runtime.stats import absmax_of

# (owner, attribute, kind): the functions whose calls are recorded on a sampled pass.
PATCHED = ((F, "softmax", "softmax"), (torch, "softmax", "softmax"), (torch.Tensor, "softmax", "softmax"),
           (F, "scaled_dot_product_attention", "sdpa"), (F, "multi_head_attention_forward", "mha"))
# A signal's computation that fails on an unusual input is skipped, not raised into the training step.
_SKIPPED = (RuntimeError, TypeError, ValueError, IndexError)


def logit_limit(dtype: torch.dtype | str | None) -> float:
    """|logit| from which ``dtype`` spaces values more than ``[output_logit] max_spacing`` nats apart (bf16: 64,
    fp16: 512); an unknown dtype is judged as bf16, the wider-spaced of the two."""
    dtype = dtype_of(dtype)
    if dtype is None or not dtype.is_floating_point:
        dtype = torch.bfloat16
    return precursor_policy()["output_logit"]["max_spacing"] / limits(dtype).eps


def sdpa_max_logit(q: torch.Tensor, k: torch.Tensor, attn_mask: torch.Tensor | None = None, *,
                   is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False,
                   chunk_elements: int = 1 << 22) -> torch.Tensor:
    """0-d FP32 tensor: the largest logit ``q @ k^T * scale (+ attn_mask)`` of ``F.scaled_dot_product_attention``
    (same arguments), computed in FP32 in chunks of query rows; masked-out entries do not count (-inf when every
    entry is masked)."""
    q, k = q.detach(), k.detach()
    L, S, E = q.shape[-2], k.shape[-2], q.shape[-1]
    scale = E ** -0.5 if scale is None else scale
    if enable_gqa and k.dim() >= 3 and q.shape[-3] != k.shape[-3]:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
    kt = k.float().transpose(-2, -1)
    lead = math.prod(torch.broadcast_shapes(q.shape[:-2], k.shape[:-2]))
    rows = max(1, chunk_elements // max(1, lead * S))
    best = torch.full((), -math.inf, device=q.device)
    with torch.autocast(q.device.type, enabled=False):
        for start in range(0, L, rows):
            stop = min(L, start + rows)
            logits = (q[..., start:stop, :].float() @ kt) * scale
            if attn_mask is not None:
                m = attn_mask[..., start:stop, :] if attn_mask.dim() >= 2 and attn_mask.shape[-2] == L else attn_mask
                logits = logits.masked_fill(~m, -math.inf) if m.dtype == torch.bool else logits + m.float()
            if is_causal:
                keep = torch.ones(stop - start, S, dtype=torch.bool, device=q.device).tril(diagonal=start)
                logits = logits.masked_fill(~keep, -math.inf)
            best = torch.maximum(best, logits.amax())
    return best


def mha_max_logit(args: tuple, kwargs: dict, chunk_elements: int = 1 << 22) -> torch.Tensor | None:
    """The largest logit of an ``F.multi_head_attention_forward`` call (what nn.MultiheadAttention runs in
    training), from its projections and masks; None for the forms it does not cover (static or biased keys)."""
    names = ("query", "key", "value", "embed_dim_to_check", "num_heads", "in_proj_weight", "in_proj_bias",
             "bias_k", "bias_v")
    a = dict(zip(names, args), **kwargs)
    if a.get("bias_k") is not None or a.get("static_k") is not None or a.get("add_zero_attn"):
        return None
    query, key, heads = a["query"], a["key"], int(a["num_heads"])
    batched = query.dim() == 3                      # (L, N, E): nn.MultiheadAttention passes sequence first
    if a.get("use_separate_proj_weight"):
        wq, wk = a["q_proj_weight"], a["k_proj_weight"]
    else:
        wq, wk, _ = a["in_proj_weight"].chunk(3)
    bias = a.get("in_proj_bias")
    bq, bk = (None, None) if bias is None else bias.chunk(3)[:2]
    with torch.autocast(query.device.type, enabled=False):
        q = F.linear(query.detach().float(), wq.detach().float(), None if bq is None else bq.detach().float())
        k = F.linear(key.detach().float(), wk.detach().float(), None if bk is None else bk.detach().float())
    q = q.unsqueeze(1) if not batched else q
    k = k.unsqueeze(1) if not batched else k
    L, N, E = q.shape
    S = k.shape[0]
    q = q.reshape(L, N, heads, E // heads).permute(1, 2, 0, 3)          # (N, H, L, d)
    k = k.reshape(S, N, heads, E // heads).permute(1, 2, 0, 3)
    mask = _mha_mask(a.get("attn_mask"), a.get("key_padding_mask"), N, heads, L, S)
    return sdpa_max_logit(q, k, mask, is_causal=bool(a.get("is_causal")) and mask is None,
                          chunk_elements=chunk_elements)


def _mha_mask(attn_mask: Any, padding: Any, n: int, heads: int, L: int, S: int) -> torch.Tensor | None:
    # nn.MultiheadAttention's masks say True (or -inf) where a key is *not* attended: sdpa's convention is the
    # opposite for booleans, so both are turned into one additive float mask of shape (N, H, L, S).
    total = None
    for m, shape in ((attn_mask, None), (padding, (n, 1, 1, S))):
        if m is None:
            continue
        add = torch.zeros(m.shape, device=m.device).masked_fill(m, -math.inf) if m.dtype == torch.bool \
            else m.detach().float()
        if shape is not None:
            add = add.reshape(shape)
        elif add.dim() == 3:                         # (N * H, L, S)
            add = add.reshape(n, heads, L, S)
        total = add if total is None else total + add
    return total


def is_attention_scores(x: Any, min_ndim: int = 4) -> bool:
    """Whether a softmax input looks like attention scores: >= ``min_ndim`` dims, or 3 dims and square."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() < 3:
        return False
    return x.dim() >= min_ndim or x.shape[-1] == x.shape[-2]


class CallStack:
    """The innermost running module of ``root`` at the moment :attr:`current` is read, from the Python call stack:
    the nearest frame whose ``self`` is one of ``root``'s modules (its ``forward``, or a method or closure of it);
    modules outside ``root`` are transparent. Nothing is registered: global module hooks would put every module
    call of the pass on ``nn.Module``'s slow path to answer a question asked once per attention call."""

    def __init__(self, root: nn.Module, max_depth: int = 64):
        self.names = module_names(root)
        self.max_depth = max_depth

    @property
    def current(self) -> str:
        frame = sys._getframe(1)
        for _ in range(self.max_depth):
            if frame is None:
                break
            code = frame.f_code
            if code.co_argcount and code.co_varnames[0] == "self" or "self" in code.co_freevars:
                mod = frame.f_locals.get("self")
                name = self.names.get(mod) if isinstance(mod, nn.Module) else None
                if name is not None:
                    return name
            frame = frame.f_back
        return ""


class LogitRecorder:
    """While entered, records the largest pre-softmax logit of each attention call, keyed by the module
    ``stack.current`` names.

    The functions of :data:`PATCHED` are replaced by recording wrappers for the duration (one sampled forward), and
    restored on exit. A ``TorchFunctionMode`` would see the calls too, but it routes every torch call of the pass
    through Python (docs/watch.md: it more than doubled what the precursors cost). A call made inside a wrapped one
    (F.softmax calls Tensor.softmax; multi_head_attention_forward calls sdpa) is not recorded twice; code that
    imported a function by name before the watch started (``from torch.nn.functional import softmax``) is not seen.
    The wrappers are process-wide while in place: a call from another thread in that time is charged to the module
    the watched forward is running.
    """

    def __init__(self, stack: CallStack, cfg: dict):
        self.stack, self.min_ndim, self.chunk = stack, int(cfg["min_ndim"]), int(cfg["chunk_elements"])
        self.found: dict[str, list[torch.Tensor]] = {}
        self._saved: list[tuple[Any, str, Any]] = []
        self._inside = False
        self._wrappers: dict[tuple[int, str], tuple[Any, Any]] = {}   # (PATCHED index, kind) -> (original, wrapper)

    def __enter__(self) -> "LogitRecorder":
        """Start recording into a fresh :attr:`found` (one recorder serves pass after pass)."""
        self.found = {}
        for i, (owner, name, kind) in enumerate(PATCHED):
            # Tensor.softmax lives on the C base class: the wrapper shadows it on Tensor and is deleted on exit.
            self._saved.append((owner, name, owner.__dict__.get(name)))
            original = getattr(owner, name)
            made = self._wrappers.get((i, kind))
            if made is None or made[0] is not original:    # made once per function (someone may patch it too)
                made = self._wrappers[(i, kind)] = (original, self._wrap(original, kind))
            setattr(owner, name, made[1])
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, name, own in reversed(self._saved):
            if own is None:
                delattr(owner, name)
            else:
                setattr(owner, name, own)
        self._saved.clear()

    def _wrap(self, original: Any, kind: str) -> Any:
        @functools.wraps(original)
        def recording(*args: Any, **kwargs: Any) -> Any:
            if self._inside:
                return original(*args, **kwargs)
            self._inside = True
            try:
                try:
                    value = self._max_logit(kind, args, kwargs)
                except _SKIPPED:
                    value = None
                if value is not None:
                    self.found.setdefault(self.stack.current, []).append(value)
                return original(*args, **kwargs)
            finally:
                self._inside = False
        return recording

    def _max_logit(self, kind: str, args: tuple, kwargs: dict) -> torch.Tensor | None:
        with torch.no_grad():
            if kind == "sdpa":
                names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
                a = dict(zip(names, args), **kwargs)
                return sdpa_max_logit(a["query"], a["key"], a.get("attn_mask"), is_causal=bool(a.get("is_causal")),
                                      scale=a.get("scale"), enable_gqa=bool(a.get("enable_gqa")),
                                      chunk_elements=self.chunk)
            if kind == "mha":
                return mha_max_logit(args, kwargs, self.chunk)
            x = args[0] if args else kwargs.get("input")
            if not is_attention_scores(x, self.min_ndim):
                return None
            return x.detach().amax().float()


class PrecursorMeter:
    """The precursor signals of one watch: see the module docstring for the calling pattern."""

    def __init__(self, root: nn.Module, dtype: torch.dtype):
        self.cfg = precursor_policy()
        self.dtype = dtype
        self._stack = CallStack(root)
        self._idle = LogitRecorder(self._stack, self.cfg["attn_logit"])      # reused by every sampled pass
        self._recorder: LogitRecorder | None = None
        self.producer = OutputProducer(root)        # the module that makes the output: its hooks feed it
        self._step: int | None = None
        # Per pass: (step, 0-d device tensor); read once per interval, so the step each value was seen at is known.
        self._attn: dict[str, list[tuple[int | None, torch.Tensor]]] = {}
        self._out_max: list[tuple[int | None, torch.Tensor]] = []
        self._out_lse: list[tuple[int | None, torch.Tensor]] = []
        # step, min, max, |x| of the strided sample: the |x| max and the median are taken at the drain, all at once.
        self._massive: dict[str, tuple[int | None, torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    @property
    def active(self) -> bool:
        return self._recorder is not None

    def begin_pass(self, step: int | None) -> None:
        """Start recording attention calls (the root's forward of ``step`` is about to run)."""
        self.abort()
        self.producer.clear()
        self._step = step
        self._recorder = self._idle
        self._recorder.__enter__()

    def abort(self) -> None:
        """Stop recording without keeping this pass's values (a forward that raised; the watch closing)."""
        if self._recorder is not None:
            rec, self._recorder = self._recorder, None
            rec.__exit__(None, None, None)

    def end_forward(self, outputs: list[torch.Tensor],
                    extremes: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Stop recording; keep the pass's attention maxima and measure the first output that looks like logits.
        ``extremes``: the (min, max) of ``outputs[0]``, if already computed (the statistics have them)."""
        rec = self._recorder
        if rec is None:
            return
        self.abort()
        for module, values in rec.found.items():
            best = torch.stack(values).amax() if len(values) > 1 else values[0]
            self._attn.setdefault(module, []).append((self._step, best))
        cfg = self.cfg["output_logit"]
        for i, out in enumerate(outputs):
            if out.dim() >= 2 and out.shape[-1] >= cfg["min_classes"]:
                try:
                    self._measure_logits(out.detach(), int(cfg["sample_rows"]), extremes if i == 0 else None)
                except _SKIPPED:
                    pass
                if self.producer.observed:      # a pass with module hooks (else the last one found stands)
                    self.producer.resolve(out)
                break
        self.producer.clear()

    def _measure_logits(self, out: torch.Tensor, sample_rows: int,
                        extremes: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        hi = extremes[1] if extremes is not None else out.amax()
        rows = out.reshape(-1, out.shape[-1])
        rows = rows[:: max(1, rows.shape[0] // sample_rows)][:sample_rows]
        with torch.autocast(out.device.type, enabled=False):
            sample = rows.float()
            # What must resolve are each row's top logits (those within a few nats of its max carry its probability):
            # a far-negative logit (a token never seen, pushed down) has ~0 probability whatever its spacing, so the
            # output's min does not count. The top side exactly (the output's max); a row whose max is itself far
            # below 0 (every logit shifted down) from the sampled rows.
            self._out_max.append((self._step, torch.maximum(hi.float(), -sample.amax(dim=-1).min())))
            self._out_lse.append((self._step, torch.logsumexp(sample, dim=-1).mean()))

    def observe_activation(self, module: str, t: torch.Tensor,
                           extremes: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """``module``'s |output| max and the median |x| of a strided sample of it (on the counting pass of an
        interval: once per module and interval). ``extremes``: ``t``'s (min, max), if already computed (the
        statistics have them)."""
        if module in self._massive or not t.numel():
            return
        n = int(self.cfg["massive_activation"]["sample"])
        flat = t.detach().reshape(-1)
        lo, hi = extremes if extremes is not None else torch.aminmax(flat)
        # abs() copies the sample (the output may change in place later); its median waits for the drain.
        self._massive[module] = (self._step, lo, hi, flat[:: max(1, flat.numel() // n)][:n].abs())

    def _massive_values(self) -> list[torch.Tensor]:
        """Per module of :attr:`_massive`: its output's min and max and its sample's median |x|, 0-d tensors (the
        medians of samples of one length and dtype in one batched call)."""
        rows = list(self._massive.values())
        medians: list[Any] = [None] * len(rows)
        by_kind: dict[tuple, list[int]] = {}
        for i, (_, _, _, sample) in enumerate(rows):
            by_kind.setdefault((sample.numel(), sample.dtype, sample.device), []).append(i)
        for at in by_kind.values():
            found = torch.stack([rows[i][3] for i in at]).float().median(dim=1).values
            for i, m in zip(at, found):
                medians[i] = m
        out = []
        for (_, lo, hi, _), median in zip(rows, medians):
            out += [lo, hi, median]
        return out

    def drain(self) -> list[dict]:
        """``precursor`` event fields for the passes since the last drain; resets. One host read for all signals."""
        if self._out_max:                       # the root's output was judged as logits, not as an activation
            self._massive.pop("", None)
        series = [self._attn[m] for m in sorted(self._attn)] + ([self._out_max, self._out_lse] if self._out_max else [])
        pending = [v for s in series for _, v in s] + (self._massive_values() if self._massive else [])
        # One stack on the first value's device and one read (a read per value would sync per value on CUDA).
        dev = pending[0].device if pending else None
        values = torch.stack([v.float().reshape(()).to(dev) for v in pending]).tolist() if pending else []
        read, at = [], 0
        for s in series:
            read.append([(step, v) for (step, _), v in zip(s, values[at:at + len(s)])])
            at += len(s)
        rest = values[at:]
        massive = {m: (row[0], absmax_of(*rest[3 * i: 3 * i + 2]), rest[3 * i + 2])
                   for i, (m, row) in enumerate(self._massive.items())}
        out = [self._event("attn_logit", m, r, self.cfg["attn_logit"]["warning"])
               for m, r in zip(sorted(self._attn), read)]
        if self._out_max:
            limit = logit_limit(self.dtype)
            made = {} if self.producer.name is None else {"producer": self.producer.name}
            out += [dict(self._event("output_logit", "", read[-2], limit), **made),
                    dict(self._event("output_lse", "", read[-1], limit), **made)]
        out += self._massive_events(massive)
        self._attn, self._out_max, self._out_lse, self._massive = {}, [], [], {}
        return out

    @staticmethod
    def _event(signal: str, module: str, seen: list[tuple[int | None, float]], threshold: float) -> dict:
        # The interval's largest value (by magnitude for log Z, which can drift either way), the step it was seen
        # at, and the first sampled step at or past the threshold (None: not reached).
        key = (lambda sv: abs(sv[1])) if signal == "output_lse" else (lambda sv: sv[1])
        worst = max(seen, key=lambda sv: math.inf if math.isnan(sv[1]) else key(sv))
        crossed = next((st for st, v in seen if not key((st, v)) < threshold), None)
        return {"signal": signal, "module": module, "value": worst[1], "max_step": worst[0], "threshold": threshold,
                "crossed_step": crossed, "passes": len(seen)}

    def _massive_events(self, seen: dict[str, tuple[int | None, float, float]]) -> list[dict]:
        cfg = self.cfg["massive_activation"]
        found = []
        for module, (step, absmax, median) in seen.items():
            if not math.isfinite(absmax) or absmax < cfg["record_abs"]:
                continue
            ratio = absmax / median if median > 0 else None     # a median of 0 (mostly zeros): no ratio
            found.append({"signal": "massive_activation", "module": module, "value": ratio, "absmax": absmax,
                          "median": median, "threshold": cfg["ratio"], "min_abs": cfg["min_abs"], "max_step": step})
        return found
