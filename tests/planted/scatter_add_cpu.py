"""Attention-weighted pooling with `zeros(...).scatter_add(0, index, weights * h)`, written and trained under CUDA
autocast, where scatter_add is on the promote list (added after pytorch/pytorch#51730: it did not promote and
raised). CPU autocast does not promote it: the fp32 zeros meet the bf16 product and the forward raises "scatter():
Expected self.dtype to be equal to src.dtype". Fine in FP32 and under CUDA autocast."""
import torch, torch.nn as nn, torch.nn.functional as F

EXPECT = {"culprit": "pool", "families": ["sensitive-op", "nonfinite"],
          "target": {"device": "cpu", "dtype": "bfloat16"}, "phase": "forward"}
BUCKETS = 8

class BucketPool(nn.Module):
    def __init__(self, d=32):
        super().__init__(); self.score = nn.Linear(d, 1)
    def forward(self, h, bucket):
        w = torch.sigmoid(self.score(h))
        index = bucket[:, None].expand(-1, h.shape[-1])
        return torch.zeros(BUCKETS, h.shape[-1], device=h.device).scatter_add(0, index, w * h)

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, 32); self.pool = BucketPool(); self.head = nn.Linear(32, 2)
    def forward(self, x, bucket):
        return self.head(self.pool(F.gelu(self.embed(x)), bucket))

def build_model():
    torch.manual_seed(0); return Net()

def example_inputs():
    torch.manual_seed(1)
    return (torch.randn(64, 8), torch.arange(64) % BUCKETS)

def train_data():
    g = torch.Generator().manual_seed(2)
    for _ in range(20):
        yield (torch.randn(64, 8, generator=g), torch.arange(64) % BUCKETS), torch.randn(BUCKETS, 2, generator=g)

def loss_fn(output, target):
    return F.mse_loss(output.float(), target)
