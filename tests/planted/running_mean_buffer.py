"""A feature normalizer that keeps its statistics itself: a running count and a running mean, buffers its forward
updates in place each step (as BatchNorm's running stats, or a reward/observation normalizer in RL). O2 casts
buffers with the model (it keeps only BatchNorm fp32), so both live in bf16: the count stops at 256 (256 + 1 rounds
back to 256) and the mean's updates, 1/count of the distance to the batch mean, fall below half an ulp. The run
finishes; the normalizer silently stops adapting. Running statistics in half precision: the reason torch's
BatchNorm and apex O2 keep batchnorm in fp32 (NVIDIA/apex `keep_batchnorm_fp32`); timm's ModelEmaV2 reports
(huggingface/pytorch-image-models#1831) are the same rounding on EMA buffers.

    ampaudit train tests/planted/running_mean_buffer.py --opt-level O2 --dtype bfloat16 --device cpu --steps 300 --trace run.jsonl
"""
import torch, torch.nn as nn, torch.nn.functional as F

EXPECT = {"culprit": "norm", "families": [], "target": {"device": "cpu", "dtype": "bfloat16"},
          "phase": "training", "opt_level": "O2", "tensors": ["norm.count", "norm.mean"]}


class RunningNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.register_buffer("count", torch.zeros(()))
        self.register_buffer("mean", torch.zeros(d))

    def forward(self, x):
        if self.training:
            with torch.no_grad():
                self.count.add_(1)
                self.mean.add_((x.mean(0).to(self.mean.dtype) - self.mean) / self.count)
        return x - self.mean.to(x.dtype)


class Net(nn.Module):
    def __init__(self):
        super().__init__(); self.norm = RunningNorm(8); self.body = nn.Linear(8, 32); self.head = nn.Linear(32, 4)

    def forward(self, x):
        return self.head(F.gelu(self.body(self.norm(x))))


def build_model():
    torch.manual_seed(0); return Net()

def example_inputs():
    torch.manual_seed(1); return (torch.randn(16, 8) + 3.0,)

def train_data():
    g = torch.Generator().manual_seed(2)
    for _ in range(1000):
        x = torch.randn(16, 8, generator=g) + 3.0
        yield x, x[:, :4]

def loss_fn(output, target):
    return F.mse_loss(output.float(), target)
