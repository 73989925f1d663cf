"""A planted fp16 evaluation gap: a classifier whose input normalization was folded into its first layer.

Exporters and inference tools often fold ``(x - mean) / std`` into the first Linear (weight / std, bias minus
weight @ mean) so the model takes raw features. Here the raw features sit around 3000 (sensor counts, calendar
values) and carry their class in a +-0.5 part. In FP32 the folded layer subtracts the mean exactly and the model is
right on every sample. Under fp16 autocast the GEMM sees the features rounded to fp16's spacing of 2 at 3000 and a
bias of up to 17000 rounded to a spacing of 16: the informative part is gone before the subtraction, and top-1 falls to
about half. Training barely moves the weights (lr 1e-6); the point is what evaluation shows: an ``eval`` event with
the same weights scoring very differently under autocast and in FP32.
"""
import torch
import torch.nn as nn

OFFSET = 3000.0
FEATURES, CLASSES, BATCH = 32, 10, 64


def prototypes() -> torch.Tensor:
    return torch.randn(CLASSES, FEATURES, generator=torch.Generator().manual_seed(0))


class FoldedClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(FEATURES, CLASSES)
        with torch.no_grad():   # the "trained" classifier, with the input mean folded into its bias
            self.fc.weight.copy_(prototypes())
            self.fc.bias.copy_(-prototypes().sum(1) * OFFSET)

    def forward(self, x):
        return self.fc(x)


def build_model():
    return FoldedClassifier()


def example_inputs():
    return (torch.full((BATCH, FEATURES), OFFSET),)


def _batches(seed: int, count: int):
    g = torch.Generator().manual_seed(seed)
    protos = prototypes()
    for _ in range(count):
        y = torch.randint(CLASSES, (BATCH,), generator=g)
        yield OFFSET + 0.5 * protos[y] + 0.3 * torch.randn(BATCH, FEATURES, generator=g), y


def train_data():
    return _batches(1, 16)


def eval_data():
    return _batches(2, 8)


def loss_fn(output, target):
    return nn.functional.cross_entropy(output.float(), target)


def make_optimizer(params):
    return torch.optim.SGD(params, lr=1e-6)
