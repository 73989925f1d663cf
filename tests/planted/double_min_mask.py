"""Two additive masks built from torch.finfo(torch.float16).min, a key-padding mask and a segment mask, added to the
same scores: where both mask a key the sum is -131008, -inf in fp16, and a sample whose keys are all padding gets a
softmax row of -inf only, which is NaN in attn (fp32 keeps -131008 and gives a uniform row). huggingface/
transformers#27114 (the -inf from adding masks) and NVIDIA-NeMo/Automodel#2658 (two finfo.min planes summed)."""
import torch, torch.nn as nn, torch.nn.functional as F

EXPECT = {"culprit": "attn", "families": ["nonfinite"], "target": {"device": "cpu", "dtype": "float16"},
          "phase": "forward"}

NEG = torch.finfo(torch.float16).min

class MaskedAttention(nn.Module):
    def __init__(self, d=32):
        super().__init__(); self.qkv = nn.Linear(d, 3 * d); self.out = nn.Linear(d, d)
    def forward(self, x, keep, segment):
        q, k, v = self.qkv(x).chunk(3, -1)
        scores = (q @ k.transpose(-2, -1)) / q.shape[-1] ** 0.5
        scores = scores + (1.0 - keep.to(scores.dtype))[:, None, :] * NEG        # key padding
        scores = scores + (1.0 - segment.to(scores.dtype)) * NEG                  # other segments
        return self.out(F.softmax(scores, -1) @ v)

class Net(nn.Module):
    def __init__(self):
        super().__init__(); self.inp = nn.Linear(8, 32); self.attn = MaskedAttention(); self.head = nn.Linear(32, 2)
    def forward(self, x, keep, segment):
        return self.head(self.attn(self.inp(x), keep, segment).mean(1))

def build_model():
    torch.manual_seed(0); return Net()

def _masks():
    keep = torch.ones(4, 16); keep[3] = 0.0                     # sample 3 is all padding (an empty document)
    segment = torch.ones(4, 16, 16); segment[3] = 0.0           # and belongs to no segment
    return keep, segment

def example_inputs():
    torch.manual_seed(1); return (torch.randn(4, 16, 8), *_masks())

def train_data():
    g = torch.Generator().manual_seed(2)
    for _ in range(100):
        x = torch.randn(4, 16, 8, generator=g); yield (x, *_masks()), (x.sum((1, 2)) > 0).long()

def loss_fn(output, target):
    return F.cross_entropy(output.float(), target)
