"""FSDP2 for the trainer: which blocks to shard, the mixed-precision policy, gradient sync, full state dicts.

``fully_shard`` (torch.distributed.fsdp, what torchtitan uses) shards each parameter across the ranks. The trainer
shards the model's parameters *in fp32*: the shards are the FP32 master weights, and ``MixedPrecisionPolicy``
all-gathers them cast to the training dtype for compute and reduce-scatters the gradients in ``reduce_dtype``
(float32 by default). FSDP2 never upcasts: a model cast to bf16 before sharding has no fp32 masters at all, which
is why the preflight's ``masters`` check (:func:`~ampaudit.train.preflight.check_masters`) refuses it.

    units = shard(model, dtype=torch.bfloat16, reduce_dtype=torch.float32)    # blocks, then the root
    with gradient_sync(model, boundary):            # no reduce-scatter on non-boundary micro-batches
        loss.backward()
    state = full_state_dict(model)                  # collective; rank 0 gets plain tensors
"""
from __future__ import annotations

import contextlib
import math
from collections import Counter
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from ampaudit.dtypes import is_half
from ampaudit.errors import UsageError
from ampaudit.runtime.grads import from_flags, is_sharded as is_dtensor, local, nonfinite_flags
from ampaudit.train.ddp import collective_device

# Containers whose repeated children are a model's blocks (a transformer's layers, a ResNet stage's blocks).
_CONTAINERS = (nn.ModuleList, nn.Sequential)


def is_sharded(model: nn.Module) -> bool:
    """Whether ``fully_shard`` was applied to ``model``."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def block_units(model: nn.Module, classes: Sequence[str] | None = None) -> list[tuple[str, nn.Module]]:
    """The submodules to shard one by one, as ``(qualified name, module)``, outermost first.

    ``classes``: class names to shard (each must occur in the model). Default: the repeated children of the
    outermost ModuleList/Sequential containers that hold at least two children of one class with parameters,
    as torchtitan shards each transformer block. Nested matches inside a chosen unit are not units themselves.
    """
    if classes:
        present = Counter(type(m).__name__ for m in model.modules())
        missing = [c for c in classes if c not in present]
        if missing:
            common = ", ".join(f"{n} ({k})" for n, k in present.most_common(8) if n != type(model).__name__)
            raise UsageError(f"fsdp_wrap names {', '.join(missing)}, which the model does not contain",
                             hint=f"name module classes of this model, e.g. {common}")
        wanted = set(classes)
        chosen = [(n, m) for n, m in model.named_modules() if n and type(m).__name__ in wanted]
    else:
        chosen = []
        for name, container in model.named_modules():
            if not isinstance(container, _CONTAINERS):
                continue
            counts = Counter(type(c) for c in container.children() if any(True for _ in c.parameters()))
            repeated = {cls for cls, k in counts.items() if k >= 2}
            chosen += [(f"{name}.{child_name}" if name else child_name, child)
                       for child_name, child in container.named_children() if type(child) in repeated]
    units: list[tuple[str, nn.Module]] = []
    for name, module in chosen:
        if not any(name.startswith(outer + ".") for outer, _ in units):
            units.append((name, module))
    return units


def unit_params(model: nn.Module, units: Sequence[tuple[str, nn.Module]]) -> dict[str, list[tuple[str, nn.Parameter]]]:
    """The parameters each FSDP group manages: a unit's own (not a nested unit's); the root (``""``) the rest."""
    owner: dict[str, str] = {}
    for unit, module in [("", model), *units]:
        prefix = f"{unit}." if unit else ""
        for pname, _ in module.named_parameters():
            owner[prefix + pname] = unit        # inner units come later and take their parameters over
    groups: dict[str, list[tuple[str, nn.Parameter]]] = {}
    for name, p in model.named_parameters():
        groups.setdefault(owner[name], []).append((name, p))
    return groups


def policy(dtype: torch.dtype, reduce_dtype: torch.dtype):
    """The ``MixedPrecisionPolicy``: compute in ``dtype`` (fp32: no cast), gradients reduced in ``reduce_dtype``."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    param_dtype = dtype if is_half(dtype) else None
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)


def shard(model: nn.Module, units: Sequence[tuple[str, nn.Module]], *, dtype: torch.dtype,
          reduce_dtype: torch.dtype = torch.float32) -> None:
    """``fully_shard`` each unit of :func:`block_units`, then the root, in place."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if not dist.is_initialized():
        raise UsageError("FSDP needs a process group", hint="launch with torchrun, or let the Trainer join one")
    mp = policy(dtype, reduce_dtype)
    # BatchNorm keeps fp32 weights and statistics, as under autocast alone: cast to bf16 by the group's policy, its
    # weight met fp32 running stats and the kernel raised. Its own group, sharded first (bottom-up), gathers fp32
    # and leaves the low-precision input as autocast gave it.
    keep = MixedPrecisionPolicy(param_dtype=None, reduce_dtype=reduce_dtype, cast_forward_inputs=False)
    unit_ids = {id(m) for _, m in units}
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and id(module) not in unit_ids \
                and any(p.requires_grad for p in module.parameters(recurse=False)):
            fully_shard(module, mp_policy=keep)
    for _, module in units:
        fully_shard(module, mp_policy=mp)
    fully_shard(model, mp_policy=mp)


def gradient_sync(model: nn.Module, boundary: bool) -> contextlib.AbstractContextManager:
    """Reduce-scatter gradients only on the boundary micro-batch; between them FSDP keeps unsharded gradients."""
    if is_sharded(model):
        model.set_requires_gradient_sync(boundary)
    return contextlib.nullcontext()


def group_norms(groups: Sequence[Sequence[torch.Tensor]], norm_type: float) -> torch.Tensor:
    """The ``norm_type`` norm (2 or inf) of each group of tensors, in fp32, as one tensor (0 for an empty group).

    FSDP's gradients are DTensors sharded on dim 0, each element on exactly one rank: each rank reduces its local
    shards and one plain all-reduce (SUM of squares, or MAX) joins the groups. Collective when any tensor is a
    DTensor; plain tensors (DDP's replicated gradients) reduce locally. A plain c10d all-reduce rather than
    ``DTensor.full_tensor()``: the functional collectives behind the latter occasionally abort a gloo process at
    exit ("terminate called without an active exception").
    """
    sharded = any(is_dtensor(t) for group in groups for t in group)
    parts = []
    for group in groups:
        tensors = [local(t) for t in group if t.numel()]
        tensors = [t.float() if t.dtype != torch.float32 else t for t in tensors]
        if not tensors:
            parts.append(torch.zeros((), device="cpu"))
            continue
        norms = torch.stack(torch._foreach_norm(tensors, norm_type))
        parts.append(norms.max() if norm_type == math.inf else norms.pow(2).sum())
    device = parts[0].device if parts else torch.device("cpu")
    out = torch.stack([t.to(device) for t in parts]) if parts else torch.zeros(0)
    if sharded and dist.is_initialized():
        dist.all_reduce(out, op=dist.ReduceOp.MAX if norm_type == math.inf else dist.ReduceOp.SUM)
    return out if norm_type == math.inf else out.sqrt()


def nonfinite_grads(named: Sequence[tuple[str, torch.Tensor]]) -> dict[str, list[str]]:
    """``{"params", "modules"}`` whose gradient holds inf/NaN on any rank: each rank flags its shards, one
    all-reduce (MAX) joins them. Collective: every rank must call it with the same parameters."""
    names, flags = nonfinite_flags(named)
    if flags is None:
        return {"params": [], "modules": []}
    if dist.is_initialized():
        flags = flags.to(torch.int32).to(collective_device())
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return from_flags(names, flags.bool().cpu())


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's whole state_dict on CPU, gathered to rank 0 (other ranks get ``{}``). Collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if not is_sharded(model):
        return model.state_dict()
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
