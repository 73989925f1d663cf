"""Step-length feature sqrt(sum(d * d)) of a slowly varying trajectory (steps ~1e-4): in fp16 each square (1e-8) is
below the smallest subnormal and flushes to 0, the sum is 0 and sqrt(0) = 0, so the forward stays finite and the
output nearly right; but d sqrt(s)/ds = inf at 0, so backward through dist gives inf/NaN gradients. pytorch/pytorch#43211
(torch.norm gives NaN gradient for small float16 input) and #2421 (gradient of zero norm)."""
import torch, torch.nn as nn, torch.nn.functional as F

FIX = {"rule": "AMP302", "device": "cpu", "dtype": "float16", "calibrate": False, "unsafe": False}

EXPECT = {"culprit": "dist", "families": ["nonfinite"], "target": {"device": "cpu", "dtype": "float16"},
          "phase": "backward"}

class StepLength(nn.Module):
    def forward(self, h):
        d = h[:, 1:] - h[:, :-1]
        return torch.sqrt((d.float() * d.float()).sum(-1))

class Net(nn.Module):
    def __init__(self):
        super().__init__(); self.enc = nn.Linear(4, 16); self.dist = StepLength(); self.head = nn.Linear(16, 1)
    def forward(self, x):
        h = self.enc(x)
        return self.head(h[:, 1:]).squeeze(-1) + self.dist(h)

def build_model():
    torch.manual_seed(0); return Net()

def _trajectory(g=None):
    steps = torch.arange(32.0)[None, :, None]
    return torch.randn(8, 1, 4, generator=g) + 1e-4 * steps       # drifts by 1e-4 per position

def example_inputs():
    return (_trajectory(torch.Generator().manual_seed(1)),)

def train_data():
    g = torch.Generator().manual_seed(2)
    for _ in range(100):
        x = _trajectory(g); yield x, x[:, 1:, 0]

def loss_fn(output, target):
    return F.mse_loss(output.float(), target)
