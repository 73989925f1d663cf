"""``ampaudit.watch`` inside Lightning's ``fit`` (needs the ``lightning`` extra).

    from ampaudit.integrations.lightning import AmpAuditCallback

    trainer = lightning.Trainer(precision="16-mixed", callbacks=[AmpAuditCallback("run.jsonl", every=50,
                                                                                  divergence_every=500)])
    trainer.fit(model, loader)
    # then: ampaudit report run.jsonl

During ``fit`` the callback watches the LightningModule: per-module statistics every ``every`` steps, the module,
op and source line where inf/NaN first appears, FP32 divergence every ``divergence_every`` steps, and a ``step``
event per optimizer step (loss, loss scale, skipped, grad norm, lr, time). When Lightning's own GradScaler
(precision "16-mixed") skips a step, the ``skip`` event names the parameters and modules whose gradients were
not finite. Micro-batches of gradient accumulation share their optimizer step's number. Only global rank 0
watches (one trace per run). Validation forwards inside ``fit`` are seen by the hooks too.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch

from ampaudit.integrations import callback_session, require

_pl = None
for _name in ("lightning.pytorch", "pytorch_lightning"):
    try:
        _pl = __import__(_name, fromlist=["Callback"])
        break
    except ImportError:
        continue
if _pl is None:
    require("lightning.pytorch", extra="lightning", feature="ampaudit.integrations.lightning")

from ampaudit.runtime.session import SessionViews  # noqa: E402  (after the dependency check)

if TYPE_CHECKING:
    from ampaudit.train.config import TrainConfig

__all__ = ["AmpAuditCallback", "precision_dtype"]

# Lightning precision flag -> the low dtype autocast (or the weights) use.
PRECISION_DTYPES = {"16-mixed": torch.float16, "16": torch.float16, "16-true": torch.float16,
                    "bf16-mixed": torch.bfloat16, "bf16": torch.bfloat16, "bf16-true": torch.bfloat16}


def precision_dtype(precision: Any) -> torch.dtype:
    """The dtype a Lightning ``precision`` setting computes in (float32 for 32/64-bit and unknown plugins)."""
    return PRECISION_DTYPES.get(str(precision), torch.float32)


def _scaler(trainer: Any) -> Any:
    plugin = getattr(trainer, "precision_plugin", None)
    scaler = getattr(plugin, "scaler", None)
    return scaler if scaler is not None and hasattr(scaler, "get_scale") else None


def _clip_norm(trainer: Any) -> float | None:
    """The norm Lightning clips gradients to, or None (no clipping, or clipping by value)."""
    clip = trainer.gradient_clip_val
    algorithm = getattr(trainer.gradient_clip_algorithm, "value", trainer.gradient_clip_algorithm) or "norm"
    return float(clip) if clip and algorithm == "norm" else None


def _loss(outputs: Any) -> Any:
    if isinstance(outputs, torch.Tensor):
        return outputs
    if isinstance(outputs, dict):
        return outputs.get("loss")
    return None


class AmpAuditCallback(SessionViews, _pl.Callback):
    """Runs :func:`ampaudit.watch` on the LightningModule during ``fit``; events go to ``trace`` (JSON Lines)
    or, when it is None, to :attr:`events`.

    ``every``: steps per statistics interval. ``divergence_every``: steps between
    FP32 shadow comparisons (None: off). ``raise_on_nonfinite``: stop ``fit`` with NonFiniteError once an inf/NaN
    origin is written. ``dtype``: override the low dtype read from ``trainer.precision``. ``grad_norm_every``:
    steps between gradient-norm measurements without a loss scaler (default ``every``; with Lightning's fp16
    scaler, every step, so a skipped step can be attributed). ``tensorboard``: a folder to write the trace's
    scalars to when ``fit`` ends.
    ``config``: a :class:`~ampaudit.train.config.TrainConfig` whose ``trace``, ``trace_every`` and
    ``divergence_every`` replace those arguments (its ``tensorboard`` too, when none is given).
    """

    def __init__(self, trace: str | os.PathLike | None = None, *, every: int = 50,
                 divergence_every: int | None = None, raise_on_nonfinite: bool = False, stats: bool = True,
                 dtype: torch.dtype | None = None, grad_norm_every: int | None = None, tensorboard: str | os.PathLike | None = None,
                 config: TrainConfig | None = None):
        super().__init__()
        self.session = callback_session(trace, config=config, every=every, divergence_every=divergence_every,
                                        raise_on_nonfinite=raise_on_nonfinite, stats=stats,
                                        grad_norm_every=grad_norm_every, tensorboard=tensorboard)
        self.dtype = dtype
        self._scale: float | None = None       # the loss scale the current step runs with
        self._stepped = False

    # --- Lightning hooks -----------------------------------------------------------------------------
    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        if trainer.global_rank != 0:
            return
        dtype = self.dtype or precision_dtype(trainer.precision)
        self.session.start(pl_module, dtype=dtype, integration="lightning", precision=str(trainer.precision))
        scaler = _scaler(trainer)
        self._scale = scaler.get_scale() if scaler is not None else None

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.session.begin_step(trainer.global_step, self._scale)    # the scale this step's backward carries

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        # Lightning calls this after unscaling and before clipping: the gradients as the backward left them.
        if self.session.active:
            self.session.before_optimizer_step(scaled=self._scale is not None)
            self._stepped = True

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not self.session.active:
            return
        self.session.add_loss(_loss(outputs))
        if not self._stepped:          # a micro-batch of an accumulation window
            return
        self._stepped = False
        scaler = _scaler(trainer)
        before, after = self._scale, (scaler.get_scale() if scaler is not None else None)
        # GradScaler backs the scale off exactly when it skipped the optimizer step.
        skipped = before is not None and after is not None and after < before
        self._scale = after
        optimizers = trainer.optimizers
        lr = optimizers[0].param_groups[0].get("lr") if optimizers else None
        self.session.end_step(skipped=skipped, scale=before, lr=lr, clipped_at=_clip_norm(trainer))

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        self.session.close()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self.session.close()    # the hooks must not outlive a failed fit
