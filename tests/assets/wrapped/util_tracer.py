"""The user's tracer autowraps their utility module (and math): the model file passes the traced GraphModule."""
import math

import torch
import torch.fx
from torch import nn

import score_ops


class Scores(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        s = score_ops.scaled(self.q(x) @ self.k(x).transpose(-2, -1))
        return score_ops.naive_softmax(s) * math.sqrt(2.0)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.scores = Scores()

    def forward(self, x):
        return self.scores(x)


class UtilTracer(torch.fx.Tracer):
    def __init__(self):
        super().__init__(autowrap_modules=(math, score_ops))


class WithHead(nn.Module):
    """The traced GraphModule as one submodule of a model that was not traced."""

    def __init__(self):
        super().__init__()
        self.backbone = build_model()
        self.head = nn.Linear(8, 8)

    def forward(self, x):
        return self.head(self.backbone(x))


def build_model():
    model = Net()
    return torch.fx.GraphModule(model, UtilTracer().trace(model))


def example_inputs():
    return (torch.randn(2, 8, 16),)
