"""Pure-bf16 fine-tuning: the model is cast to bf16 (``model.to(torch.bfloat16)``, as a "bf16-true" or
FSDP-without-master setup leaves it) and torch.optim.AdamW steps those bf16 weights directly: no FP32 master.
AdamW's update is computed in fp32 inside the step but written back into the bf16 weight, and at a fine-tuning
learning rate (2e-5) an update of ~lr is below half a bf16 ulp of every weight above ~0.005 in magnitude: round to
nearest puts most weights back where they were, every step. The loss stalls where the FP32-master run goes on.
Published: areal-project/AReaL#1292 (AdamW inherits bf16 from ``model.parameters()``, SFT loss plateaus ~3x higher;
fixed by #1369, fp32 master weights), NVIDIA-NeMo/Automodel#3444 ("directly updating BF16-resident parameters causes
many optimizer steps to round back to the same BF16 value"), workofart/ml-by-hand#85 (0 of 768 weights moved after
100 steps without a master). ``build_fixed_model`` is the published fix: weights (and so AdamW's states) in float32,
autocast computing in bf16.

Measured: 300 steps of ``train_data()`` with ``make_optimizer``, a plain loop, the forward under CPU bf16 autocast:
the loss goes 1.025 -> 1.022 and 6% of ``body.0.weight``'s elements ever move; ``build_fixed_model`` the same way:
1.025 -> 0.931, every element moved. ``ampaudit check tests/planted/pure_bf16_adamw.py --calibrate --device cpu
--dtype bfloat16 --train-steps 34``: 96% of ``body.0.weight``'s update rounded away at step 34 (AMP801).
``ampaudit train`` refuses the model at O1 (no FP32 master) and masters it at O2, which is the fix; the runtime
path is the user's own loop under ``ampaudit.watch`` (bench/both_paths.py, ``"fails_in": "user loop"``).
"""
import torch, torch.nn as nn, torch.nn.functional as F

EXPECT = {"culprit": "body", "families": [], "target": {"device": "cpu", "dtype": "bfloat16"},
          "phase": "training", "opt_level": "O1", "tensors": ["body.0.weight", "body.2.weight"],
          "fails_in": "user loop"}
D, LR = 64, 2e-5


class Regressor(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))

    def forward(self, x):
        return self.body(x.to(self.body[0].weight.dtype))


def build_model():
    torch.manual_seed(0); return Regressor().to(torch.bfloat16)

def build_fixed_model():
    torch.manual_seed(0); return Regressor()

def example_inputs():
    torch.manual_seed(1); return (torch.randn(128, D),)

def train_data():
    g = torch.Generator().manual_seed(2)
    teacher = torch.randn(D, D, generator=g) / D ** 0.5
    for _ in range(1000):
        x = torch.randn(128, D, generator=g); yield x, x @ teacher

def loss_fn(output, target):
    return F.mse_loss(output.float(), target)

def make_optimizer(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.0)
