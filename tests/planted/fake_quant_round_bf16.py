"""Activation fake quantization (int8, symmetric, per tensor: QAT / W8A8 simulation) written as
``round(x * scale).clamp(-127, 127) / scale`` on the activation as it arrives: under autocast that is the bf16 output
of a Linear, so ``x * scale`` is computed in bf16, whose steps are 0.25 between 32 and 64 and 0.5 between 64 and
128: the integer level is decided on a value already rounded by up to a quarter level, and a large share of the
levels are not FP32's. The dequantized output stays within a few percent in relative L2, so no error metric shows
it. Quantization kept in float32 under bf16 training: lucidrains/vector-quantize-pytorch#100 ("do the quantization
in float32"); torchao's fake quantizers compute scales and rounding in fp32 for the same reason."""
import torch, torch.nn as nn, torch.nn.functional as F

EXPECT = {"culprit": "quant", "families": ["divergence"],
          "target": {"device": "cpu", "dtype": "bfloat16"}, "phase": "forward",
          "decisions": {"op": "round", "min_share": 0.03}}

class FakeQuant(nn.Module):
    def forward(self, x):
        scale = 127.0 / x.detach().abs().amax().clamp_min(1e-8)
        q = torch.round(x * scale).clamp(-127, 127)            # x * scale in x's dtype: bf16 under autocast
        return x + (q / scale - x).detach()                   # straight-through estimator

class Net(nn.Module):
    def __init__(self):
        super().__init__(); self.fc1 = nn.Linear(32, 128); self.quant = FakeQuant(); self.fc2 = nn.Linear(128, 8)
    def forward(self, x):
        return self.fc2(self.quant(F.relu(self.fc1(x))))

def build_model():
    torch.manual_seed(0); return Net()

def example_inputs():
    torch.manual_seed(1); return (torch.randn(64, 32),)

def train_data():
    g = torch.Generator().manual_seed(2)
    for _ in range(100):
        x = torch.randn(64, 32, generator=g); yield x, x[:, :8]

def loss_fn(output, target):
    return F.mse_loss(output.float(), target)
