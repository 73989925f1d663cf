"""Kernels the machine running ampaudit lacks for a dtype: a fact about this machine, never a finding about the
target.

    gap = kernel_gap(exc)               # KernelGap(library="oneDNN", dtype="float16", op="LSTM") or None
    gap.sentence("cuda")                # "this CPU's oneDNN has no float16 LSTM kernel; the cuda target is unaffected"
    fp16_kernel_missing("LSTM")         # None when this CPU runs an LSTM under float16 autocast, else why not

CPU autocast sends some ops to kernels this CPU or build may not have in a low dtype: nn.LSTM's mkldnn_rnn_layer
goes to oneDNN, which on many CPUs cannot build an fp16 LSTM ("could not create a primitive descriptor for the
LSTM forward propagation primitive"); other ops are compiled for a few dtypes only ("... not implemented for
'Half'"). A CUDA target has those kernels, and another CPU may: the error says nothing about the model. A kernel
that raises on what it is given (index_add_ on two dtypes, which CUDA refuses too) is not a gap: its message
names the dtypes it expected, and it stays a finding.

``AMPAUDIT_FORCE_NO_FP16_KERNELS=1`` makes :func:`fp16_kernel_missing` answer "missing" for every probe, as on a
CPU without them (the tests that need them skip); ``=0`` answers "present" without probing (a test then fails,
rather than skips, where the kernel is absent). Unset, each probe runs once per process.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

import torch

from ampaudit.dtypes import CPP_NAMES, is_half

FORCE_ENV = "AMPAUDIT_FORCE_NO_FP16_KERNELS"

# How a missing kernel words itself. oneDNN names the primitive; torch's dispatch stubs name the dtype.
_ONEDNN = re.compile(r"could not create a primitive descriptor(?: for (?:the |an? )?(?P<op>\w+))?", re.IGNORECASE)
_NOT_IMPLEMENTED = re.compile(r"\"?(?P<op>\w+)\"? not implemented for '(?P<dtype>Half|BFloat16)'")
# torch's CPU FFT (pocketfft, MKL) has no float16: "Unsupported dtype Half". CUDA's cuFFT has one, for power-of-two
# sizes only; it has no bfloat16 (the same message on CUDA), so a bfloat16 FFT stays a finding.
_FFT_HALF = re.compile(r"(?:^|: )Unsupported dtype Half$")
_FFT_ON_GPU = "cuFFT computes float16 FFTs of power-of-two sizes only"


@dataclass(frozen=True)
class KernelGap:
    """A kernel this machine lacks: ``library`` (oneDNN, or "" for torch's CPU build), ``dtype`` ("float16"),
    ``op`` (what the message names: "LSTM", "addmm_impl_cpu_"; "" when it names nothing)."""

    library: str
    dtype: str
    op: str
    on_gpu: str = ""      # what the kernel does on a GPU target, where that is not simply "unaffected"

    def kernel(self) -> str:
        """ "float16 LSTM kernel" """
        return " ".join(p for p in (self.dtype, self.op, "kernel") if p)

    def sentence(self, target_device: str | None = None, stops_at: str | None = None) -> str:
        """What the report says: this CPU (its oneDNN, or torch's CPU kernels) has no such kernel; with
        ``stops_at`` (a module name, "" for the model) that the forward stopped there, unmeasured from there on;
        with ``target_device``, what that means for the target and what to use here instead.

            gap.sentence("cuda")   # "this CPU's oneDNN has no float16 LSTM kernel; the cuda target is unaffected"
        """
        who = f"this CPU's {self.library}" if self.library else "torch's CPU kernels have"
        text = f"{who} has no {self.kernel()}" if self.library else f"{who} no {self.kernel()}"
        if stops_at is not None:
            text += (f"; the forward stops at {stops_at or 'the top module'} under {self.dtype} autocast on this "
                     "machine, so nothing from there on was measured")
        if target_device is None:
            return text
        if target_device != "cpu":
            return f"{text}; on {target_device}, {self.on_gpu}" if self.on_gpu else \
                f"{text}; the {target_device} target is unaffected"
        other = {"float16": "bfloat16", "bfloat16": "float16"}.get(self.dtype)
        instead = f"use --dtype {other}" if other else "use another --dtype"
        if self.library:
            return f"{text}; a CPU with native {self.dtype} may have it (here, {instead})"
        return f"{text}; every CPU lacks it with this torch ({instead})"


def kernel_gap(error: BaseException | str | None, dtype: torch.dtype | str | None = None) -> KernelGap | None:
    """The :class:`KernelGap` ``error`` (an exception or its message) reports, or None when it is anything else.
    ``dtype``: the low dtype the op ran in, for messages that do not name it (oneDNN's)."""
    text = str(error or "")
    name = str(dtype).replace("torch.", "") if dtype is not None else ""
    m = _ONEDNN.search(text)
    if m:
        return KernelGap("oneDNN", name, m["op"] or "")
    m = _NOT_IMPLEMENTED.search(text)
    if m:
        return KernelGap("", CPP_NAMES[m["dtype"]], m["op"])
    if _FFT_HALF.search(text.strip()):
        return KernelGap("", "float16", "FFT", on_gpu=_FFT_ON_GPU)
    return None


def run_gap(error: BaseException, device_type: str, dtype: torch.dtype | None) -> tuple[str, str] | None:
    """For a run on this machine (a training step, an evaluation) under ``dtype`` autocast on ``device_type``
    (None: no autocast): ``(what to say, what to do)`` when ``error`` is a kernel this CPU lacks, else None.

        say, do = run_gap(exc, "cpu", torch.float16)
        # "this CPU's oneDNN has no float16 LSTM kernel, so float16 autocast cannot run this model on this
        # machine", "train with --dtype bfloat16 here"
    """
    gap = kernel_gap(error, dtype) if device_type == "cpu" and is_half(dtype) else None
    if gap is None:
        return None
    other = "bfloat16" if gap.dtype == "float16" else "float32"
    return (f"{gap.sentence()}, so {gap.dtype} autocast cannot run this model on this machine",
            f"train with --dtype {other} here")


def _lstm(grad: bool) -> None:
    # oneDNN may build the inference primitive where it cannot build the training one: both are probed.
    out = torch.nn.LSTM(3, 8, batch_first=True)(torch.randn(2, 4, 3))[0]
    if grad:
        out.float().sum().backward()


# What is probed: the kernels CPU autocast sends to libraries that may lack a float16 version.
PROBES: dict[str, Callable[[bool], None]] = {"LSTM": _lstm}


def fp16_kernel_missing(name: str, *, grad: bool = True) -> str | None:
    """None when this CPU runs probe ``name`` (a key of :data:`PROBES`) under float16 CPU autocast, with
    gradients (training) or without (``grad=False``, inference); else the reason (what this CPU lacks, or the
    forcing variable). See the module docstring for the variable."""
    forced = os.environ.get(FORCE_ENV, "").strip()
    if forced == "1":
        return f"float16 {name} kernels forced off ({FORCE_ENV}=1)"
    if forced == "0":
        return None
    return _probe(name, grad)


@lru_cache(maxsize=None)
def _probe(name: str, grad: bool) -> str | None:
    try:
        with torch.autocast("cpu", dtype=torch.float16), torch.set_grad_enabled(grad):
            PROBES[name](grad)
    except Exception as exc:  # noqa: BLE001 - any failure means: not here
        gap = kernel_gap(exc, torch.float16)
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:160]
        return gap.sentence() if gap else first
    return None
