"""exp of logits in fp16: values above 11.1 overflow to inf."""
import torch, torch.nn as nn

FIX = {"rule": "AMP202", "device": "cpu", "dtype": "float16", "calibrate": False, "unsafe": False}

EXPECT = {"rule": "AMP202", "target": {"device": "cpu", "dtype": "float16"}, "calibrate": False}


class Scorer(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, x):
        # unnormalized scores, exponentiated by hand
        return torch.exp(self.proj(x)).mean(-1)


def build_model():
    torch.manual_seed(0)
    return Scorer()


def example_inputs():
    torch.manual_seed(1)
    return (torch.randn(8, 16),)
