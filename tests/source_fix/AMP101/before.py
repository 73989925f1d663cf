"""An MLP whose hidden width, 500, is off the Tensor Core multiple of 8. A source edit cannot pad it: every consumer
of fc1's output would see 504 columns. So fix refuses and names what does pad it with outputs unchanged (the graph
rewrite's --pad); this fixture has no after.py, and the source is left as it is."""
import torch, torch.nn as nn, torch.nn.functional as F

FIX = {"rule": "AMP101", "device": "cuda", "dtype": "float16", "calibrate": False, "unsafe": True,
       "refused": "fix --pad"}

class MLP(nn.Module):
    def __init__(self):
        super().__init__(); self.fc1 = nn.Linear(128, 500); self.fc2 = nn.Linear(500, 128)
    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))

def build_model():
    torch.manual_seed(0); return MLP()

def example_inputs():
    torch.manual_seed(1); return (torch.randn(64, 128),)
