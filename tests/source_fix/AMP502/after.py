"""A head that adds an offset after its projection: ~5e4 in FP32, within fp16's 65504 but by less than a bit, so
under fp16 autocast a slightly larger input or a later training step overflows the head's fp16 output. Kept in
fp32 (autocast off, input upcast), the output is an fp32 value with fp32's headroom."""
import torch, torch.nn as nn

FIX = {"rule": "AMP502", "device": "cuda", "dtype": "float16", "calibrate": True, "unsafe": False}

class OffsetHead(nn.Module):
    def __init__(self, offset=5e4):
        super().__init__(); self.fc = nn.Linear(32, 32); self.offset = offset
    def forward(self, x):
        # fp32 under autocast (AMP502): its values leave the low dtype's range
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
