"""The transforms a model goes through before training, each a small function, applied in one order.

The order is torchtitan's (float8, then activation checkpointing, then compile, then data parallel):

1. ``plan``: the float8 layers of a plan convert to torchao's float8 training and its float32 layers keep fp32
   (``ampaudit train --plan`` / ``--dtype float8``, before the trainer is built). It swaps modules, so it comes
   before anything that holds on to them.
2. ``activation_checkpointing``: the repeated blocks recompute their inside in backward
   (:mod:`ampaudit.train.activations`), around whatever module the plan left there.
3. ``compile``: ``torch.compile`` of the model in place, over the checkpointed blocks; the watch's sampled steps
   run it eagerly (:func:`eager`), and the trainer's ``close`` gives the model its eager calls back (:func:`uncompile`).
4. ``data_parallel``: FSDP2's ``fully_shard`` of the blocks and the root, or DDP's wrapper, outermost.

Before step 2 the trainer moves the model to its device, casts it for O2 and converts BatchNorm for ``sync_bn``:
these change tensors and leaf modules, not the structure the transforms above see.

    chosen = apply_plan(model, plan_data, device="cpu")        # 1 (ampaudit train does this)
    names = checkpoint_activations(model, "auto")              # 2
    compile_model(model, "aot_eager")                          # 3
    wrapped = data_parallel(model, ctx, device, fsdp=False)    # 4 (DDP under torchrun)
    applied(model)      # ["plan", "activation_checkpointing", "compile", "data_parallel"]

Each function records its name in ``log`` (default: the model's own record, :func:`applied`); applying one after
itself or a later one is a TrainError. The trainer keeps a log of its own (``trainer.transforms``), so a model
trained twice goes through its transforms again.
"""
from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Sequence

import torch
import torch.nn as nn

from ampaudit.errors import TrainError
from ampaudit.train import ddp
from ampaudit.train import fsdp as fsdp_lib
from ampaudit.train.activations import checkpoint_blocks

ORDER = ("plan", "activation_checkpointing", "compile", "data_parallel")

_applied: "weakref.WeakKeyDictionary[nn.Module, list[str]]" = weakref.WeakKeyDictionary()


def applied(model: nn.Module) -> list[str]:
    """The transforms applied to ``model`` without a log of their own, in the order they were applied."""
    return list(_applied.get(model, []))


def _log_for(model: nn.Module, name: str, log: list[str] | None) -> list[str]:
    """The list ``name`` goes into (``log``, else ``model``'s own record), once ``name`` may follow what it holds."""
    log = _applied.setdefault(model, []) if log is None else log
    later = [d for d in log if ORDER.index(d) >= ORDER.index(name)]
    if later:
        raise TrainError(f"the {name} transform cannot follow {later[0]}",
                         hint=f"transforms apply in the order {' -> '.join(ORDER)} (ampaudit.train.transforms)")
    return log


def apply_plan(model: nn.Module, plan: dict, *, device: str | torch.device, pad: bool = False,
               log: list[str] | None = None) -> dict:
    """1. Convert ``model`` in place as ``plan`` says (:func:`ampaudit.planning.apply.apply_plan`); what changed."""
    from ampaudit.planning.apply import apply_plan as convert

    log = _log_for(model, "plan", log)
    chosen = convert(model, plan, device=device, pad=pad)
    log.append("plan")
    return chosen


def checkpoint_activations(model: nn.Module, spec: str | Sequence[str], *,
                           recompute_context: Callable[[], contextlib.AbstractContextManager] | None = None,
                           log: list[str] | None = None) -> list[str]:
    """2. Checkpoint the blocks ``spec`` names ("auto" or class names); their qualified names."""
    log = _log_for(model, "activation_checkpointing", log)
    names = checkpoint_blocks(model, spec, recompute_context=recompute_context)
    log.append("activation_checkpointing")
    return names


def compile_model(model: nn.Module, backend: bool | str = True, *, log: list[str] | None = None) -> None:
    """3. ``torch.compile`` ``model``'s calls in place (``backend``: True for inductor, or a backend's name)."""
    log = _log_for(model, "compile", log)
    model.compile(**({"backend": backend} if isinstance(backend, str) else {}))
    log.append("compile")


def uncompile(model: nn.Module) -> None:
    """Undo :func:`compile_model`: ``model``'s calls run eagerly again (where ``nn.Module.compile`` keeps them)."""
    model._compiled_call_impl = None


def eager() -> contextlib.AbstractContextManager:
    """Run compiled models eagerly inside the block (the watch's sampled steps, evaluation)."""
    return torch.compiler.set_stance("force_eager")


def data_parallel(model: nn.Module, ctx: ddp.DistContext, device: torch.device, *, fsdp: bool,
                  units: Sequence[tuple[str, nn.Module]] = (), dtype: torch.dtype = torch.float32,
                  reduce_dtype: torch.dtype = torch.float32, log: list[str] | None = None) -> nn.Module:
    """4. Shard ``model`` in place with FSDP2 (``units``, then the root) or wrap it in DDP when distributed;
    the module to call (``model`` itself when nothing wraps it)."""
    log = _log_for(model, "data_parallel", log)
    if fsdp:
        fsdp_lib.shard(model, units, dtype=dtype, reduce_dtype=reduce_dtype)
        wrapped = model
    else:
        wrapped = ddp.wrap(model, ctx, device)
    if fsdp or wrapped is not model:
        log.append("data_parallel")
    return wrapped


__all__ = ["ORDER", "applied", "apply_plan", "checkpoint_activations", "compile_model", "data_parallel", "eager",
           "uncompile"]

