"""Mixed-precision training: :class:`Trainer` (the loop), :class:`TrainConfig` (its settings) and
:class:`LossScaler` (the loss-scale policy).

    from ampaudit.train import Trainer, TrainConfig
    Trainer(model, loss_fn, train_data, dtype="float16", accum=4, clip_norm=1.0).fit(steps=100)
    Trainer(model, loss_fn, train_data, config=TrainConfig(dtype="float16", accum=4, clip_norm=1.0)).fit(steps=100)

Names are imported lazily: ``ampaudit.train.config`` (the settings, which ``ampaudit train`` reads before it
loads torch) costs no torch import.
"""
from __future__ import annotations

import importlib

_EXPORTS = {"TrainConfig": "ampaudit.train.config", "LossScaler": "ampaudit.train.scaler",
            "Trainer": "ampaudit.train.trainer", "TrainResult": "ampaudit.train.trainer"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ampaudit.train' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
