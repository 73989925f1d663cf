"""Sinusoidal position encoding over 6000 steps whose positions come from torch.arange(n, dtype=x.dtype): in fp16
integers past 2048 are rounded to even (then multiples of 4), so the angles of the fast frequencies are off by up to
2 radians in the second half of the sequence and pos adds a wrong encoding (finite, silently). The fp32 positions
and frequencies of the original Transformer encoding avoid it (fairseq and tensor2tensor build them in fp32)."""
import math, torch, torch.nn as nn, torch.nn.functional as F

FIX = {"rule": "AMP404", "device": "cpu", "dtype": "float16", "calibrate": False, "unsafe": False}

EXPECT = {"culprit": "pos", "families": ["constant"], "target": {"device": "cpu", "dtype": "float16"},
          "phase": "forward"}

class SinusoidalPositions(nn.Module):
    def __init__(self, dim=32, base=10000.0):
        super().__init__()
        self.register_buffer("inv_freq", torch.exp(-math.log(base) * torch.arange(0, dim, 2).float() / dim))
    def forward(self, x):
        pos = torch.arange(x.shape[1], device=x.device, dtype=torch.float32)     # fp16 under autocast: 4097 is 4096
        angles = pos[:, None] * self.inv_freq[None, :]
        return x + torch.cat([angles.sin(), angles.cos()], -1)

class Net(nn.Module):
    def __init__(self):
        super().__init__(); self.embed = nn.Linear(8, 32); self.pos = SinusoidalPositions(); self.out = nn.Linear(32, 4)
    def forward(self, x):
        return self.out(self.pos(self.embed(x) * 0.1))

def build_model():
    torch.manual_seed(0); return Net()

def example_inputs():
    torch.manual_seed(1); return (torch.randn(2, 6000, 8),)

def train_data():
    g = torch.Generator().manual_seed(2)
    for _ in range(100):
        x = torch.randn(2, 6000, 8, generator=g); yield x, x[..., :4]

def loss_fn(output, target):
    return F.mse_loss(output.float(), target)
