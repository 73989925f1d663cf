"""Where a step's updates land: the low-precision tensors that may lose them, and the tensors an aten op writes.

    found = candidates(model, optimizer=opt, mastered=masters)   # params, buffers, optimizer states: Candidate
    written_tensors(func, args, kwargs)                          # what an aten op writes into (its ``Tensor(a!)``)
    low_precision(t)                                             # a real tensor stored in fp16/bf16/fp8

A candidate is a float tensor stored in fp16/bf16/fp8 with no FP32 master to take its updates: the swamping
meter (:mod:`ampaudit.runtime.swamping`) measures the writes into these, and the trainer's preflight
(:mod:`ampaudit.train.preflight_state`) names the ones a forward writes.
"""
from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from ampaudit import dtypes

LOW_FLOATS = dtypes.LOW_FLOATS


def low_precision(t: Any) -> bool:
    """A real (not sharded, not fake) tensor stored in fp16/bf16/fp8."""
    return isinstance(t, torch.Tensor) and t.dtype in LOW_FLOATS and type(t) in (torch.Tensor, nn.Parameter)


@dataclass
class Candidate:
    """One tensor that may lose its updates: ``kind`` param | buffer | optimizer_state."""

    name: str
    module: str
    kind: str
    tensor: torch.Tensor
    frozen: bool = False
    owner: str = ""              # the module to keep in float32 (a frozen copy's outermost module)
    measured_at: int = -1


def _module_of(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else ""


def _frozen_owner(name: str, training: set[str]) -> str:
    """The outermost module above parameter ``name`` that holds no trainable parameter (else its own module)."""
    parts = name.split(".")[:-1]
    for i in range(1, len(parts) + 1):
        prefix = ".".join(parts[:i])
        if prefix not in training:
            return prefix
    return _module_of(name)


def candidates(model: nn.Module, *, optimizer: torch.optim.Optimizer | None = None,
               mastered: Iterable[torch.Tensor] = (), names: dict[int, str] | None = None) -> list[Candidate]:
    """Every low-precision float parameter and buffer of ``model`` (less ``mastered``: parameters whose FP32 master
    holds the updates) and every low-precision state of ``optimizer`` (named ``<param>.<state key>`` through
    ``names``: id(optimizer parameter) -> model parameter name)."""
    skip = {id(t) for t in mastered}
    # A frozen copy (an EMA teacher) is named by its outermost module that trains nothing: "teacher", not
    # "teacher.0", is what to keep in float32.
    training = {".".join(n.split(".")[:i]) for n, p in model.named_parameters() if p.requires_grad
                for i in range(n.count(".") + 1)}
    out = [Candidate(n, _module_of(n), "param", p, frozen=not p.requires_grad,
                     owner=_frozen_owner(n, training) if not p.requires_grad else _module_of(n))
           for n, p in model.named_parameters() if id(p) not in skip and low_precision(p)]
    out += [Candidate(n, _module_of(n), "buffer", b) for n, b in model.named_buffers() if low_precision(b)]
    if optimizer is not None:
        known = names or {id(p): n for n, p in model.named_parameters()}
        for i, (p, state) in enumerate(optimizer.state.items()):
            pname = known.get(id(p), f"optimizer.param{i}")
            for key, value in state.items() if isinstance(state, dict) else ():
                if low_precision(value) and value.numel() > 1:
                    out.append(Candidate(f"{pname}.{key}", _module_of(pname), "optimizer_state", value))
    return out


@functools.lru_cache(maxsize=None)
def write_slots(func: Any) -> tuple[tuple[int, str, bool], ...]:
    """(position, name, keyword-only) of each argument ``func`` writes into."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return ()
    # native_batch_norm (and the cuDNN / MIOpen ones) update running_mean / running_var in training without saying
    # so in their schema.
    unmarked = "batch_norm" in schema.name
    return tuple((i, a.name, a.kwarg_only) for i, a in enumerate(schema.arguments)
                 if (a.alias_info is not None and a.alias_info.is_write)
                 or (unmarked and a.name in ("running_mean", "running_var")))


def written_tensors(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors an aten op ``func`` called with ``args`` / ``kwargs`` writes into (lists flattened)."""
    out: list[torch.Tensor] = []
    for i, name, kw_only in write_slots(func):
        value = kwargs.get(name) if kw_only or i >= len(args) else args[i]
        for t in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(t, torch.Tensor):
                out.append(t)
    return out


__all__ = ["LOW_FLOATS", "Candidate", "candidates", "low_precision", "write_slots", "written_tensors"]
