"""An MLP whose every GEMM dimension misses the Tensor Core grid: 1000 -> 500 -> 250 -> 10, batch 100.

What it shows: the shapes people pick by hand (round decimal numbers) rather than multiples of 8. The model
is numerically harmless in fp16 and bf16; it is only slow, because cuBLAS falls back to slower kernels (or
pads internally) when M, N or K of a half-precision GEMM is not a multiple of 8. The data is seeded Gaussian
features labelled by a fixed random linear teacher, so the task is learnable.

Run it:  ``ampaudit check samples/misaligned_mlp.py --device cuda --dtype float16``
         ``ampaudit fix samples/misaligned_mlp.py`` (padding the hidden layers to 504 and 256 keeps the outputs)

Findings it should produce (CUDA fp16 policy):
- ``alignment`` on ``fc1`` (in 1000 is fine, out 500), ``fc2`` (500 -> 250), ``out`` (250 -> 10) and on the
  batch of 100 (the N dimension of every forward GEMM and K of every weight gradient).
No other family: there is no softmax, normalisation or large constant in the forward.
"""
from __future__ import annotations

from typing import Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {"culprit": None, "families": ["alignment"],
          "misaligned": {"fc1": 500, "fc2": 250, "out": 10}}

BATCH = 100
DIMS = (1000, 500, 250, 10)


class MisalignedMLP(nn.Module):
    """features (batch, 1000) float -> logits (batch, 10)."""

    def __init__(self, dims: tuple[int, ...] = DIMS) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dims[0], dims[1])
        self.fc2 = nn.Linear(dims[1], dims[2])
        self.out = nn.Linear(dims[2], dims[3])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.relu(self.fc2(F.relu(self.fc1(x)))))


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return MisalignedMLP()


def train_data(batches: int = 2000, seed: int = 2) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yields (features (BATCH, 1000) float32, labels (BATCH,) int64) from a fixed linear teacher."""
    teacher = torch.randn(DIMS[0], DIMS[-1], generator=torch.Generator().manual_seed(5))
    g = torch.Generator().manual_seed(seed)
    for _ in range(batches):
        x = torch.randn(BATCH, DIMS[0], generator=g)
        yield x, (x @ teacher).argmax(1)


def example_inputs() -> tuple[torch.Tensor]:
    return (next(iter(train_data(batches=1)))[0],)


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.float(), target)


def make_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


if __name__ == "__main__":
    net = build_model()
    opt = make_optimizer(net.parameters())
    for step, (x, y) in enumerate(train_data(batches=300)):
        out = net(x)
        loss = loss_fn(out, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 50 == 0:
            acc = (out.argmax(1) == y).float().mean().item()
            print(f"step {step:4d}  loss {loss.item():.3f}  acc {acc:.2f}")
