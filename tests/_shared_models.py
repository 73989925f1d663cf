"""Small models more than one test file uses."""
from __future__ import annotations

import torch
import torch.nn as nn

# A model file (source text) whose hidden width 50 misses the Tensor Core grid; CLEAN_SOURCE uses 48.
MISALIGNED_SOURCE = '''
import torch, torch.nn as nn

class Net(nn.Module):
    def __init__(self):
        super().__init__(); self.fc1 = nn.Linear(64, 50); self.fc2 = nn.Linear(50, 16)
    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))

def build_model():
    return Net()

def example_inputs():
    return (torch.randn(8, 64),)
'''
CLEAN_SOURCE = MISALIGNED_SOURCE.replace("50", "48")


class Boost(nn.Module):
    def forward(self, x):
        return x * 3000.0          # small forward; the backward multiplies gradients by 3000


class BackwardOverflow(nn.Module):
    """Finite forward; with a large upstream gradient its backward overflows fp16 inside `boost`."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 8, bias=False)
        self.boost = Boost()
        self.out = nn.Linear(8, 1)

    def forward(self, x):
        return self.out(torch.tanh(self.boost(self.inp(x))))


class MaskedLogBuckets(nn.Module):
    """T5-style relative-position buckets: log(0) in FP32 makes -inf, masked right away (not a precision fault)."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.width = width

    def forward(self, x):
        logs = torch.log(torch.arange(self.width, dtype=torch.float32))   # -inf at position 0, in any precision
        return self.fc(x) + torch.where(torch.isinf(logs), torch.zeros_like(logs), logs)
