"""A custom tracer keeps the user's submodule a leaf (as HF's and timm's do): its forward has data-dependent
control flow fx cannot follow; a bf16 cumsum inside."""
import torch
import torch.fx
from torch import nn


class Positions(nn.Module):
    def forward(self, x, mask):
        if mask.any():                            # data-dependent: why the tracer keeps it a leaf
            pos = torch.cumsum(mask.to(x.dtype), dim=1)
        else:
            pos = torch.zeros_like(x[..., 0])
        return x + pos.unsqueeze(-1)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(16, 16)
        self.pos = Positions()
        self.out = nn.Linear(16, 16)

    def forward(self, x, mask):
        return self.out(self.pos(self.embed(x), mask))


class LeafTracer(torch.fx.Tracer):
    def is_leaf_module(self, m, qualname):
        return isinstance(m, Positions) or super().is_leaf_module(m, qualname)


def build_model():
    model = Net()
    return torch.fx.GraphModule(model, LeafTracer().trace(model))


def example_inputs():
    return (torch.randn(2, 512, 16), torch.ones(2, 512, dtype=torch.bool))
