"""Contrastive embedding head that L2-normalizes with F.normalize's default eps=1e-12: on CPU fp16 autocast the norm
and its clamp_min run in fp16, where 1e-12 is 0, so the padded (all-zero) rows give 0/0 = NaN in head, and the loss is
NaN. pytorch/pytorch#32137 (normalize epsilon too small for half precision) and #61954; diffusers#13316."""
import torch, torch.nn as nn, torch.nn.functional as F

FIX = {"rule": "AMP402", "device": "cpu", "dtype": "float16", "calibrate": False, "unsafe": False}

EXPECT = {"culprit": "head", "families": ["constant", "nonfinite"], "target": {"device": "cpu", "dtype": "float16"},
          "phase": "forward"}

class NormalizedHead(nn.Module):
    def __init__(self, d=32, k=16):
        super().__init__(); self.proj = nn.Linear(d, k, bias=False)
    def forward(self, h, keep):
        z = self.proj(h).masked_fill(~keep[..., None], 0.0)           # padded rows are exactly zero
        return F.normalize(z.float(), dim=-1).to(z.dtype)

class Net(nn.Module):
    def __init__(self):
        super().__init__(); self.enc = nn.Linear(8, 32); self.head = NormalizedHead()
    def forward(self, x, keep):
        return self.head(torch.tanh(self.enc(x)), keep)

def build_model():
    torch.manual_seed(0); return Net()

def _mask():
    keep = torch.ones(4, 12, dtype=torch.bool); keep[:, 9:] = False    # the last 3 positions are padding
    return keep

def example_inputs():
    torch.manual_seed(1); return (torch.randn(4, 12, 8), _mask())

def train_data():
    g = torch.Generator().manual_seed(2)
    for _ in range(100):
        x = torch.randn(4, 12, 8, generator=g); yield (x, _mask()), torch.zeros(4, 12, 16)

def loss_fn(output, target):
    return F.mse_loss(output.float(), target)
