"""A sum over 8192 activations stored in fp16: the total passes 65504 once they average above 8."""
import torch, torch.nn as nn

FIX = {"rule": "AMP203", "device": "cpu", "dtype": "float16", "calibrate": False, "unsafe": False}

EXPECT = {"rule": "AMP203", "target": {"device": "cpu", "dtype": "float16"}, "calibrate": False}


class Pool(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        h = self.proj(x)
        return h.sum(1, dtype=torch.float32)          # total over 8192 positions


def build_model():
    torch.manual_seed(0)
    return Pool()


def example_inputs():
    torch.manual_seed(1)
    return (torch.randn(2, 8192, 8),)
