"""Mixed-precision training: :class:`Trainer` (the loop), :class:`TrainConfig` (its settings) and
:class:`LossScaler` (the loss-scale policy).

    from ampaudit.train import Trainer, TrainConfig
    Trainer(model, loss_fn, train_data, dtype="float16", accum=4, clip_norm=1.0).fit(steps=100)
    Trainer(model, loss_fn, train_data, config=TrainConfig(dtype="float16", accum=4, clip_norm=1.0)).fit(steps=100)
"""
from ampaudit.train.config import TrainConfig
from ampaudit.train.scaler import LossScaler
from ampaudit.train.trainer import Trainer, TrainResult

__all__ = ["LossScaler", "TrainConfig", "TrainResult", "Trainer"]
