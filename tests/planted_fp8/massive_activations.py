"""A block from the middle of an LLM whose residual stream carries "massive activations": two fixed feature dims of
the start token at 1e5 (about 1.4e5 times the median |h| of the rest), the same whatever the input. A readout that
reads the residual stream itself (a probe on output_hidden_states, which no norm has touched) uses those dims as a
bias: its weights on them are 1/1e5 of the others, so they add an ordinary-sized term. In float8 with one scale per
tensor (tensorwise) the start token's 1e5 sets the scale of the whole input: every other activation lands in e4m3's
subnormals (83%) or flushes to 0 (17%), and the probe's output is 18 dB from FP32 (budget 20). The block's own
Linears read RMSNorm(h), where the start token's row is rescaled by its own norm, and keep float8's usual ~29 dB.
Sun et al. 2024, "Massive Activations in Large Language Models", arXiv:2402.17762 (https://arxiv.org/abs/2402.17762):
a few activations "100,000 times larger" than the others, in fixed feature dims (LLaMA2-7B: 1415 and 2533) of the
starting token and the first delimiter, nearly constant across inputs, acting as bias terms."""
import torch, torch.nn as nn, torch.nn.functional as F

EXPECT = {"keep_out": "probe", "reason": "budget", "recipe": "tensorwise", "fp8_ok": ["block.up", "block.down"]}

DIM, SEQ, OUT = 64, 64, 32
MASSIVE_DIMS = (13, 45)
MASSIVE = 1e5
# What training must keep as planted (bench/fp8_plan_planted.py zeroes their gradients): the probe's columns that read
# the massive dims at 1/MASSIVE, which Adam's ~lr steps would otherwise blow up 1e5-fold. Name -> index (None: all).
FIXED = {"probe.weight": (slice(None), list(MASSIVE_DIMS))}

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.RMSNorm(DIM); self.up = nn.Linear(DIM, 4 * DIM); self.down = nn.Linear(4 * DIM, DIM)
    def forward(self, h):
        return h + self.down(F.gelu(self.up(self.norm(h))))

class Net(nn.Module):
    def __init__(self):
        super().__init__(); self.block = Block(); self.probe = nn.Linear(DIM, OUT)
        massive = torch.zeros(DIM); massive[list(MASSIVE_DIMS)] = MASSIVE
        self.register_buffer("massive", massive)
    def forward(self, x):
        h = torch.cat([x[:, :1] + self.massive, x[:, 1:]], dim=1)     # the start token's massive activations
        return self.probe(self.block(h))

def build_model():
    torch.manual_seed(0); model = Net()
    with torch.no_grad():
        model.probe.weight[:, list(MASSIVE_DIMS)] /= MASSIVE          # read as a bias, as a fitted readout does
    return model

def _batch(g):
    return torch.randn(4, SEQ, DIM, generator=g)

def example_inputs():
    return (_batch(torch.Generator().manual_seed(1)),)

def train_data():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(DIM, OUT, generator=g) / DIM ** 0.5
    for _ in range(8):
        x = _batch(g); yield x, x @ w

def loss_fn(output, target):
    return F.mse_loss(output.float(), target)
