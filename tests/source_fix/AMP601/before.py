"""Attention that scales the scores after the matmul: q @ k^T over head_dim 128 of activations ~25 reaches ~8e4, past
fp16's 65504, before the 1/sqrt(d) scale brings it back to ~7e3; the stored product is inf and softmax gives NaN in
attn. Stability-AI/stablediffusion#89 (cast q and k to fp32 to avoid the overflow; diffusers' upcast_attention) and
ultralytics/ultralytics#24990 (pre-scale the query)."""
import torch, torch.nn as nn, torch.nn.functional as F

FIX = {"rule": "AMP601", "device": "cpu", "dtype": "float16", "calibrate": True, "unsafe": False}

EXPECT = {"culprit": "attn", "families": ["nonfinite"], "target": {"device": "cpu", "dtype": "float16"},
          "phase": "forward"}

class Attention(nn.Module):
    def __init__(self, d=128):
        super().__init__(); self.qkv = nn.Linear(d, 3 * d); self.out = nn.Linear(d, d)
    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        scores = (q @ k.transpose(-2, -1)) / q.shape[-1] ** 0.5     # the product overflows before the scale
        return self.out(F.softmax(scores, -1) @ v)

class Net(nn.Module):
    def __init__(self):
        super().__init__(); self.inp = nn.Linear(16, 128); self.attn = Attention(); self.head = nn.Linear(128, 2)
        with torch.no_grad():   # q = k: activations that line up, as trained attention heads' often do
            w, b = self.attn.qkv.weight, self.attn.qkv.bias
            w[128:256].copy_(w[:128]); b[128:256].copy_(b[:128]); w[:256].mul_(80.0)
    def forward(self, x):
        return self.head(self.attn(self.inp(x)).mean(1))

def build_model():
    torch.manual_seed(0); return Net()

def example_inputs():
    torch.manual_seed(1); return (torch.randn(2, 16, 16),)

def train_data():
    g = torch.Generator().manual_seed(2)
    for _ in range(100):
        x = torch.randn(2, 16, 16, generator=g); yield x, (x.sum((1, 2)) > 0).long()

def loss_fn(output, target):
    return F.cross_entropy(output.float(), target)
