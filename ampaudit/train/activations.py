"""Activation checkpointing of a model's repeated blocks: keep each block's input, recompute its inside in backward.

Mixed precision halves the activations; checkpointing the repeated blocks (transformer layers, ResNet stages) drops
all but their inputs, for one extra forward of each block in backward. The two combine: the recompute runs under
the autocast state and with the RNG state of the original forward (``torch.utils.checkpoint``, non-reentrant, which
records both), so dropout draws the same masks, every op recomputes in the same dtype, and a run with
checkpointing ends with the weights of a run without it (bit for bit on CPU).

    names = checkpoint_blocks(model, "auto")             # the repeated blocks: ["blocks.0", "blocks.1", ...]
    names = checkpoint_blocks(model, ["Block", "MLP"])   # every module of these classes (outermost ones)
    uncheckpoint(model)

``auto`` picks the modules of an ``nn.ModuleList`` / ``nn.Sequential`` whose direct children repeat a class with
submodules of its own (several ``Block``; not several ``Linear``), outermost first. Checkpointing is by instance:
each chosen module's ``forward`` is replaced by a :class:`CheckpointedForward` holding the original, so parameter
names, ``state_dict`` keys, hooks and DDP see the same module. It is skipped when gradients are off (evaluation,
``no_grad`` shadows). ``recompute_context`` (a function returning a context manager) wraps each recompute: the
trainer passes its watch session's ``paused`` so the hooks do not record a block's forward twice.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from ampaudit.errors import UsageError

AUTO = "auto"


class CheckpointedForward:
    """A module's ``forward`` run under non-reentrant activation checkpointing while gradients are enabled."""

    def __init__(self, forward: Callable[..., Any],
                 recompute_context: Callable[[], contextlib.AbstractContextManager] | None = None):
        self.original = forward
        self.recompute_context = recompute_context

    def _contexts(self) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        recompute = self.recompute_context() if self.recompute_context is not None else contextlib.nullcontext()
        return contextlib.nullcontext(), recompute

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.original(*args, **kwargs)
        return checkpoint(self.original, *args, use_reentrant=False, preserve_rng_state=True,
                          context_fn=self._contexts, **kwargs)


def _composite(module: nn.Module) -> bool:
    return next(module.children(), None) is not None


def repeated_blocks(model: nn.Module) -> list[str]:
    """Names of the modules ``auto`` checkpoints: in each ModuleList / Sequential, the children whose class (one
    with submodules) occurs more than once there; a block inside a chosen one is not chosen again."""
    chosen: list[str] = []
    for name, container in model.named_modules():
        if not isinstance(container, (nn.ModuleList, nn.Sequential)):
            continue
        if any(name == c or name.startswith(c + ".") for c in chosen):
            continue
        children = list(container.named_children())
        counts: dict[type, int] = {}
        for _, child in children:
            counts[type(child)] = counts.get(type(child), 0) + 1
        for child_name, child in children:
            if counts[type(child)] > 1 and _composite(child):
                chosen.append(f"{name}.{child_name}" if name else child_name)
    return chosen


def blocks_of_classes(model: nn.Module, classes: Iterable[str]) -> list[str]:
    """Names of the outermost modules whose class name is in ``classes``; an unknown name is a UsageError."""
    wanted = [c.strip() for c in classes if c.strip()]
    present = {type(m).__name__ for m in model.modules()}
    unknown = [c for c in wanted if c not in present]
    if unknown:
        composite = sorted({type(m).__name__ for m in model.modules() if _composite(m)})
        raise UsageError(f"no module of class {', '.join(unknown)} in {type(model).__name__}",
                         hint=f"checkpoint one of {', '.join(composite[:12])}, or pass auto")
    chosen: list[str] = []
    for name, module in model.named_modules():
        if type(module).__name__ in wanted and not any(name.startswith(c + ".") or c == "" for c in chosen):
            chosen.append(name)
    return chosen


def checkpoint_blocks(model: nn.Module, spec: str | Iterable[str], *,
                      recompute_context: Callable[[], contextlib.AbstractContextManager] | None = None) -> list[str]:
    """Checkpoint the blocks ``spec`` names ("auto", "Block,MLP", or a list of class names); return their names."""
    if isinstance(spec, str):
        spec = [AUTO] if spec.strip().lower() == AUTO else spec.split(",")
    spec = list(spec)
    names = repeated_blocks(model) if spec == [AUTO] else blocks_of_classes(model, spec)
    if not names:
        raise UsageError(f"{type(model).__name__} has no repeated blocks to checkpoint (no ModuleList or "
                         "Sequential repeating a module with submodules)",
                         hint='name the classes to checkpoint, e.g. checkpoint_activations="Block"')
    modules = dict(model.named_modules())
    for name in names:
        module = modules[name]
        if not isinstance(module.__dict__.get("forward"), CheckpointedForward):
            module.forward = CheckpointedForward(module.forward, recompute_context)
    return names


def uncheckpoint(model: nn.Module) -> int:
    """Give every checkpointed module of ``model`` its own forward back; return how many there were."""
    count = 0
    for module in model.modules():
        if isinstance(module.__dict__.get("forward"), CheckpointedForward):
            del module.forward
            count += 1
    return count


__all__ = ["AUTO", "CheckpointedForward", "blocks_of_classes", "checkpoint_blocks", "repeated_blocks",
           "uncheckpoint"]
