"""The user's module inside the wrappers training puts around it: one unwrap for every part of ampaudit.

    root = unwrap(model)      # DistributedDataParallel, DataParallel, FSDP (v1), torch.compile -> the module

Module paths in findings, traces and checkpoints are relative to what this returns. FSDP2 (``fully_shard``) and
``keep_fp32`` change the module in place and wrap nothing, so they need no unwrapping.
"""
from __future__ import annotations

from torch import nn

# Wrappers that hold the user's module in ``.module`` (by class name: FSDP v1 is importable only where
# torch.distributed is built).
_MODULE_WRAPPERS = ("DistributedDataParallel", "DataParallel", "FullyShardedDataParallel")


def unwrap(model: nn.Module) -> nn.Module:
    """Peel DDP / DataParallel / FSDP v1 (``.module``) and torch.compile (``._orig_mod``) wrappers, nested too."""
    while True:
        inner = getattr(model, "_orig_mod", None)       # torch._dynamo OptimizedModule
        if not isinstance(inner, nn.Module):
            inner = getattr(model, "module", None) if type(model).__name__ in _MODULE_WRAPPERS else None
        if not isinstance(inner, nn.Module):
            return model
        model = inner
