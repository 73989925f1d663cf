"""Two exps (fp16-overflow hazards on CPU) joined both directly (through an add) and through a Linear: merging them
into one fp32 island would put the Linear between two parts of the island (a cycle), so they must stay two."""
import torch
import torch.nn as nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(16, 16)
        self.mid = nn.Linear(16, 16)
        self.out = nn.Linear(16, 16)
        self.register_buffer("unused_stat", torch.ones(3))   # never read by forward: must stay in state_dict

    def forward(self, x):
        a = torch.exp(self.inp(x))
        h = self.mid(a)
        b = torch.exp((a + h) * 0.5)
        return self.out(b)


def build_model():
    torch.manual_seed(0)
    return Net()


def example_inputs():
    torch.manual_seed(1)
    return (torch.randn(8, 16),)
