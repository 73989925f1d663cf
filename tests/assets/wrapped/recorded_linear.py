"""A wrapped window function that branches on the input's shape (so it is recorded, not re-traced) and runs a
linear layer on a sliced, strided input: aten splits that linear into mm and an add of the float32 bias, where
autocast runs the whole linear in float16, and the mask constant meets float16."""
import torch
import torch.fx
import torch.nn.functional as F
from torch import nn


def windowed(x, w, b, window):
    if x.shape[1] > window:
        x = x[:, :window]
    y = F.linear(x, w, b)
    return y.masked_fill(y < 0, -1e9)


def windowed_fp32(x, w, b, window):
    # as `ampaudit fix --diff` writes it: the mask applied in fp32
    if x.shape[1] > window:
        x = x[:, :window]
    y = F.linear(x, w, b)
    return y.float().masked_fill(y < 0, -1e9)


def windowed_island(s, window):
    # the mask applied in an fp32 island of the body's own: autocast off, its float16 input upcast
    if s.shape[1] > window:
        s = s[:, :window]
    with torch.autocast("cuda", enabled=False), torch.autocast("cpu", enabled=False):
        return s.float().masked_fill(s < 0, -1e9)


def windowed_exp(s, window):
    if s.shape[1] > window:
        s = s[:, :window]
    e = s.exp()
    return e / e.sum(1, keepdim=True)


torch.fx.wrap("windowed")
torch.fx.wrap("windowed_exp")
torch.fx.wrap("windowed_island")
torch.fx.wrap("windowed_fp32")


class Window(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(16, 16) * 0.25)
        self.b = nn.Parameter(torch.zeros(16))

    def forward(self, x):
        return windowed(x, self.w, self.b, 4).softmax(-1)


class WindowFixed(Window):
    def forward(self, x):
        return windowed_fp32(x, self.w, self.b, 4).softmax(-1)


class WindowIsland(Window):
    def forward(self, x):
        return windowed_island(F.linear(x, self.w, self.b), 4).softmax(-1)


class WindowExp(Window):
    def forward(self, x):
        return windowed_exp(F.linear(x, self.w, self.b), 4)


class Sliced(nn.Module):
    """The same without the wrap: a Linear on a strided slice."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        y = self.fc(x[:, :4])
        return y.masked_fill(y < 0, -1e9).softmax(-1)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.win = Window()

    def forward(self, x):
        return self.win(x)


def build_model():
    return Net()


def example_inputs():
    return (torch.randn(2, 8, 16),)
