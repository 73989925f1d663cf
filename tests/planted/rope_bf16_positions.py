"""Rotary embedding whose positions are built with `.type_as(x)`: under bf16 autocast x arrives in bf16 (from the q
projection), so positions past 256 are rounded to multiples of 2..16, the angles pos * inv_freq at position 4000 are
off by up to 8 radians, and rope's output is mostly wrong while staying finite. Reported as EleutherAI/gpt-neox#1003
and huggingface/transformers#29285 (RoPE loses precision in bf16)."""
import torch, torch.nn as nn, torch.nn.functional as F

EXPECT = {"culprit": "rope", "families": ["constant"], "target": {"device": "cpu", "dtype": "bfloat16"},
          "phase": "forward"}

class Rotary(nn.Module):
    def __init__(self, dim=32, base=100.0):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / base ** (torch.arange(0, dim, 2).float() / dim))
    def forward(self, x):
        t = torch.arange(x.shape[1], device=x.device).type_as(x)       # bf16 under autocast: 4001 is 4000
        freqs = t[:, None] * self.inv_freq[None, :]
        cos, sin = freqs.cos(), freqs.sin()
        x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1)

class Net(nn.Module):
    def __init__(self):
        super().__init__(); self.q = nn.Linear(8, 32); self.rope = Rotary(); self.out = nn.Linear(32, 4)
    def forward(self, x):
        return self.out(self.rope(self.q(x)))

def build_model():
    torch.manual_seed(0); return Net()

def example_inputs():
    torch.manual_seed(1); return (torch.randn(2, 4096, 8),)

def train_data():
    g = torch.Generator().manual_seed(2)
    for _ in range(100):
        x = torch.randn(2, 4096, 8, generator=g); yield x, x[..., :4]

def loss_fn(output, target):
    return F.mse_loss(output.float(), target)
