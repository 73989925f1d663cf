"""A top-8-of-128 MoE router on bf16 gate logits: 5.5% of the tokens pick another set of experts than in FP32 (the
router of tests/planted/moe_router_bf16.py). Routers are kept in fp32 for this (Switch Transformer's selective
precision; vllm-project/vllm#14027)."""
import torch, torch.nn as nn, torch.nn.functional as F

FIX = {"rule": "AMP702", "device": "cpu", "dtype": "bfloat16", "calibrate": True, "unsafe": False}

D, E, K = 64, 128, 8

class Router(nn.Module):
    def __init__(self):
        super().__init__(); self.gate = nn.Linear(D, E, bias=False)
    def forward(self, x):
        logits = self.gate(x)
        weights, experts = F.softmax(logits, -1, dtype=torch.float32).topk(K, -1)
        return weights, experts

class Net(nn.Module):
    def __init__(self):
        super().__init__(); self.router = Router(); self.experts = nn.Parameter(torch.randn(E, D) / D ** 0.5)
    def forward(self, x):
        weights, experts = self.router(x)
        return (weights.unsqueeze(-1) * self.experts[experts]).sum(1)

def build_model():
    torch.manual_seed(0); return Net()

def example_inputs():
    torch.manual_seed(1); return (torch.randn(512, D),)

def train_data():
    g = torch.Generator().manual_seed(2)
    for _ in range(100):
        x = torch.randn(512, D, generator=g); yield x, x

def loss_fn(output, target):
    return F.mse_loss(output.float(), target)
