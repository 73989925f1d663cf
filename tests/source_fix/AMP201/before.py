"""Attention whose softmax CPU fp16 autocast leaves in fp16: the kernel subtracts the row maximum and accumulates in
fp32, so this is an info (only the probabilities are stored in fp16), fixed only when asked for by id
(fix --select AMP201): softmax(..., dtype=torch.float32), cast back to the scores' dtype."""
import torch, torch.nn as nn, torch.nn.functional as F

FIX = {"rule": "AMP201", "device": "cpu", "dtype": "float16", "calibrate": False, "unsafe": False}

class Attention(nn.Module):
    def __init__(self, d=32):
        super().__init__(); self.qkv = nn.Linear(d, 3 * d); self.out = nn.Linear(d, d)
    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
        return self.out(F.softmax(scores, dim=-1) @ v)   # probabilities over the keys

def build_model():
    torch.manual_seed(0); return Attention()

def example_inputs():
    torch.manual_seed(1); return (torch.randn(2, 8, 32),)
