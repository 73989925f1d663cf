"""A head that adds a large offset to its projection: ~1e5 in FP32, past fp16's 65504, so under fp16 autocast the
Linear's fp16 output plus the offset is stored as inf. The model's own loss only reads the mean, in fp32."""
import torch, torch.nn as nn

EXPECT = {"culprit": "head", "families": ["range", "nonfinite"], "target": {"device": "cuda", "dtype": "float16"},
          "phase": "forward"}


class OffsetHead(nn.Module):
    def __init__(self, offset=1e5, scale=1.0):
        super().__init__(); self.fc = nn.Linear(32, 32); self.offset, self.scale = offset, scale
    def forward(self, x):
        return self.fc(x) * self.scale + self.offset      # a scale applied after the GEMM (an output that is not centred)


class Net(nn.Module):
    def __init__(self, head=None):
        super().__init__(); self.inp = nn.Linear(16, 32); self.head = head or OffsetHead()
    def forward(self, x):
        return self.head(self.inp(x)).float().mean(-1)


def build_model():
    torch.manual_seed(0); return Net()

def example_inputs():
    torch.manual_seed(1); return (torch.randn(4, 16),)
