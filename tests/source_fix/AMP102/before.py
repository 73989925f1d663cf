"""A convolution stack with 30 channels, off the Tensor Core multiple of 8. A source edit cannot pad them: the next
layer and everything after it would see 32 channels. So fix refuses and names what does pad them with outputs
unchanged (the graph rewrite's --pad); this fixture has no after.py, and the source is left as it is."""
import torch, torch.nn as nn, torch.nn.functional as F

FIX = {"rule": "AMP102", "device": "cuda", "dtype": "float16", "calibrate": False, "unsafe": True,
       "refused": "fix --pad"}

class ConvNet(nn.Module):
    def __init__(self):
        super().__init__(); self.c1 = nn.Conv2d(32, 30, 3, padding=1); self.c2 = nn.Conv2d(30, 32, 3, padding=1)
    def forward(self, x):
        return self.c2(F.relu(self.c1(x)))

def build_model():
    torch.manual_seed(0); return ConvNet()

def example_inputs():
    torch.manual_seed(1); return (torch.randn(2, 32, 16, 16),)
