"""``check --calibrate --train-steps N`` on a model that stores trainable fp16/bf16 weights at O1 (a model cast
with ``model.to(torch.bfloat16)``, "pure bf16" training): the built-in Trainer refuses it (no FP32 master: see
:func:`~ampaudit.train.masters.refuse_low_precision_weights`), but the user's own loop would step those weights
directly, and that is what the check must measure. A copy trains N steps as such a loop does: the file's optimizer
(default AdamW, as the Trainer's) on the stored weights, the forward under the target's autocast, no loss scaler,
a :class:`~ampaudit.runtime.session.WatchSession` in memory sampling every step (the swamping meter sees the
weights, and the optimizer's states, that no master covers).

    if masters.o2_mastered(model):      # trainable fp16/bf16 weights: what O2 would master, O1 refuses
        events, note = user_loop_events(model, policy, train_data, loss_fn, hooks, steps=34)
"""
from __future__ import annotations

import copy
import itertools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from ampaudit.dtypes import name_of
from ampaudit.policy import Policy
from ampaudit.runtime.replay_state import rng_snapshot
from ampaudit.simulate import target_autocast
from ampaudit.train.data import split_batch
from ampaudit.train.setup import build_optimizer


def user_loop_events(model: nn.Module, policy: Policy, train_data: Callable, loss_fn: Callable, hooks: Any, *,
                     steps: int, device_type: str) -> tuple[list[dict], int]:
    """``(events, steps run)``: ``steps`` steps of a plain loop on a copy of ``model`` as it is stored (``hooks``:
    a :class:`~ampaudit.train.probe.TrainHooks`, its optimizer factory, scheduler and lr), every step sampled."""
    from ampaudit.runtime.session import WatchSession

    twin, restore_rng = copy.deepcopy(model), rng_snapshot()
    twin.train()
    params = [p for p in twin.parameters() if p.requires_grad]
    session = WatchSession(every=1, memory=True)
    done = 0
    try:
        opt = build_optimizer(hooks.optimizer, params, hooks.lr, masters=False)
        sched = hooks.scheduler(opt) if hooks.scheduler is not None else None
        session.start(twin, dtype=policy.low, source="check", meta={"target": "check --calibrate --train-steps",
                                                                   "dtype": name_of(policy.low), "loop": "user"})
        session.measure_updates(optimizer=opt, names={id(p): n for n, p in twin.named_parameters()})
        for step, batch in enumerate(itertools.islice(train_data(), steps), 1):
            args, kwargs, target = split_batch(batch, torch.device(device_type))    # as the Trainer reads it
            session.begin_step(step)
            with torch.autocast(device_type, dtype=policy.low), target_autocast(policy, device_type,
                                                                                 enter_autocast=False):
                out = twin(*args, **kwargs)
            loss = loss_fn(out, target)
            loss.backward()
            session.before_optimizer_step()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if sched is not None:
                sched.step()
            session.end_step(skipped=False, scale=None, lr=opt.param_groups[0]["lr"], loss=loss)
            done = step
        session.close_watch()
        events = list(session.events)
    finally:
        session.close()
        restore_rng()
    return events, done


__all__ = ["user_loop_events"]
