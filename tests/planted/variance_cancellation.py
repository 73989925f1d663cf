"""Hand-written layer norm that takes the variance as E[x^2] - E[x]^2: features sit at ~50 with spread ~1, so E[x^2]
~2500 is stored in bf16 as a multiple of 16 and the difference of two such values (true variance ~1) is rounding
noise; clamped to 0 it makes norm scale by 1/sqrt(eps) ~316. The output is finite and wrong. The one-pass formula's
cancellation: Project-MONAI/MONAI#1868 (negative variance under mixed precision), k2-fsa/sherpa-onnx#3857."""
import torch, torch.nn as nn, torch.nn.functional as F

EXPECT = {"culprit": "norm", "families": ["normalization", "divergence"],
          "target": {"device": "cpu", "dtype": "bfloat16"}, "phase": "forward"}

class OnePassNorm(nn.Module):
    def __init__(self, eps=1e-5):
        super().__init__(); self.eps = eps
    def forward(self, x):
        mean = x.mean(-1, keepdim=True)
        var = (x * x).mean(-1, keepdim=True) - mean * mean     # cancels: both terms ~2500, difference ~1
        return (x - mean) * torch.rsqrt(var.clamp_min(0.0) + self.eps)

class Net(nn.Module):
    def __init__(self):
        super().__init__(); self.inp = nn.Linear(8, 64); self.norm = OnePassNorm(); self.head = nn.Linear(64, 4)
        with torch.no_grad():
            self.inp.bias.fill_(50.0)   # an offset the features carry (un-centred sensor readings)
    def forward(self, x):
        return self.head(self.norm(self.inp(x)))

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
