"""A composite module's own re-run: the submodules it calls compute in FP32 and hand back their output rounded to
the dtype the real run gave it, so what differs from FP32 is the composite's own code (the arithmetic between and
around its children). :class:`~ampaudit.runtime.divergence.DivergenceProbe` measures a composite's own error so.

    own = ChildrenInFP32("cpu", names)
    own.start(composite, rounded_args, fp32_args, out_dtypes)   # out_dtypes: module name -> its real output dtypes
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = composite(*rounded_args)       # the probe's hooks call own.pre / own.post for every submodule
    finally:
        own.stop()

Why recompute the children instead of returning their outputs from the FP32 shadow (cheaper): a child's input in
the re-run carries the composite's own error from before the call (a norm computed by hand, then projected), and a
cached output would drop it. A tensor the composite passes on untouched (its own input, one child's output handed
to the next, unless the composite wrote into it in place) reaches the receiving child as its FP32 value: rounding
at that boundary is the receiver's own error
(it is fed rounded inputs in its own re-run), not the composite's. What the composite computes itself stays as it
computed it, in the dtypes it really sees.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map

from ampaudit.policy import op_names
from ampaudit.runtime.fp32 import rounded_to, upcast
from ampaudit.runtime.replay_state import float_tensors

# Modules whose ops autocast never lowers (rules/policy/ops.toml, [autocast_neutral]; exact types): their local
# error is zero by construction, and their local event is written without the re-run.
AUTOCAST_NEUTRAL: frozenset[type] = frozenset(
    getattr(nn, name) for name in op_names().get("autocast_neutral", {}).get("modules", [])
    if isinstance(getattr(nn, name, None), type))
NEUTRAL_DEVICES = ("cpu", "cuda")       # the policies the table is checked against (a test)


def rounding_pairs(rounded: Any, fp32: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(rounded, FP32) pairs of the floating tensors that rounding to a lower dtype changed: what a module's
    re-run receives already rounded (the probe's ``input_rel_l2``)."""
    return [(r, f) for r, f in zip(float_tensors(rounded), float_tensors(fp32))
            if r is not f and r.dtype != f.dtype and r.shape == f.shape]


class ChildrenInFP32:
    """The state of one composite's re-run at a time; see the module docstring."""

    def __init__(self, device_type: str, names: dict[nn.Module, str]):
        self.device_type, self.names = device_type, names
        self.composite: nn.Module | None = None
        self._child: tuple[nn.Module, Any] | None = None      # (outermost submodule in FP32, its autocast context)
        # id(tensor handed to the composite rounded) -> (that tensor, its FP32 value, its version counter then)
        self._fp32_of: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}
        self._out_dtypes: dict[str, list[torch.dtype]] = {}
        # (rounded, FP32) pairs of the children's outputs handed back during the current re-run: what the
        # composite's own code receives already rounded (see handed()).
        self._handed: list[tuple[torch.Tensor, torch.Tensor]] = []

    def start(self, composite: nn.Module, rounded: Any, fp32: Any, out_dtypes: dict[str, list[torch.dtype]]) -> None:
        """Before the composite's re-run on ``rounded`` (its FP32 inputs ``fp32`` rounded to their real dtypes)."""
        self.composite, self._out_dtypes = composite, out_dtypes
        self._handed = []
        self._remember(rounded, fp32)

    def stop(self) -> None:
        """After the re-run, also one that raised (a submodule that raised left its FP32 region open)."""
        self._leave()
        self.composite = None
        self._fp32_of.clear()

    def pre(self, mod: nn.Module, args: tuple, kwargs: dict) -> Any:
        """Forward pre-hook (with kwargs): the outermost submodule called turns autocast off until it returns."""
        if self.composite is None or mod is self.composite or self._child is not None:
            return None
        ctx = torch.autocast(self.device_type, enabled=False)
        ctx.__enter__()
        self._child = (mod, ctx)
        return tree_map(self._as_fp32, args), tree_map(self._as_fp32, kwargs)

    def post(self, mod: nn.Module, out: Any) -> Any:
        """Forward hook: that submodule's output, rounded to the dtypes the real run gave it (None: unchanged)."""
        if self._child is None or self._child[0] is not mod:
            return None
        self._leave()
        dtypes = self._out_dtypes.get(self.names.get(mod, ""))
        if not dtypes:
            return None
        rounded = rounded_to((out,), dtypes)[0]
        self._remember(rounded, out)
        self._handed.extend(rounding_pairs(rounded, out))
        return rounded

    def outermost(self) -> nn.Module | None:
        """The submodule computing in FP32 now (the outermost one the composite called), if any."""
        return self._child[0] if self._child is not None else None

    def handed(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(rounded, FP32) pairs of the children's outputs the last re-run handed the composite."""
        return self._handed

    def _as_fp32(self, t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        seen = self._fp32_of.get(id(t))
        # Untouched only if the composite did not write into it since (`out += identity` in a residual block):
        # an in-place update makes it the composite's own value, which its FP32 twin does not hold.
        untouched = seen is not None and seen[0] is t and t._version == seen[2]
        return seen[1] if untouched else upcast(t)

    def _remember(self, rounded: Any, fp32: Any) -> None:
        for r, f in zip(float_tensors(rounded), float_tensors(fp32)):
            if r is not f:
                self._fp32_of[id(r)] = (r, f, r._version)

    def _leave(self) -> None:
        child, self._child = self._child, None
        if child is not None:
            child[1].__exit__(None, None, None)
