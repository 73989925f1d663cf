"""Models built the way people train them under AMP every day give no precision-family warning on the targets
they train on: BatchNorm under autocast, softmax attention, LayerNorm, means and dtype-aware masks are safe there."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ampaudit

PRECISION = ("sensitive-op", "normalization", "constant")


class Bottleneck(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c // 4, 1, bias=False), nn.BatchNorm2d(c // 4)
        self.conv2, self.bn2 = nn.Conv2d(c // 4, c // 4, 3, padding=1, bias=False), nn.BatchNorm2d(c // 4)
        self.conv3, self.bn3 = nn.Conv2d(c // 4, c, 1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x):
        h = F.relu(self.bn1(self.conv1(x)))
        h = F.relu(self.bn2(self.conv2(h)))
        return F.relu(self.bn3(self.conv3(h)) + x)


class ResNetLike(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU())
        self.layers = nn.Sequential(*[Bottleneck(64) for _ in range(3)])
        self.fc = nn.Linear(64, 1000)

    def forward(self, x):
        return self.fc(self.layers(self.stem(x)).mean((2, 3)))


class GPTBlock(nn.Module):
    """Hand-written causal attention as in nanoGPT / HF: the mask is the dtype's own min, the softmax PyTorch's."""

    def __init__(self, d: int = 64, heads: int = 4):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.heads = heads

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-2, -1)) * (d // self.heads) ** -0.5
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        scores = scores.masked_fill(~causal, torch.finfo(scores.dtype).min)
        att = (F.softmax(scores, -1) @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(att)
        return x + self.mlp(self.ln2(x))


class ViTLike(nn.Module):
    def __init__(self):
        super().__init__()
        self.patch = nn.Conv2d(3, 64, 8, 8)
        self.blocks = nn.Sequential(*[nn.TransformerEncoderLayer(64, 4, 256, batch_first=True) for _ in range(2)])
        self.head = nn.Linear(64, 1000)

    def forward(self, x):
        h = self.patch(x).flatten(2).transpose(1, 2)
        return self.head(self.blocks(h).mean(1))


class BandAttention(nn.Module):
    """Longformer's (and LED's) banded attention: outside the band the scores are replaced by a tensor of -inf,
    ``torch.full_like(scores, -inf).where(outside, scores)``; -inf is exact in fp16 and no integer counter."""

    def __init__(self, d: int = 64):
        super().__init__()
        self.q, self.k = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        s = self.q(x) @ self.k(x).transpose(-1, -2)
        t = x.shape[1]
        outside = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(4) | \
            torch.ones(t, t, dtype=torch.bool, device=x.device).tril(-4)
        return torch.full_like(s, float("-inf")).where(outside, s).softmax(-1) @ x


MODELS = {
    "band": (BandAttention, lambda: (torch.randn(2, 16, 64),)),
    "resnet": (ResNetLike, lambda: (torch.randn(2, 3, 64, 64),)),
    "gpt": (lambda: nn.Sequential(GPTBlock(), GPTBlock()), lambda: (torch.randn(2, 32, 64),)),
    "vit": (ViTLike, lambda: (torch.randn(2, 3, 64, 64),)),
}


@pytest.mark.parametrize("device, dtype", [("cuda", "float16"), ("cuda", "bfloat16"), ("cpu", "bfloat16")])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_everyday_models_have_no_precision_warning(name, device, dtype):
    build, inputs = MODELS[name]
    report = ampaudit.check(build().eval(), *inputs(), device=device, dtype=dtype)
    alarms = [(f.rule, f.module, f.message) for f in report.findings
              if f.family in PRECISION and f.severity != "info"]
    assert alarms == []
    if name == "resnet":   # BatchNorm is still flagged, at the severity its kernel deserves, with a true why
        bn = [f for f in report.findings if f.rule == "AMP301"]
        assert bn and {f.severity for f in bn} == {"info"} and "fp32" in bn[0].why
