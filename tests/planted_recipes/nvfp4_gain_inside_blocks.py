"""A Linear whose input channels alternate between two norm gains 64x apart (every 16-channel block holds both), with
weight columns carrying the inverse gain, so both kinds of channel add comparable terms. NVFP4 scales 1x16 blocks
to e2m1, whose whole range is 0.5..6 (12x): inside each block the quiet channels of the input, and the quiet
columns of the weight, land under e2m1's half-way point to 0.5 and flush, taking about all of the output with them.
e4m3 (float8, MXFP8) spans 2^17 and keeps both. NVIDIA's NVFP4 pretraining keeps such layers in bf16 (a fixed 16%
there: first 2 and last 8 blocks), NVIDIA 2025, arXiv:2509.25149 (https://arxiv.org/abs/2509.25149); per-channel
gain spread from LayerNorm's gamma: Wei et al. 2022, arXiv:2209.13325."""
import torch, torch.nn as nn, torch.nn.functional as F

EXPECT = {"layer": "proj", "recipes": "nvfp4", "choice": "bfloat16", "gemms": None, "fails": ["nvfp4"],
          "others": ["head"]}

# What training must keep as planted (bench/fp8_plan_planted.py zeroes their gradients): Adam's ~lr steps would move
# the 1/64 gains by a fifth a step and undo the spread. Name -> index of the fixed entries (None: all).
FIXED = {"norm.weight": None, "proj.weight": None}

DIM, SEQ, OUT, SPREAD = 64, 64, 64, 64.0

def gains() -> torch.Tensor:
    return torch.tensor([1.0, 1.0 / SPREAD]).repeat(DIM // 2)

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.RMSNorm(DIM); self.proj = nn.Linear(DIM, OUT); self.head = nn.Linear(OUT, OUT)
    def forward(self, x):
        return self.head(F.gelu(self.proj(self.norm(x))))

def build_model():
    torch.manual_seed(0); model = Net()
    with torch.no_grad():
        model.norm.weight.copy_(gains())
        model.proj.weight.div_(gains())
    return model

def _batch(g):
    return torch.randn(2, SEQ, DIM, generator=g)

def example_inputs():
    return (_batch(torch.Generator().manual_seed(1)),)

def train_data():
    g = torch.Generator().manual_seed(2)
    for _ in range(4):
        x = _batch(g); yield x, torch.randn(2, SEQ, OUT, generator=g)

def loss_fn(output, target):
    return F.mse_loss(output.float(), target)
