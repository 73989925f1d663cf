import time

import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        if x.sum() > -1e9:  # data-dependent: forces a real forward, which never returns
            while True:
                time.sleep(0.05)
        return self.fc(x)


def build_model():
    return Net()


def example_inputs():
    return (torch.randn(2, 8),)
