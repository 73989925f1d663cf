import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        if x.sum() > -1e9:
            raise ValueError("bad shapes in forward")
        return self.fc(x)


def build_model():
    return Net()


def example_inputs():
    return (torch.randn(2, 8),)
