"""Opt levels and FP32 master weights.

O1 keeps the model in fp32 and lets autocast pick each op's dtype. O2 casts the model's weights to fp16/bf16
(BatchNorm stays fp32: its running variance can pass 65504) and trains FP32 *master* copies: the optimizer steps
on the masters and the result is copied back into the low-precision model. Stepping fp16 weights directly loses
every update smaller than half an fp16 ulp and cannot be unscaled, so the trainer refuses it.

    model = cast_model_o2(model, torch.float16)
    masters = MasterWeights(model)
    optimizer = torch.optim.AdamW(masters.parameters())
    ...backward...
    masters.grads_to_masters()       # fp32 gradients on the masters; the fp16 ones are freed
    optimizer.step()
    masters.copy_to_model()
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ampaudit.dtypes import HALF
from ampaudit.errors import TrainError, UsageError

OPT_LEVELS = ("O1", "O2")
LOW_PRECISION = HALF


def check_opt_level(opt_level: str) -> str:
    """Normalise ``opt_level`` ("o2" -> "O2") or raise a UsageError naming the choices."""
    level = str(opt_level).upper()
    if level not in OPT_LEVELS:
        raise UsageError(f"unknown opt level {opt_level!r}", hint="use O1 (fp32 weights + autocast) or O2 "
                         "(fp16/bf16 weights + FP32 master weights)")
    return level


def refuse_low_precision_weights(model: nn.Module) -> None:
    """Raise when an O1 model already holds fp16/bf16 parameters: they would train without FP32 masters."""
    for name, p in model.named_parameters():
        if p.requires_grad and p.dtype in LOW_PRECISION:
            raise TrainError(f"parameter {name!r} is {str(p.dtype).replace('torch.', '')} and opt level O1 has no "
                             "FP32 master weights: updates would round away and fp16 gradients cannot be unscaled",
                             hint='use opt_level="O2" (FP32 masters) or load the model in float32 for O1')


def cast_model_o2(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Cast ``model`` to ``dtype`` in place, keeping every BatchNorm (weights and running stats) in fp32."""
    model.to(dtype)
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            # CPU and cuDNN batch_norm accept low-precision input with fp32 weights and statistics.
            module.float()
    return model


def o2_mastered(model: nn.Module) -> list[nn.Parameter]:
    """The parameters :class:`MasterWeights` gives an FP32 master: the trainable ones stored in fp16/bf16 (its
    ``mastered``), without making the copies."""
    return [p for p in model.parameters() if p.requires_grad and p.dtype in LOW_PRECISION]


class MasterWeights:
    """FP32 copies of a model's trainable parameters, in ``model.parameters()`` order.

    Parameters that are already fp32 (BatchNorm under O2) are their own master: no copy is made.
    """

    def __init__(self, model: nn.Module):
        self.names: list[str] = []
        self.model_params: list[nn.Parameter] = []
        self.masters: list[torch.Tensor] = []
        for name, p in model.named_parameters():
            if not p.requires_grad:
                continue
            if p.dtype == torch.float32:
                master = p
            elif p.dtype in LOW_PRECISION:
                master = nn.Parameter(p.detach().float().clone())
            else:
                raise TrainError(f"parameter {name!r} has dtype {p.dtype}; O2 trains float parameters only",
                                 hint="freeze it (requires_grad=False) or keep it out of the model")
            self.names.append(name)
            self.model_params.append(p)
            self.masters.append(master)
        self._pairs = [(p, m) for p, m in zip(self.model_params, self.masters) if p is not m]

    @property
    def mastered(self) -> list[nn.Parameter]:
        """The model's low-precision parameters that have an FP32 master (their rounding loses no update)."""
        return [p for p, _ in self._pairs]

    def parameters(self) -> list[torch.Tensor]:
        """The master parameters, for the optimizer."""
        return list(self.masters)

    def named_parameters(self) -> list[tuple[str, torch.Tensor]]:
        """``(model parameter name, master)`` pairs."""
        return list(zip(self.names, self.masters))

    def grads_to_masters(self) -> None:
        """Move the model's gradients onto the masters as fp32, freeing the low-precision ones."""
        for p, m in self._pairs:
            m.grad = None if p.grad is None else p.grad.float()
            p.grad = None

    @torch.no_grad()
    def copy_to_model(self) -> None:
        """Round the stepped masters into the model's low-precision weights."""
        if self._pairs:
            torch._foreach_copy_([p for p, _ in self._pairs], [m for _, m in self._pairs])

    def state_dict(self) -> list[torch.Tensor]:
        """The master values, in order (the model's own state_dict holds only their rounded copies)."""
        return [m.detach().clone() for m in self.masters]

    @torch.no_grad()
    def load_state_dict(self, state: list[torch.Tensor]) -> None:
        """Restore master values saved by :meth:`state_dict` and round them into the model."""
        if len(state) != len(self.masters):
            raise TrainError(f"checkpoint holds {len(state)} master weights, the model has {len(self.masters)}",
                             hint="resume with the same model file")
        for m, saved in zip(self.masters, state):
            m.copy_(saved)
        self.copy_to_model()
