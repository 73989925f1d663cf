"""A wrapped function handed the modules it runs (a Linear and a module of the user's): the mask constant meets
the Linear's float16 output."""
import torch
import torch.fx
from torch import nn


class Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(16))

    def forward(self, x):
        return x * self.scale.to(x.dtype)


def project_and_mask(proj, gate, x):
    y = gate(proj(x))
    return y.masked_fill(y < 0, -1e9)


torch.fx.wrap("project_and_mask")


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj, self.gate = nn.Linear(16, 16), Gate()

    def forward(self, x):
        return project_and_mask(self.proj, self.gate, x).softmax(-1)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = Block()

    def forward(self, x):
        return self.block(x)


def build_model():
    return Net()


def example_inputs():
    return (torch.randn(2, 8, 16),)
