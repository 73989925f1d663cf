"""BatchNorm trained with micro-batches of 4: the SyncBatchNorm test (two gloo ranks against one process whose
batches are the two ranks' micro-batches side by side) and the small-batch warning. SGD, no bias before the
BatchNorm and no dropout, so two runs that compute the same statistics end with the same weights."""
import torch
import torch.nn as nn

MICRO = 4
BATCHES = 32


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32, bias=False)
        self.bn = nn.BatchNorm1d(32)
        self.fc2 = nn.Linear(32, 1)

    def forward(self, x):
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


def build_model():
    torch.manual_seed(0)
    return Net()


def example_inputs():
    return (torch.randn(MICRO, 16),)


def train_data():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(16, 1, generator=g)
    for _ in range(BATCHES):
        x = 2.0 * torch.randn(MICRO, 16, generator=g) + 1.0
        yield x, torch.sin(x @ w)


def paired_data():
    """What two ranks see together each step: rank 0 takes batch 2k, rank 1 batch 2k+1 (ampaudit.train.data)."""
    it = iter(train_data())
    for (x0, y0), (x1, y1) in zip(it, it):
        yield torch.cat([x0, x1]), torch.cat([y0, y1])


def loss_fn(output, target):
    return ((output.float() - target) ** 2).mean()


def make_optimizer(params):
    return torch.optim.SGD(params, lr=0.05)
