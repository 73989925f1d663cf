"""What :class:`~ampaudit.analysis.amp_prop.AmpProp` does when an op's fake kernel fails on a node.

    result = recorded_output(prop, n)         # the output a dispatch capture recorded, or None
    result = reshaped_view(prop, n, exc)      # a stride-refused ``view`` run as ``reshape``, or None
    raise_if_real_kernel_raises(prop, n, op)  # InputError when the real kernel rejects the inputs too

Each takes the running interpreter (its environment, fake mode and parameters' device) and the node.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx
from torch._subclasses import fake_tensor
from torch.utils._pytree import tree_map

from ampaudit.analysis.mixed_dtypes import real_error
from ampaudit.errors import InputError
from ampaudit.graph_meta import example_of, source_of

if TYPE_CHECKING:
    from ampaudit.analysis.amp_prop import AmpProp


def recorded_output(prop: "AmpProp", n: fx.Node) -> Any:
    """The output a dispatch capture recorded for ``n`` (meta tensors), as this run's kind of tensor."""
    example = example_of(n)
    if example is None:
        return None
    device = prop.param_device()
    if device.type == "meta":
        return example

    def convert(t):
        if not isinstance(t, torch.Tensor):
            return t
        with torch._subclasses.fake_tensor.unset_fake_temporarily():
            real = torch.empty(t.shape, dtype=t.dtype, device="meta")
        return prop.fake_mode.from_tensor(real)

    return tree_map(convert, example)


def reshaped_view(prop: "AmpProp", n: fx.Node, exc: Exception) -> Any:
    """A ``view`` the strides of this run refuse, run as ``reshape`` (same shape). A meta-built model is
    exported on CPU stand-ins (:func:`ampaudit.capture.export_capture._export_meta`) and propagated on meta,
    whose kernels (attention) lay outputs out differently; the ``.contiguous()`` that was a no-op in the
    export is not in the graph."""
    if n.target is not torch.ops.aten.view.default or "view size is not compatible" not in str(exc):
        return None
    args, kwargs = prop.fetch_args_kwargs_from_env(n)
    try:
        return torch.ops.aten.reshape.default(*args, **kwargs)
    except Exception:
        return None


def raise_if_real_kernel_raises(prop: "AmpProp", n: fx.Node, op: str) -> None:
    """Rerun ``n`` for real on zeros of its inputs' shapes; if the real kernel raises too, the inputs do not fit.

    A fake kernel may raise where the real one would not (``.numpy()`` on a fake tensor); only an op whose
    real kernel rejects those shapes and dtypes is the user's error.
    """
    if prop.autocast_stack:
        # An export graph's autocast regions (wrap_with_autocast) hold dtypes baked under autocast: rerun
        # alone, outside that autocast, their ops mismatch dtypes the real forward never sees.
        return
    with fake_tensor.unset_fake_temporarily():
        args, kwargs = prop.fetch_args_kwargs_from_env(n)
    exc = real_error(prop, n, args, kwargs)
    if exc is not None:
        loc = source_of(n)
        where = f" ({Path(loc.file).name}:{loc.line})" if loc else ""
        raise InputError(f"example inputs do not fit the forward: {op}{where}: "
                         f"{' '.join(str(exc).split())[:240]}",
                         hint="fix example_inputs() or --input to match what the model expects") from exc
