"""A head that adds a large offset after its projection: ~1e5 in FP32, past fp16's 65504, so under fp16 autocast
the Linear's fp16 output plus the offset is stored as inf; the model itself only averages it, in fp32. Kept in
fp32 (autocast off, input upcast), the head's output is an fp32 value that fp16's range no longer bounds."""
import torch, torch.nn as nn

FIX = {"rule": "AMP501", "device": "cuda", "dtype": "float16", "calibrate": True, "unsafe": False}

class OffsetHead(nn.Module):
    def __init__(self, offset=1e5):
        super().__init__(); self.fc = nn.Linear(32, 32); self.offset = offset
    def forward(self, x):
        # fp32 under autocast (AMP501): its values leave the low dtype's range
        with torch.autocast(device_type=x.device.type, enabled=False):
            x = x.float()
            return self.fc(x) + self.offset      # the offset is added to the GEMM's output

class Net(nn.Module):
    def __init__(self):
        super().__init__(); self.inp = nn.Linear(16, 32); self.head = OffsetHead()
    def forward(self, x):
        return self.head(self.inp(x)).float().mean(-1)

def build_model():
    torch.manual_seed(0); return Net()

def example_inputs():
    torch.manual_seed(1); return (torch.randn(4, 16),)
