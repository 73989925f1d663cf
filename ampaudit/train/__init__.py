"""Mixed-precision training: :class:`Trainer` (the loop) and :class:`LossScaler` (the loss-scale policy).

    from ampaudit.train import Trainer
    Trainer(model, loss_fn, train_data, dtype="float16", accum=4, clip_norm=1.0).fit(steps=100)
"""
from ampaudit.train.scaler import LossScaler
from ampaudit.train.trainer import Trainer, TrainResult

__all__ = ["LossScaler", "TrainResult", "Trainer"]
