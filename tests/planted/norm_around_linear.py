"""A projection head that normalises its own Linear's output with a hand-written one-pass variance, in the composite's
forward: the projection carries an offset of ~50 (un-centred features), so E[h^2] ~2500 is stored in bf16 as a
multiple of 16 and E[h^2] - E[h]^2 (true variance ~1) is rounding noise; clamped at 0 it scales by up to 1/sqrt(eps).
Finite and wrong; the Linear itself is an ordinary GEMM. The one-pass formula's cancellation under mixed precision:
Project-MONAI/MONAI#1868 (negative variance), k2-fsa/sherpa-onnx#3857."""
import torch, torch.nn as nn, torch.nn.functional as F

EXPECT = {"culprit": "proj", "families": ["divergence"],
          "target": {"device": "cpu", "dtype": "bfloat16"}, "phase": "forward"}


class NormedProjection(nn.Module):
    def __init__(self, d_in=32, d_out=64, eps=1e-5):
        super().__init__(); self.linear = nn.Linear(d_in, d_out); self.eps = eps
        with torch.no_grad():
            self.linear.bias.fill_(50.0)   # the offset the projected features carry

    def forward(self, x):
        h = self.linear(x)
        mean = h.mean(-1, keepdim=True)
        var = (h * h).mean(-1, keepdim=True) - mean * mean    # cancels: both terms ~2500, difference ~1
        return (h - mean) * torch.rsqrt(var.clamp_min(0.0) + self.eps)


class Net(nn.Module):
    def __init__(self):
        super().__init__(); self.inp = nn.Linear(8, 32); self.proj = NormedProjection(); self.head = nn.Linear(64, 4)

    def forward(self, x):
        return self.head(self.proj(torch.relu(self.inp(x))))


def build_model():
    torch.manual_seed(0); return Net()

def example_inputs():
    torch.manual_seed(1); return (torch.randn(16, 8),)

def train_data():
    g = torch.Generator().manual_seed(2)
    for _ in range(100):
        x = torch.randn(16, 8, generator=g); yield x, x[:, :4]

def loss_fn(output, target):
    return F.mse_loss(output.float(), target)
