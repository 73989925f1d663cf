"""``ampaudit.keep_fp32``: make named modules of an eager model run in fp32 under autocast.

    ampaudit.keep_fp32(model, ["encoder.*.attn", "head"])     # glob patterns on named_modules() paths
    ampaudit.keep_fp32(model, [nn.LayerNorm])                 # or module classes
    with torch.autocast("cuda", dtype=torch.float16):
        model(x)                                              # matched modules compute in fp32

For models torch.fx cannot rewrite, and for users who keep their eager model (what pytorch issues #49038 and
#70166 ask for). Each matched module's class is swapped for a subclass whose forward turns autocast off on every
device where it is on, upcasts floating tensor arguments (fp16/bf16) to fp32, and runs the original forward.
Outputs stay fp32, for the reason FP32 islands keep theirs (see ``ampaudit.rewrite.island_insert``).
Parameters, buffers, hooks and ``state_dict`` keys are untouched; with autocast off nothing changes at all.
The model is changed in place and returned. ``torch.save(model)`` of the whole object (pickle) cannot name the
swapped classes: save ``state_dict()`` as usual.
"""
from __future__ import annotations

import contextlib
import fnmatch
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from ampaudit.dtypes import is_low_tensor
from ampaudit.errors import UsageError

# Device types whose autocast state is checked on each call.
_DEVICE_TYPES = ("cuda", "cpu", "xpu", "mps", "hpu")

_CLASSES: dict[type, type] = {}


def _upcast(value: Any) -> Any:
    if is_low_tensor(value):
        return value.float()
    return value


def _enabled_devices() -> list[str]:
    out = []
    for d in _DEVICE_TYPES:
        try:
            if torch.is_autocast_enabled(d):
                out.append(d)
        except (RuntimeError, TypeError):  # a device type this build does not know
            continue
    return out


class _KeepFP32:
    """Mixin placed in front of the module's own class."""

    _ampaudit_keep_fp32 = True

    def forward(self, *args, **kwargs):
        devices = _enabled_devices()
        if not devices:
            return super().forward(*args, **kwargs)
        with contextlib.ExitStack() as stack:
            for d in devices:
                stack.enter_context(torch.autocast(d, enabled=False))
            return super().forward(*tree_map(_upcast, args), **tree_map(_upcast, kwargs))


def _fp32_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"FP32{cls.__name__}", (_KeepFP32, cls),
                             {"__module__": cls.__module__, "__doc__": f"{cls.__name__} kept in fp32 under autocast."})
    return _CLASSES[cls]


def _matches(name: str, module: nn.Module, pattern: str | type) -> bool:
    if isinstance(pattern, type):
        return isinstance(module, pattern)
    return fnmatch.fnmatchcase(name, pattern)


def keep_fp32(model: nn.Module, patterns: str | type | Sequence[str | type]) -> nn.Module:
    """Make every module of ``model`` whose dotted name matches a glob pattern (or whose class is given) run
    in fp32 under autocast. Raises UsageError when a pattern matches nothing. Returns ``model``."""
    if not isinstance(model, nn.Module):
        raise UsageError(f"keep_fp32() needs an nn.Module, got {type(model).__name__}", hint="pass the model first")
    if isinstance(patterns, (str, type)):
        patterns = [patterns]
    named = list(model.named_modules())
    for pattern in patterns:
        if not isinstance(pattern, (str, type)):
            raise UsageError(f"keep_fp32() pattern {pattern!r} is neither a module path nor a class",
                             hint="pass names like 'encoder.*.attn' or classes like nn.LayerNorm")
        hits = [(n, m) for n, m in named if _matches(n, m, pattern)]
        if not hits:
            sample = ", ".join(repr(n) for n, _ in named[1:6])
            raise UsageError(f"keep_fp32(): {getattr(pattern, '__name__', pattern)!r} matches no module",
                             hint=f"use dotted paths from named_modules(), e.g. {sample}")
        for _, m in hits:
            if not getattr(m, "_ampaudit_keep_fp32", False):
                m.__class__ = _fp32_class(type(m))
    return model


def fp32_modules(model: nn.Module, paths: Sequence[str]) -> nn.Module:
    """:func:`keep_fp32` on exact ``named_modules()`` paths (no glob: a path may hold ``[`` or ``*``); what the
    module-level fix and the model.py it writes call. Raises UsageError for a path the model lacks."""
    for path in paths:
        try:
            m = model.get_submodule(path)
        except AttributeError as exc:
            raise UsageError(f"keep_fp32(): the model has no module {path!r}",
                             hint="rebuild the fix from the model as it is now") from exc
        if not getattr(m, "_ampaudit_keep_fp32", False):
            m.__class__ = _fp32_class(type(m))
    return model
