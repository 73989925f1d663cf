"""The learning rate against the effective batch: scaling rules and a linear warmup on top of any scheduler.

The effective batch of an optimizer step is micro-batch x accumulation x ranks. A learning rate tuned at batch
``base_batch`` is scaled to it once, before the scheduler is built (so the scheduler's base LRs are the scaled
ones): ``linear`` multiplies by ``effective / base_batch`` (Goyal et al. 2017, SGD), ``sqrt`` by its square root
(Adam-family optimizers, Hoffer et al. 2017). Warmup then ramps the LR linearly from 0: the optimizer step that
is the ``k``-th to update the weights runs at ``k / warmup_steps`` of the scheduled LR, up to ``warmup_steps``.

    policy = LRPolicy(warmup_steps=100, scale="sqrt", base_batch=256, accum=4, world_size=2)
    policy.scale_optimizer(optimizer, micro_batch=32)     # once, before make_scheduler(optimizer)
    policy.begin(optimizer, taken=steps_taken)            # at the boundary, before reading the step's LR
    stepped = scaler.step(optimizer)
    policy.end(optimizer)                                  # before scheduler.step()

Warmup multiplies the LR only for the optimizer step itself: :meth:`end` puts the scheduler's own value back, so
chainable schedulers (StepLR reads the group's current LR) never see the warmup factor, and the LR saved in a
checkpoint is the scheduler's. The warmup position is the number of steps the optimizer took (a step the loss
scaler skipped does not advance it, as it does not advance the scheduler), which the scaler's state restores on
resume: a resumed run continues the ramp where it stopped.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from ampaudit.errors import UsageError
from ampaudit.train.data import batch_size, first_batch_size  # noqa: F401  (batch_size: re-exported)

RULES = ("linear", "sqrt")


def lr_factor(rule: str, effective_batch: int, base_batch: int) -> float:
    """How much an LR tuned at ``base_batch`` grows at ``effective_batch``: the ratio (linear) or its root (sqrt)."""
    ratio = effective_batch / base_batch
    return ratio if rule == "linear" else math.sqrt(ratio)


def warmup_factor(taken: int, warmup_steps: int) -> float:
    """The share of the scheduled LR the next step runs at, after ``taken`` optimizer steps: linear from 0."""
    if warmup_steps <= 0 or taken >= warmup_steps:
        return 1.0
    return (taken + 1) / warmup_steps


class LRPolicy:
    """Scaling to the effective batch and linear warmup; see the module docstring. A no-op when both are off."""

    def __init__(self, *, warmup_steps: int | None = None, scale: str | None = None, base_batch: int | None = None,
                 accum: int = 1, world_size: int = 1):
        if warmup_steps is not None and warmup_steps < 0:
            raise UsageError(f"warmup_steps must be >= 0, got {warmup_steps}", hint="e.g. warmup_steps=100")
        if scale is not None and scale not in RULES:
            raise UsageError(f"unknown LR scaling rule {scale!r}: linear or sqrt", hint='e.g. scale_lr="sqrt"')
        if scale is not None and base_batch is None:
            raise UsageError(f"scaling the LR ({scale}) needs base_batch, the batch it was tuned at",
                             hint="add base_batch=B")
        if base_batch is not None and base_batch < 1:
            raise UsageError(f"base_batch must be >= 1, got {base_batch}", hint="e.g. base_batch=256")
        if base_batch is not None and scale is None:
            raise UsageError("base_batch without a scaling rule does nothing",
                             hint='add scale_lr="linear" or scale_lr="sqrt"')
        self.warmup_steps = warmup_steps or 0
        self.rule = scale
        self.base_batch = base_batch
        self.accum, self.world_size = accum, world_size
        self.micro_batch: int | None = None
        self.factor = 1.0
        self._scheduled: list[float] | None = None

    @property
    def active(self) -> bool:
        return self.rule is not None or self.warmup_steps > 0

    @property
    def effective_batch(self) -> int | None:
        return None if self.micro_batch is None else self.micro_batch * self.accum * self.world_size

    def scale_optimizer(self, optimizer: torch.optim.Optimizer, micro_batch: int | None) -> float:
        """Multiply every param group's LR by the rule's factor for this run's effective batch; return it."""
        if self.rule is None:
            return 1.0
        if micro_batch is None or micro_batch < 1:
            raise UsageError(f"micro_batch must be >= 1 to scale the LR, got {micro_batch}")
        self.micro_batch = micro_batch
        self.factor = lr_factor(self.rule, self.effective_batch, self.base_batch)
        for group in optimizer.param_groups:
            group["lr"] = group["lr"] * self.factor
            if "initial_lr" in group:          # a scheduler built already: keep its base consistent
                group["initial_lr"] = group["initial_lr"] * self.factor
        return self.factor

    def begin(self, optimizer: torch.optim.Optimizer, *, taken: int) -> None:
        """Before the optimizer step: run it at the warmup share of the scheduled LR (``taken``: steps done)."""
        factor = warmup_factor(taken, self.warmup_steps)
        if factor == 1.0:
            self._scheduled = None
            return
        self._scheduled = [group["lr"] for group in optimizer.param_groups]
        for group, lr in zip(optimizer.param_groups, self._scheduled):
            group["lr"] = lr * factor

    def end(self, optimizer: torch.optim.Optimizer) -> None:
        """After the optimizer step, before ``scheduler.step()``: the scheduler's own LR goes back."""
        if self._scheduled is not None:
            for group, lr in zip(optimizer.param_groups, self._scheduled):
                group["lr"] = lr
            self._scheduled = None

    @classmethod
    def build(cls, optimizer: torch.optim.Optimizer, factory: Any, *, micro_batch: int | None = None,
              **options: Any) -> "LRPolicy":
        """The policy for a trainer (``options``: warmup_steps, scale, base_batch, accum, world_size), with the
        optimizer's LRs already scaled; the micro-batch is read from the data when scaling needs it and
        ``micro_batch`` is not given."""
        policy = cls(**options)
        if policy.rule is not None:
            policy.scale_optimizer(optimizer, micro_batch if micro_batch is not None else first_batch_size(factory))
        return policy

    def describe(self) -> dict[str, Any]:
        """The policy for the trace's ``meta`` line."""
        return {"warmup_steps": self.warmup_steps, "scale": self.rule, "base_batch": self.base_batch,
                "micro_batch": self.micro_batch, "effective_batch": self.effective_batch, "factor": self.factor}


__all__ = ["LRPolicy", "RULES", "batch_size", "first_batch_size", "lr_factor", "warmup_factor"]
