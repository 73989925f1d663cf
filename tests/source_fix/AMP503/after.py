"""A head that scales its projection down by 1e-9 (a temperature applied after the GEMM): the FP32 outputs are
~1e-9, below fp16's smallest normal (6.1e-5) and mostly below its smallest subnormal (6e-8), so under fp16
autocast they lose their digits or flush to zero. Kept in fp32 (autocast off, input upcast), they stay fp32."""
import torch, torch.nn as nn

FIX = {"rule": "AMP503", "device": "cuda", "dtype": "float16", "calibrate": True, "unsafe": False}

class ScaledHead(nn.Module):
    def __init__(self, scale=1e-9):
        super().__init__(); self.fc = nn.Linear(32, 32); self.scale = scale
    def forward(self, x):
        # fp32 under autocast (AMP503): its values leave the low dtype's range
        with torch.autocast(device_type=x.device.type, enabled=False):
            x = x.float()
            return self.fc(x) * self.scale       # the scale is applied to the GEMM's output

class Net(nn.Module):
    def __init__(self):
        super().__init__(); self.inp = nn.Linear(16, 32); self.head = ScaledHead()
    def forward(self, x):
        return self.head(self.inp(x)).float().mean(-1)

def build_model():
    torch.manual_seed(0); return Net()

def example_inputs():
    torch.manual_seed(1); return (torch.randn(4, 16),)
