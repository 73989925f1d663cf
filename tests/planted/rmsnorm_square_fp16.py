"""Decoder block with a hand-written RMSNorm that squares in the activation dtype: the first token (the attention
sink) carries a massive residual channel of ~400, its square 1.6e5 is past fp16's 65504, the mean of the row is
inf, rsqrt(inf) = 0 and the whole row comes out 0: finite, and that token's features are gone. pytorch/pytorch#133085
(nn.RMSNorm in fp16 "started to give wrong answers ... due to overflow while computing square of the input"; the
LlamaRMSNorm upcast is the fix), xlite-dev/LeetCUDA#335 (rms_norm f16 overflow, "get zero after dividing
infinity"). ``build_fixed_model`` is LlamaRMSNorm's fix, the variance in float32: nothing to report."""
import torch, torch.nn as nn, torch.nn.functional as F

EXPECT = {"culprit": "norm", "families": ["range", "nonfinite", "normalization"],
          "target": {"device": "cpu", "dtype": "float16"}, "phase": "forward"}

D, SINK_CHANNEL = 128, 7


class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-6, upcast=False):
        super().__init__(); self.weight = nn.Parameter(torch.ones(d)); self.eps = eps; self.upcast = upcast
    def forward(self, h):
        x = h.float() if self.upcast else h                 # the fix: square and mean in float32
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(h.dtype)


class Net(nn.Module):
    def __init__(self, upcast=False):
        super().__init__()
        self.embed = nn.Linear(32, D); self.norm = RMSNorm(D, upcast=upcast); self.head = nn.Linear(D, 8)
        with torch.no_grad():   # input feature 0 marks the first (BOS) token; the embedding writes it as one massive
            self.embed.weight[:, 0] = 0.0; self.embed.weight[SINK_CHANNEL, 0] = 400.0   # channel (Sun et al. 2024)
    def forward(self, x):
        return self.head(self.norm(self.embed(x)))


def build_model():
    torch.manual_seed(0); return Net()

def build_fixed_model():
    torch.manual_seed(0); return Net(upcast=True)

def _tokens(g):
    x = torch.randn(4, 16, 32, generator=g)
    x[..., 0] = 0.0; x[:, 0, 0] = 1.0                       # the BOS flag
    return x

def example_inputs():
    return (_tokens(torch.Generator().manual_seed(1)),)

def train_data():
    g = torch.Generator().manual_seed(2)
    for _ in range(100):
        x = _tokens(g); yield x, x[..., 1:9]

def loss_fn(output, target):
    return F.mse_loss(output.float(), target)
