"""Llama-style rotary angles computed as inv_freq @ positions.float(): autocast lowers the matmul to bf16, so both the
positions (past 256) and the frequencies are rounded before the angles are formed, and at position 3000 the angles
are off by radians. transformers computes this product under torch.autocast(enabled=False) for that reason
(huggingface/transformers#29285, "RoPE loses precision for Llama / Gemma")."""
import torch, torch.nn as nn, torch.nn.functional as F

FIX = {"rule": "AMP701", "device": "cpu", "dtype": "bfloat16", "calibrate": True, "unsafe": False}

EXPECT = {"culprit": "rotary", "families": ["constant"], "target": {"device": "cpu", "dtype": "bfloat16"},
          "phase": "forward"}

class LlamaRotary(nn.Module):
    def __init__(self, dim=32, base=100.0):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / base ** (torch.arange(0, dim, 2).float() / dim))
    def forward(self, x):
        position_ids = torch.arange(x.shape[1], device=x.device)[None, :]
        freqs = (self.inv_freq[None, :, None] @ position_ids[:, None, :].float()).transpose(1, 2)   # bf16 matmul
        emb = torch.cat([freqs, freqs], -1)
        return emb.cos(), emb.sin()

def rotate_half(x):
    x1, x2 = x.chunk(2, -1)
    return torch.cat([-x2, x1], -1)

class Net(nn.Module):
    def __init__(self):
        super().__init__(); self.q = nn.Linear(8, 32); self.rotary = LlamaRotary(); self.out = nn.Linear(32, 4)
    def forward(self, x):
        q = self.q(x)
        cos, sin = self.rotary(q)
        return self.out(q * cos + rotate_half(q) * sin)

def build_model():
    torch.manual_seed(0); return Net()

def example_inputs():
    torch.manual_seed(1); return (torch.randn(2, 3072, 8),)

def train_data():
    g = torch.Generator().manual_seed(2)
    for _ in range(100):
        x = torch.randn(2, 3072, 8, generator=g); yield x, x[..., :4]

def loss_fn(output, target):
    return F.mse_loss(output.float(), target)
