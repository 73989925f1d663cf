"""A Linear reading a normalised stream whose norm gain (gamma) differs by orders of magnitude between groups of
channels, 32 channels to a group, and whose weight columns carry the inverse gain (the next layer has learned to
undo it, so every group adds an ordinary-sized term to the output). Inside a group the values are alike; across
groups they span 2^-12..2^12. One scale per token row (float8 rowwise) or per tensor (tensorwise) is set by the
largest group: the small groups land under e4m3's smallest subnormal and flush, and with them their share of the
output. MXFP8's 1x32 blocks along the reduction dim each hold one group and keep it at e4m3's full precision.
Per-channel outliers that LayerNorm's gamma creates and amplifies: Wei et al. 2022, "Outlier Suppression", arXiv:
2209.13325 (https://arxiv.org/abs/2209.13325); per-block scaling as the cure: OCP Microscaling Formats (MX) v1.0,
and Rouhani et al. 2023, "Microscaling Data Formats for Deep Learning", arXiv:2310.10537."""
import torch, torch.nn as nn, torch.nn.functional as F

EXPECT = {"layer": "proj", "recipes": "tensorwise,rowwise,mxfp8", "choice": "mxfp8", "gemms": None,
          "fails": ["float8_tensorwise", "float8_rowwise"], "others": ["head"]}

# What training must keep as planted (bench/fp8_plan_planted.py zeroes their gradients): Adam moves every weight by
# about lr a step, which undoes the inverse gain's 2^-12 weights at once. Name -> index of the fixed entries (None: all).
FIXED = {"norm.weight": None, "proj.weight": None}

DIM, SEQ, OUT, GROUP = 256, 64, 64, 32
EXPONENTS = torch.tensor([-12.0, 12.0, -8.0, 8.0, -4.0, 4.0, 0.0, -10.0])     # one per 32-channel group

def gains() -> torch.Tensor:
    return (2.0 ** EXPONENTS).repeat_interleave(GROUP)

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
        model.proj.weight.div_(gains())           # the inverse gain: each group's term is ordinary-sized
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
