"""The healthy twin of ema_teacher_bf16.py: the same momentum teacher, kept in float32 after the O2 cast (the fix
the reports converge on: an EMA copy needs no low-precision storage), so every update is kept and nothing is
reported. `fp32_teacher()` is the call a training script makes after casting the model."""
import importlib.util
from pathlib import Path

import torch

# The sibling file by path: model files are loaded by path, not from an importable package.
_spec = importlib.util.spec_from_file_location("_ema_teacher_bf16", Path(__file__).with_name("ema_teacher_bf16.py"))
_bf16 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_bf16)
SelfDistill, example_inputs, loss_fn = _bf16.SelfDistill, _bf16.example_inputs, _bf16.loss_fn
make_optimizer, train_data = _bf16.make_optimizer, _bf16.train_data

EXPECT = {"culprit": None, "families": [], "target": {"device": "cpu", "dtype": "bfloat16"},
          "phase": "training", "opt_level": "O2", "tensors": []}


class FP32Teacher(SelfDistill):
    """``model.to(bf16)`` casts every submodule; ``_apply`` puts the teacher back in float32 afterwards."""

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self.teacher.float()
        return self

    def forward(self, x):
        if self.training:
            self.update_teacher()
        online = self.predictor(self.student(x))
        with torch.no_grad():
            target = self.teacher(x.float())
        return torch.stack([online, target.to(online.dtype)])

    @torch.no_grad()
    def update_teacher(self):
        for t, s in zip(self.teacher.parameters(), self.student.parameters()):
            t.mul_(self.momentum).add_(s.detach().float(), alpha=1 - self.momentum)


def build_model():
    torch.manual_seed(0); return FP32Teacher()
