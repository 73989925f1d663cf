"""A contrastive head whose cosine similarity CPU autocast leaves in the low dtype: the kernel accumulates in fp32,
so this is an info, fixed only when asked for by id (fix --select AMP204): the similarity of fp32 inputs."""
import torch, torch.nn as nn, torch.nn.functional as F

FIX = {"rule": "AMP204", "device": "cpu", "dtype": "float16", "calibrate": False, "unsafe": False}

class Pair(nn.Module):
    def __init__(self, d=32):
        super().__init__(); self.a = nn.Linear(d, d); self.b = nn.Linear(d, d)
    def forward(self, x, y):
        return F.cosine_similarity(self.a(x), self.b(y), dim=-1)

def build_model():
    torch.manual_seed(0); return Pair()

def example_inputs():
    torch.manual_seed(1); return (torch.randn(4, 32), torch.randn(4, 32))
