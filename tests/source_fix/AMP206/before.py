"""Sliding-window mean over 4096 steps built from a cumsum difference (c[:, w:] - c[:, :-w]): under CPU bf16 autocast
the cumsum is stored in bf16, every partial sum rounded to 8 bits of the running total (multiples of 16 past 2048),
so each 8-step window sum is noise several times its size; the output stays finite. The same failure as
tensorflow/tensorflow#115731 (CPU cumsum stays in bfloat16) and opencv/opencv#7127 (box filter by running sums)."""
import torch, torch.nn as nn, torch.nn.functional as F

FIX = {"rule": "AMP206", "device": "cpu", "dtype": "bfloat16", "calibrate": False, "unsafe": False}

EXPECT = {"culprit": "smooth", "families": ["sensitive-op"], "target": {"device": "cpu", "dtype": "bfloat16"},
          "phase": "forward"}

class WindowMean(nn.Module):
    def __init__(self, window=8):
        super().__init__(); self.window = window
    def forward(self, x):
        c = F.pad(F.softplus(x).cumsum(1), (0, 0, 1, 0))
        return (c[:, self.window:] - c[:, :-self.window]) / self.window

class Net(nn.Module):
    def __init__(self):
        super().__init__(); self.inp = nn.Linear(6, 16); self.smooth = WindowMean(); self.head = nn.Linear(16, 2)
    def forward(self, x):
        return self.head(self.smooth(self.inp(x)))

def build_model():
    torch.manual_seed(0); return Net()

def example_inputs():
    torch.manual_seed(1); return (torch.randn(2, 4096, 6),)

def train_data():
    g = torch.Generator().manual_seed(2)
    for _ in range(100):
        x = torch.randn(2, 4096, 6, generator=g); yield x, x[:, 7:, :2]

def loss_fn(output, target):
    return F.mse_loss(output.float(), target)
