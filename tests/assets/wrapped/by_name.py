"""A function wrapped by its name at module level: F.normalize's default eps inside."""
import torch
import torch.fx
import torch.nn.functional as F
from torch import nn


def cosine_logits(x, w):
    return F.normalize(x, dim=-1) @ F.normalize(w, dim=-1).t()


torch.fx.wrap("cosine_logits")


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.classes = nn.Parameter(torch.randn(10, 16))

    def forward(self, x):
        return cosine_logits(self.proj(x), self.classes)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.head = Head()

    def forward(self, x):
        return self.head(x)


def build_model():
    return Net()


def example_inputs():
    return (torch.randn(4, 16),)
