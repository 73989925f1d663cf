"""Run a reference computation in true FP32, whatever reduced-precision FP32 modes the user turned on.

    with ieee_fp32():
        ref = model(*upcast(args))        # FP32 inputs, IEEE FP32 matmuls and convolutions

A divergence check compares the low-precision run against an FP32 one; that reference is only worth
something if it really is FP32. PyTorch lets FP32 matmuls and convolutions trade precision for speed:
TF32 on CUDA (cuDNN convolutions use it by default: ``torch.backends.cudnn.conv.fp32_precision`` is
"tf32" out of the box, a 10-bit mantissa, about fp16's) and, after
``torch.set_float32_matmul_precision("medium")``, bf16 inner products in oneDNN on CPU. Measured against
such a reference, an fp16 module's error would be mostly the reference's own.

:func:`ieee_fp32` sets every backend's ``fp32_precision`` to "ieee" for the duration and restores the
exact previous values afterwards. Only the per-backend settings of the new API are touched, never the
legacy ``allow_tf32`` flags: PyTorch raises when a program mixes the two, and restoring the same new-API
values leaves a program that used the legacy flags as it was.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch.utils._pytree import tree_map

from ampaudit.dtypes import is_half

# (backend module path, sub-setting) pairs with an ``fp32_precision`` attribute in torch >= 2.9.
_SETTINGS = (("cuda", "matmul"), ("cudnn", "conv"), ("cudnn", "rnn"),
             ("mkldnn", "matmul"), ("mkldnn", "conv"), ("mkldnn", "rnn"))


def _targets() -> list[Any]:
    # Without CUDA the cuda and cudnn settings decide nothing, and PyTorch refuses to read the legacy
    # ``torch.backends.cudnn.allow_tf32`` once one of them is "ieee": a model that reads it in its forward
    # (transformers' pe_audio) raised in the reference run. So they are set only where CUDA runs.
    cuda = torch.cuda.is_available()
    found = []
    for backend, op in _SETTINGS:
        if backend in ("cuda", "cudnn") and not cuda:
            continue
        obj = getattr(getattr(torch.backends, backend, None), op, None)
        if obj is not None and hasattr(obj, "fp32_precision"):
            found.append(obj)
    return found


@contextlib.contextmanager
def ieee_fp32() -> Iterator[None]:
    """Inside: FP32 matmuls, convolutions and RNNs in IEEE FP32 on every backend; restored on exit."""
    saved: list[tuple[Any, str]] = []
    try:
        for obj in _targets():
            before = obj.fp32_precision
            if before != "ieee":
                obj.fp32_precision = "ieee"
                saved.append((obj, before))
        yield
    finally:
        for obj, before in reversed(saved):
            obj.fp32_precision = before


def upcast(tree: Any) -> Any:
    """``tree`` (tensors in tuples, lists and dicts) with fp16/bf16 tensors converted to float32."""
    if isinstance(tree, torch.Tensor):
        return tree.float() if is_half(tree.dtype) else tree
    if isinstance(tree, (list, tuple)):
        return type(tree)(upcast(t) for t in tree)
    if isinstance(tree, dict):
        return {k: upcast(v) for k, v in tree.items()}
    return tree


def rounded_to(args: tuple, dtypes: list[torch.dtype]) -> tuple:
    """FP32 ``args`` with each floating tensor rounded to the dtype the real run gave it (in flattening order)."""
    it = iter(dtypes)

    def cast(t):
        if not (isinstance(t, torch.Tensor) and t.is_floating_point()):
            return t
        d = next(it, None)
        return t.to(d) if d is not None and d != t.dtype and d.is_floating_point else t

    if all(type(a) is torch.Tensor for a in args):   # the common case, without pytree
        return tuple(cast(a) for a in args)
    return tree_map(cast, args)


def rounds_to(ref: torch.dtype, dtype: torch.dtype) -> bool:
    """Whether storing a ``ref``-dtype value in ``dtype`` rounds it (:func:`as_stored` changes something)."""
    return dtype != ref and dtype.is_floating_point and dtype.itemsize < ref.itemsize


def as_stored(ref: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The FP32 reference ``ref`` as a tensor of ``dtype`` would hold it (rounded, kept in ``ref``'s dtype), where
    that is finite; where rounding overflows, ``ref`` itself (an output that really overflows stays compared with
    the finite answer)."""
    if not rounds_to(ref.dtype, dtype):
        return ref
    stored = ref.to(dtype).to(ref.dtype)
    return torch.where(torch.isfinite(stored), stored, ref)

