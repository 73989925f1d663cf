"""Mixed-precision training: :class:`Trainer` (the loop), :class:`TrainConfig` (its settings) and
:class:`LossScaler` (the loss-scale policy).

    from ampaudit.train import Trainer, TrainConfig
    Trainer(model, loss_fn, train_data, dtype="float16", accum=4, clip_norm=1.0).fit(steps=100)
    Trainer(model, loss_fn, train_data, config=TrainConfig(dtype="float16", accum=4, clip_norm=1.0)).fit(steps=100)

Names are imported lazily: ``ampaudit.train.config`` (the settings, which ``ampaudit train`` reads before it
loads torch) costs no torch import.
"""
from __future__ import annotations

from ampaudit.lazy_names import lazy_getattr

_EXPORTS = {"TrainConfig": "ampaudit.train.config", "LossScaler": "ampaudit.train.scaler",
            "Trainer": "ampaudit.train.trainer", "TrainResult": "ampaudit.train.trainer"}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_getattr(__name__, globals(), _EXPORTS)
