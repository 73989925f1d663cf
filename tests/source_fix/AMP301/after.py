"""A LayerNorm on the fp16 output of a Linear under CPU fp16 autocast: the kernel computes its statistics in fp32
(an info), fixed only when asked for by id (fix --select AMP301): the norm of the fp32 input, cast back."""
import torch, torch.nn as nn, torch.nn.functional as F

FIX = {"rule": "AMP301", "device": "cpu", "dtype": "float16", "calibrate": False, "unsafe": False}

class Block(nn.Module):
    def __init__(self, d=32):
        super().__init__(); self.fc = nn.Linear(d, d); self.norm = nn.LayerNorm(d)
    def forward(self, x):
        h = self.fc(x)
        return self.norm(h.float()).to(h.dtype) + x

def build_model():
    torch.manual_seed(0); return Block()

def example_inputs():
    torch.manual_seed(1); return (torch.randn(2, 8, 32),)
