"""``ampaudit.watch`` inside the Hugging Face ``Trainer`` (needs the ``transformers`` extra).

    from ampaudit.integrations.transformers import AmpAuditCallback

    trainer = transformers.Trainer(model, args, train_dataset=ds,
                                   callbacks=[AmpAuditCallback("run.jsonl", every=50, divergence_every=500)])
    trainer.train()
    # then: ampaudit report run.jsonl

During ``train`` the callback watches the model: per-module statistics every ``every`` steps, the module, op and
source line where inf/NaN first appears, FP32 divergence every ``divergence_every`` steps, and a ``step`` event
per optimizer step (loss, loss scale, skipped, grad norm, lr, time). When the fp16 GradScaler skips a step
(the scale backs off), the ``skip`` event names the parameters and modules whose gradients were not
finite. The loss is read from the model's output (``output.loss``, as models given ``labels`` return it); a
custom ``compute_loss`` leaves it empty, and the grad norm is then taken after the Trainer's clipping. Only the
main process watches.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from ampaudit.integrations import callback_session, require

_transformers = require("transformers", extra="transformers", feature="ampaudit.integrations.transformers")
from transformers import TrainerCallback  # noqa: E402  (after the dependency check)

from ampaudit.runtime.session import SessionViews  # noqa: E402

if TYPE_CHECKING:
    from ampaudit.train.config import TrainConfig

__all__ = ["AmpAuditCallback", "args_dtype"]

def args_dtype(args: Any) -> torch.dtype:
    """The low dtype ``TrainingArguments`` train in: fp16, bf16, else float32."""
    if getattr(args, "fp16", False):
        return torch.float16
    if getattr(args, "bf16", False):
        return torch.bfloat16
    return torch.float32


def _output_loss(out: Any) -> Any:
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, dict):
        loss = out.get("loss")
    return loss if isinstance(loss, torch.Tensor) and loss.numel() == 1 else None


class AmpAuditCallback(SessionViews, TrainerCallback):
    """Runs :func:`ampaudit.watch` on the model during ``Trainer.train``; events go to ``trace`` (JSON Lines)
    or, when it is None, to :attr:`events`.

    ``every``: steps per statistics interval. ``divergence_every``: steps between
    FP32 shadow comparisons (None: off). ``raise_on_nonfinite``: stop training with NonFiniteError once an
    inf/NaN origin is written. ``dtype``: override the low dtype read from ``args.fp16``/``args.bf16``.
    ``grad_norm_every``: steps between gradient-norm measurements without a loss scaler (default ``every``;
    with the fp16 scaler, every step, so a skipped step can be attributed). ``tensorboard``: a folder to write
    the trace's scalars to when training ends.
    ``config``: a :class:`~ampaudit.train.config.TrainConfig` whose ``trace``, ``trace_every`` and
    ``divergence_every`` replace those arguments (its ``tensorboard`` too, when none is given).
    """

    def __init__(self, trace: str | os.PathLike | None = None, *, every: int = 50,
                 divergence_every: int | None = None, raise_on_nonfinite: bool = False, stats: bool = True,
                 dtype: torch.dtype | None = None, grad_norm_every: int | None = None, tensorboard: str | os.PathLike | None = None,
                 config: TrainConfig | None = None):
        self.session = callback_session(trace, config=config, every=every, divergence_every=divergence_every,
                                        raise_on_nonfinite=raise_on_nonfinite, stats=stats,
                                        grad_norm_every=grad_norm_every, tensorboard=tensorboard)
        self.dtype = dtype
        self._scale: float | None = None
        self._want_loss = False
        self._losses: list[torch.Tensor] = []
        self._partial = False
        self._measured = False
        self._handles: list[Any] = []
        self._patched_forward: Any = None
        self._amp: tuple[str, torch.dtype] | None = None
        self._amp_ctx: Any = None
        self._depth = 0
        self._model: nn.Module | None = None

    def _on_output(self, module: nn.Module, args: Any, kwargs: dict, out: Any) -> None:
        # Only the first training forward of each micro-batch: the divergence probe and the non-finite replay
        # run the model again, and evaluation runs it without gradients.
        if not (self._want_loss and module.training and torch.is_grad_enabled()):
            return
        self._want_loss = False
        loss = _output_loss(out)
        if loss is None:
            return
        self._losses.append(loss.detach())
        # Given num_items_in_batch, the model divides by the tokens of the whole accumulated batch: each
        # micro-batch's loss is then a share of the step's, to be added, not averaged.
        self._partial = self._partial or kwargs.get("num_items_in_batch") is not None
        if loss.requires_grad:
            loss.register_hook(self._on_loss_grad)

    def _on_loss_grad(self, grad: torch.Tensor) -> None:
        # The Trainer clips right after the last backward, before any callback: the gradients' own norms and
        # non-finite entries are taken when the backward finishes (the autograd engine's final callback).
        torch.autograd.Variable._execution_engine.queue_callback(self._after_backward)

    def _after_backward(self) -> None:
        if self._model is not None:
            self.session.before_optimizer_step(scaled=self._scale is not None, grad_scale=self._scale)
            self._measured = True

    # --- Trainer hooks -------------------------------------------------------------------------------
    def on_train_begin(self, args: Any, state: Any, control: Any, model: nn.Module | None = None,
                       optimizer: Any = None, **kwargs: Any) -> None:
        if model is None or not state.is_world_process_zero:
            return
        # A train() that raised never reached on_train_end: take its hooks off before adding new ones.
        self._detach()
        self._model = model
        self.session.start(model, dtype=self.dtype or args_dtype(args), integration="transformers",
                           max_grad_norm=args.max_grad_norm,
                           gradient_accumulation_steps=args.gradient_accumulation_steps)
        # prepend: before the watch's own end-of-forward hook, which may run the FP32 shadow forward.
        self._handles = [model.register_forward_hook(self._on_output, prepend=True, with_kwargs=True)]
        self._hoist_autocast(model, args)

    def _hoist_autocast(self, model: nn.Module, args: Any) -> None:
        """accelerate enters autocast inside ``model.forward`` (it replaces the method), where the watch cannot see
        it, and the FP32 shadow forward could not leave it. Enter the same autocast around the call instead:
        the original forward runs under a pre-hook/post-hook pair, outputs are still returned in fp32."""
        patched = model.__dict__.get("forward")
        original = getattr(model, "_original_forward", None)
        dtype = self.dtype or args_dtype(args)
        if patched is None or original is None or dtype == torch.float32:
            return
        first = next(iter(model.parameters()), None)
        self._amp = (first.device.type if first is not None else "cpu", dtype)
        self._patched_forward = patched
        model.forward = original
        # Entered before every other pre-hook (the watch's reads the autocast state), left after every hook.
        self._handles.append(model.register_forward_pre_hook(self._amp_enter, prepend=True))
        self._handles.append(model.register_forward_hook(self._amp_exit, always_call=True))

    def _amp_enter(self, module: nn.Module, args: Any) -> None:
        # Only the outermost call: the watch's FP32 shadow forward runs nested, under autocast(enabled=False).
        self._depth += 1
        watch = self.session.watch
        # The watch's own runs (the FP32 shadow at the end of a pass, a locator replay) choose their autocast.
        if self._depth == 1 and not (watch is not None and watch.replaying):
            ctx = torch.autocast(self._amp[0], dtype=self._amp[1])
            ctx.__enter__()
            self._amp_ctx = ctx

    def _amp_exit(self, module: nn.Module, args: Any, out: Any) -> Any:
        self._depth -= 1
        if self._depth == 0 and self._amp_ctx is not None:
            ctx, self._amp_ctx = self._amp_ctx, None
            ctx.__exit__(None, None, None)
            from accelerate.utils import convert_to_fp32
            return convert_to_fp32(out)
        return None

    def on_step_begin(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kwargs: Any) -> None:
        if not self.session.active:
            return
        scaler = getattr(optimizer, "scaler", None)
        self._scale = scaler.get_scale() if scaler is not None else None   # the scale this step's backward uses
        self.session.begin_step(state.global_step, self._scale)
        self._want_loss, self._losses, self._partial, self._measured = True, [], False, False

    def on_substep_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._want_loss = self.session.active

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.session.active and not self._measured and self._model is not None:
            # No loss in the model's output (a custom compute_loss): these gradients are already clipped.
            self.session.before_optimizer_step(scaled=self._scale is not None)

    def on_optimizer_step(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kwargs: Any) -> None:
        if not self.session.active:
            return
        scaler = getattr(optimizer, "scaler", None)
        after = scaler.get_scale() if scaler is not None else None
        # accelerate's step_was_skipped misses skips inside fused optimizers (the scaler hands them found_inf and
        # they return early): the scale backing off is the reliable sign.
        skipped = bool(getattr(optimizer, "step_was_skipped", False)) or (
            self._scale is not None and after is not None and after < self._scale)
        lr = optimizer.param_groups[0].get("lr") if optimizer is not None and optimizer.param_groups else None
        loss = None
        if self._losses:
            total = torch.stack(self._losses).float().sum()
            loss = total if self._partial else total / len(self._losses)
        self._losses = []
        limit = args.max_grad_norm or 0.0
        self.session.end_step(skipped=skipped, scale=self._scale, lr=lr, clipped_at=limit if limit > 0 else None,
                              loss=loss)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._detach()
        self.session.close()

    def _detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._patched_forward is not None and self._model is not None:
            self._model.forward = self._patched_forward
            self._patched_forward = None
