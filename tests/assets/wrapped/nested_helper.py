"""A torch.fx.wrap'd function that calls a plain helper: the mask constant is in the helper."""
import torch
import torch.fx
from torch import nn


def _mask_scores(scores, mask):
    return scores.masked_fill(mask, torch.finfo(torch.float32).min)


@torch.fx.wrap
def attend(q, k, v, mask):
    scores = q @ k.transpose(-2, -1)
    scores = _mask_scores(scores, mask)
    return scores.softmax(-1) @ v


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.register_buffer("mask", torch.ones(8, 8, dtype=torch.bool).triu(1))

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        return attend(q, k, v, self.mask)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = Attention()
        self.head = nn.Linear(16, 16)

    def forward(self, x):
        return self.head(self.block(x))


def build_model():
    return Net()


def example_inputs():
    return (torch.randn(2, 8, 16),)
