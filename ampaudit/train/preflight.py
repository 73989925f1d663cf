"""Precision preflight of a distributed run, before its first step: one line per check, each failure with its fix.

    units = block_units(model)                     # ampaudit.train.fsdp
    checks = structure_checks(model, dtype=torch.bfloat16, world_size=2, fsdp=True, units=units)
    checks += resource_checks(model, dtype=torch.bfloat16, reduce_dtype=torch.float32, world_size=2, accum=2,
                              fsdp=True, units=units, optimizer=opt, device=torch.device("cpu"))
    for c in checks: print(c.line())              # "ok   fp32 masters: ...", "FAIL reduce: ..."
    failed(checks)                                 # the failing ones
    preflight_only(model, dtype="bfloat16", fsdp=True)   # all of them, as ampaudit train --preflight-only

The checks (names as printed): ``groups`` (one parameter dtype per FSDP group: fully_shard asserts otherwise),
``masters`` (trainable parameters are fp32 before sharding: FSDP2 does not upcast, so a model cast to bf16 first
trains without master weights), ``reduce`` (the gradient reduction dtype and its overflow risk), ``memory``
(per-rank bytes predicted for parameters, gradients, optimizer state and gathered weights, against the device),
``all-reduce`` (AVG against SUM/N on this process group, the reduction FSDP and DDP use for fp32/bf16). The
all-reduce test is collective: every rank must call :func:`resource_checks`. Under O2 and FSDP, ``updates`` and
``optimizer state`` (:mod:`ampaudit.train.preflight_state`) warn about training state that will change in low
precision without an FP32 master.
"""
from __future__ import annotations

import os
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from ampaudit.dtypes import HALF, name_of
from ampaudit.policy import settings
from ampaudit.train.ddp import collective_device
from ampaudit.train.preflight_check import Check, failed

LOW = HALF


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**27 else f"{n / 2**20:.1f} MiB"


def check_groups(groups: dict[str, list[tuple[str, nn.Parameter]]]) -> Check:
    """``groups``: FSDP group name -> its parameters (:func:`ampaudit.train.fsdp.unit_params`)."""
    for unit, params in groups.items():
        dtypes: dict[torch.dtype, str] = {}
        for name, p in params:
            dtypes.setdefault(p.dtype, name)
        if len(dtypes) > 1:
            mixed = ", ".join(f"{name_of(d)} ({n})" for d, n in dtypes.items())
            return Check("groups", "fail", f"FSDP group {unit or '<root>'!r} mixes parameter dtypes: {mixed}; "
                         "fully_shard needs one dtype per group",
                         "keep every parameter float32 (MixedPrecisionPolicy casts for compute), or give those "
                         "modules their own group (fsdp_wrap: their class)")
    return Check("groups", "ok", f"{len(groups)} FSDP group(s), one parameter dtype each")


def check_masters(model: nn.Module, dtype: torch.dtype, world_size: int, *, fsdp: bool) -> Check:
    low = [(n, p) for n, p in model.named_parameters() if p.requires_grad and p.dtype in LOW]
    if low:
        name, p = low[0]
        what = "FSDP2 does not upcast: the shards would be the only weights, with no fp32 masters" if fsdp else \
            "opt level O1 keeps no fp32 masters"
        return Check("masters", "fail", f"{len(low)} trainable parameter(s) are {name_of(p.dtype)} before training "
                     f"(first: {name}); {what}, so small updates round away",
                     "load the model in float32 (do not call .half()/.to(bfloat16) on it); the training dtype "
                     "is applied for compute only")
    n = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if fsdp:
        how = f"sharded in float32 across {world_size} rank(s), gathered as {name_of(dtype)} for compute" \
            if dtype in LOW else f"sharded in float32 across {world_size} rank(s)"
        return Check("masters", "ok", f"{n:,} parameters {how}: the shards are the FP32 master weights")
    return Check("masters", "ok", f"{n:,} parameters in float32 (autocast computes in {name_of(dtype)})")


def check_reduce(dtype: torch.dtype, reduce_dtype: torch.dtype, world_size: int) -> Check:
    if reduce_dtype == torch.float32:
        return Check("reduce", "ok", f"gradients reduced in float32 over {world_size} rank(s)")
    if reduce_dtype == torch.bfloat16:
        return Check("reduce", "warn", "gradients reduced in bfloat16: the sum keeps 8 mantissa bits, so small "
                     "ranks' contributions round away", "reduce_dtype float32")
    if dtype == torch.bfloat16 or dtype == torch.float32:
        return Check("reduce", "fail", f"gradients reduced in float16 while training in {name_of(dtype)}: without "
                     "a loss scaler backing off, any gradient sum above 65504 becomes inf",
                     "reduce_dtype float32 (or bfloat16)")
    return Check("reduce", "warn", "gradients reduced in float16: FSDP divides by about sqrt(N) before and after "
                 "the sum, but scaled gradients near 65504 still overflow and skip the step",
                 "reduce_dtype float32 costs 2x the reduction bytes and removes the risk")


def _optimizer_states(optimizer: torch.optim.Optimizer | None) -> int:
    if optimizer is None:
        return 2
    name = type(optimizer).__name__.lower()
    if name == "sgd" and not any(g.get("momentum", 0) for g in optimizer.param_groups):
        return 0
    return int(settings()["preflight"]["optimizer_state"].get(name, 2))


def predict_memory(model: nn.Module, *, dtype: torch.dtype, reduce_dtype: torch.dtype, world_size: int,
                   accum: int, fsdp: bool, units: Sequence[nn.Module], opt_level: str = "O1",
                   optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Bytes per rank of parameters, gradients, optimizer state and (FSDP) gathered compute weights."""
    n = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    states = _optimizer_states(optimizer) * 4 * trainable
    low = 2 if dtype in LOW else 4
    if not fsdp:
        out = {"parameters": 4 * n, "gradients": 4 * trainable, "optimizer": states}
        if opt_level == "O2":   # low-precision model + its gradients, FP32 masters with theirs
            out = {"parameters": low * n + 4 * trainable, "gradients": (low + 4) * trainable, "optimizer": states}
        return out
    shard = lambda b: -(-b // world_size)   # noqa: E731  (ceil: the last shard is padded)
    largest = max((sum(p.numel() for p in u.parameters()) for u in units), default=n)
    out = {"parameters": shard(4 * n), "gradients": shard(4 * trainable), "optimizer": shard(states),
           # the block being computed and the next one, prefetched
           "gathered": min(2 * largest, n) * low}
    if accum > 1:       # between syncs FSDP keeps whole (unsharded) gradients in the reduce dtype
        out["accumulated"] = trainable * reduce_dtype.itemsize
    return out


def device_memory(device: torch.device) -> int | None:
    """Bytes this rank may use: the GPU's total, or this host's available RAM shared by its ranks."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    try:
        with open("/proc/meminfo") as fh:
            info = dict(line.split(":", 1) for line in fh)
        available = int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None
    return available // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def check_memory(predicted: dict[str, int], capacity: int | None) -> Check:
    total = sum(predicted.values())
    parts = ", ".join(f"{k} {_gib(v)}" for k, v in predicted.items())
    msg = f"{_gib(total)} per rank predicted ({parts}; activations not included)"
    if capacity is None:
        return Check("memory", "ok", msg + "; device memory unknown")
    fraction = settings()["preflight"]["memory_fraction"]
    if total > fraction * capacity:
        return Check("memory", "fail", f"{msg} exceeds {fraction:.0%} of the "
                     f"{_gib(capacity)} this rank has",
                     "shard with FSDP, add ranks, or use a smaller model / an optimizer with less state")
    return Check("memory", "ok", f"{msg} of {_gib(capacity)}")


def check_all_reduce(dtype: torch.dtype) -> Check:
    """AVG against SUM / N on the default process group, in ``dtype``. Collective."""
    if not dist.is_initialized():
        return Check("all-reduce", "ok", "single process: no reduction")
    world, rank = dist.get_world_size(), dist.get_rank()
    device = collective_device()
    # Distinct per-rank values, exact in every dtype, with a large one that an overflow or a skipped divide shows.
    base = torch.tensor([1.0 + rank, 3.0 * rank, 1000.0, -0.5 * (rank + 1)], dtype=dtype, device=device)
    avg, total = base.clone(), base.clone()
    try:
        dist.all_reduce(avg, op=dist.ReduceOp.AVG)
    except (RuntimeError, ValueError) as exc:
        first = str(exc).split("\n")[0][:80]
        return Check("all-reduce", "warn", f"{dist.get_backend()} has no AVG reduction ({first})",
                     "FSDP and DDP fall back to SUM and a divide on backends without AVG")
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    expect = total.float() / world
    if not torch.allclose(avg.float(), expect, rtol=1e-2, atol=1e-3):
        return Check("all-reduce", "fail", f"{dist.get_backend()} AVG all-reduce in {name_of(dtype)} returned "
                     f"{avg.float().tolist()} where SUM/N is {expect.tolist()}: gradient averaging is wrong on this "
                     "backend", "upgrade torch, or use another backend (nccl on GPUs)")
    return Check("all-reduce", "ok", f"{dist.get_backend()} AVG in {name_of(dtype)} equals SUM/N over {world} rank(s)")


def structure_checks(model: nn.Module, *, dtype: torch.dtype, world_size: int = 1, fsdp: bool = False,
                     units: Sequence[tuple[str, nn.Module]] = (), opt_level: str = "O1") -> list[Check]:
    """The checks of the model as loaded, before it is sharded (``fully_shard`` asserts on what they catch);
    ``units``: the FSDP units of :func:`ampaudit.train.fsdp.block_units`."""
    from ampaudit.train.fsdp import unit_params

    checks = []
    if fsdp:
        checks.append(check_groups(unit_params(model, units)))
    if opt_level != "O2" or fsdp:
        checks.append(check_masters(model, dtype, world_size, fsdp=fsdp))
    return checks


def resource_checks(model: nn.Module, *, dtype: torch.dtype, reduce_dtype: torch.dtype = torch.float32,
                    world_size: int = 1, accum: int = 1, fsdp: bool = False,
                    units: Sequence[tuple[str, nn.Module]] = (), opt_level: str = "O1",
                    optimizer: torch.optim.Optimizer | None = None,
                    device: torch.device = torch.device("cpu")) -> list[Check]:
    """Reduction dtype, memory per rank and the all-reduce self-test. Collective (the all-reduce).

    ``model`` may already be sharded (a DTensor's ``numel`` is the whole tensor's)."""
    reduce_dtype = reduce_dtype if fsdp else torch.float32     # DDP reduces the fp32 gradients it is given
    predicted = predict_memory(model, dtype=dtype, reduce_dtype=reduce_dtype, world_size=world_size, accum=accum,
                               fsdp=fsdp, units=[m for _, m in units], opt_level=opt_level, optimizer=optimizer)
    return [check_reduce(dtype, reduce_dtype, world_size), check_memory(predicted, device_memory(device)),
            check_all_reduce(reduce_dtype)]


def preflight_only(model: nn.Module, *, dtype: str | torch.dtype = "float16", opt_level: str = "O1",
                   accum: int = 1, fsdp: bool = False, fsdp_wrap: Sequence[str] | None = None,
                   reduce_dtype: str | torch.dtype = "float32", device: str | torch.device | None = None,
                   optimizer=None, train_data=None, echo=print) -> list[Check]:
    """``ampaudit train --preflight-only``: every check of the run these settings describe, on the model as loaded
    (nothing is sharded or trained; under O2 it is cast as the trainer would); rank 0 prints one line each. Joins
    and leaves the process group itself. ``train_data``: its first batch runs the dry forward of the ``updates``
    check (:mod:`ampaudit.train.preflight_state`, O2 and FSDP only)."""
    from ampaudit.dtypes import parse_train_dtype
    from ampaudit.train import ddp
    from ampaudit.train.data import resolve_device
    from ampaudit.train.fsdp import block_units
    from ampaudit.train.masters import check_opt_level

    dtype, reduce_dtype = parse_train_dtype(dtype), parse_train_dtype(reduce_dtype)
    opt_level, target = check_opt_level(opt_level), resolve_device(device)
    ctx = ddp.setup(target.type)
    try:
        model.to(target)
        units = block_units(model, fsdp_wrap) if fsdp else []
        params = [p for p in model.parameters() if p.requires_grad]
        opt = optimizer(params) if callable(optimizer) and params else None
        checks = structure_checks(model, dtype=dtype, world_size=ctx.world_size, fsdp=fsdp, units=units,
                                  opt_level=opt_level)
        checks += resource_checks(model, dtype=dtype, reduce_dtype=reduce_dtype, world_size=ctx.world_size,
                                  accum=accum, fsdp=fsdp, units=units, opt_level=opt_level,
                                  optimizer=opt if isinstance(opt, torch.optim.Optimizer) else None, device=target)
        if opt_level == "O2" or fsdp:      # what will change during training is mastered or fp32
            from ampaudit.train.preflight_state import planned_state_checks

            checks += planned_state_checks(model, dtype=dtype, fsdp=fsdp, optimizer=optimizer,
                                           train_data=train_data)
        if ctx.is_main:
            for check in checks:
                echo(check.line())
    finally:
        ddp.teardown(ctx)
    return checks
