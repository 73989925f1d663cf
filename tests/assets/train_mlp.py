"""A small MLP for the trainer tests: BatchNorm (kept fp32 under O2), dropout (exercises RNG restore on
resume) and a deterministic finite data stream (its own seeded generator, 64 batches per epoch)."""
import torch
import torch.nn as nn

BATCHES = 64


class MLP(nn.Module):
    def __init__(self, width: int = 64, dropout: float = 0.1, batchnorm: bool = True):
        super().__init__()
        self.fc1 = nn.Linear(16, width)
        self.bn = nn.BatchNorm1d(width) if batchnorm else nn.Identity()
        self.act = nn.GELU()
        self.drop = nn.Dropout(dropout)
        self.fc2 = nn.Linear(width, width)
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        h = self.drop(self.act(self.bn(self.fc1(x))))
        return self.head(torch.tanh(self.fc2(h)))


def build_model(width: int = 64, dropout: float = 0.1, batchnorm: bool = True):
    torch.manual_seed(0)
    return MLP(width, dropout, batchnorm)


def example_inputs():
    return (torch.randn(8, 16),)


def train_data(batch: int = 16, batches: int = BATCHES):
    g = torch.Generator().manual_seed(3)
    w = torch.randn(16, 1, generator=g)
    for _ in range(batches):
        x = torch.randn(batch, 16, generator=g)
        yield x, torch.sin(x @ w)


def loss_fn(output, target):
    return ((output.float() - target) ** 2).mean()


def make_optimizer(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)


def make_scheduler(optimizer):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=7, gamma=0.9)


def deterministic_model():
    """For comparisons across process counts: no dropout (each rank draws its own masks) and no BatchNorm (the
    bias before it has a zero gradient up to rounding, which Adam's normalisation amplifies into noise)."""
    return build_model(dropout=0.0, batchnorm=False)
