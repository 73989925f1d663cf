"""offset_head.py with the head already written as an fp32 island: autocast off, its input upcast, so its output
(~1e5) is computed and stored in fp32 under any target's autocast, and its consumer only averages it in fp32.
Nothing here overflows: calibration must not judge that fp32 output against fp16's 65504."""
import torch, torch.nn as nn

EXPECT = {"culprit": None, "families": [], "target": {"device": "cuda", "dtype": "float16"}, "phase": "forward"}


class OffsetHead(nn.Module):
    def __init__(self, offset=1e5, scale=1.0):
        super().__init__(); self.fc = nn.Linear(32, 32); self.offset, self.scale = offset, scale
    def forward(self, x):
        with torch.autocast(device_type=x.device.type, enabled=False):
            x = x.float()
            return self.fc(x) * self.scale + self.offset


class Net(nn.Module):
    def __init__(self, head=None):
        super().__init__(); self.inp = nn.Linear(16, 32); self.head = head or OffsetHead()
    def forward(self, x):
        return self.head(self.inp(x)).float().mean(-1)


def build_model():
    torch.manual_seed(0); return Net()

def example_inputs():
    torch.manual_seed(1); return (torch.randn(4, 16),)
