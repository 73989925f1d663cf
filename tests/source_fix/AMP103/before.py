"""Numerically fine, but every GEMM dim is off the Tensor Core grid: 500, 250, 30 and a vocabulary of 30522."""
import torch, torch.nn as nn, torch.nn.functional as F

FIX = {"rule": "AMP103", "device": "cuda", "dtype": "float16", "calibrate": False, "unsafe": True}

EXPECT = {"culprit": None, "families": ["alignment"],
          "misaligned": {"emb": 30522, "fc1": 500, "fc2": 250, "out": 30}}

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(30522, 128); self.fc1 = nn.Linear(128, 500); self.fc2 = nn.Linear(500, 250); self.out = nn.Linear(250, 30)
    def forward(self, ids):
        return self.out(F.gelu(self.fc2(F.gelu(self.fc1(self.emb(ids).mean(1))))))

def build_model():
    torch.manual_seed(0); return Net()

def example_inputs():
    torch.manual_seed(1); return (torch.randint(0, 30522, (8, 12)),)

def train_data():
    g = torch.Generator().manual_seed(2)
    for _ in range(1000):
        ids = torch.randint(0, 30522, (8, 12), generator=g); yield ids, ids[:, 0] % 30

def loss_fn(output, target):
    return F.cross_entropy(output.float(), target)
