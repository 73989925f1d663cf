"""masked_fill(-1e9) on fp16 scores: the constant does not fit in fp16, so attn raises under fp16 autocast."""
import torch, torch.nn as nn, torch.nn.functional as F

FIX = {"rule": "AMP401", "device": "cuda", "dtype": "float16", "calibrate": False, "unsafe": False}

EXPECT = {"culprit": "attn", "families": ["constant"], "raises": "RuntimeError"}

class MaskedAttention(nn.Module):
    def __init__(self, d=32):
        super().__init__(); self.qkv = nn.Linear(d, 3 * d); self.out = nn.Linear(d, d)
    def forward(self, x, mask):
        q, k, v = self.qkv(x).chunk(3, -1)
        scores = (q @ k.transpose(-2, -1)) / q.shape[-1] ** 0.5
        scores = scores.masked_fill(~mask, -1e9)
        return self.out(F.softmax(scores, -1) @ v)

class Net(nn.Module):
    def __init__(self):
        super().__init__(); self.inp = nn.Linear(8, 32); self.attn = MaskedAttention(); self.head = nn.Linear(32, 2)
    def forward(self, x, mask):
        return self.head(self.attn(self.inp(x), mask).mean(1))

def build_model():
    torch.manual_seed(0); return Net()

def example_inputs():
    torch.manual_seed(1)
    mask = torch.ones(4, 16, 16, dtype=torch.bool); mask[:, 3] = False     # query row 3 sees nothing
    return (torch.randn(4, 16, 8), mask)

def train_data():
    g = torch.Generator().manual_seed(2)
    for _ in range(1000):
        x = torch.randn(4, 16, 8, generator=g); yield (x, example_inputs()[1]), (x.sum((1, 2)) > 0).long()

def loss_fn(output, target):
    return F.cross_entropy(output.float(), target)
