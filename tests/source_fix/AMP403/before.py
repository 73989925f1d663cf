"""F.normalize with eps=1e-6 on fp16 input (CPU fp16 autocast leaves it there): 1e-6 is subnormal in fp16 (smallest
normal 6.1e-5) and keeps few significant bits. An info, fixed only when asked for by id (fix --select AMP403):
normalize the fp32 input and cast back."""
import torch, torch.nn as nn, torch.nn.functional as F

FIX = {"rule": "AMP403", "device": "cpu", "dtype": "float16", "calibrate": False, "unsafe": False}

class Embed(nn.Module):
    def __init__(self, d=32):
        super().__init__(); self.proj = nn.Linear(d, d)
    def forward(self, x):
        return F.normalize(self.proj(x), dim=-1, eps=1e-6)   # unit vectors for a cosine retrieval

def build_model():
    torch.manual_seed(0); return Embed()

def example_inputs():
    torch.manual_seed(1); return (torch.randn(4, 32),)
