"""A model that passes the audit: an MLP with every GEMM dimension a multiple of 8 and nothing fp16-sensitive.

What it shows: what "clean" looks like. Features 64 -> 256 -> 128 -> 16 classes with batch 64, so every M, N
and K of the forward and backward GEMMs is on the Tensor Core grid; only Linear and ReLU run inside
``forward`` (no softmax, normalisation, reduction or large constant: the cross entropy lives in ``loss_fn``,
in fp32). The data is seeded Gaussian features labelled by a fixed teacher (linear plus a small ReLU term).

Run it:  ``ampaudit check samples/clean_mlp.py --device cuda --dtype float16``  (exit code 0)

Findings it should produce: none, under the CUDA fp16, CUDA bf16 and CPU bf16 policies.
"""
from __future__ import annotations

from typing import Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {"culprit": None, "families": [], "misaligned": {}}

BATCH = 64
DIMS = (64, 256, 128, 16)


class CleanMLP(nn.Module):
    """features (batch, 64) float -> logits (batch, 16)."""

    def __init__(self, dims: tuple[int, ...] = DIMS) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dims[0], dims[1])
        self.act1 = nn.ReLU()
        self.fc2 = nn.Linear(dims[1], dims[2])
        self.act2 = nn.ReLU()
        self.out = nn.Linear(dims[2], dims[3])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.act2(self.fc2(self.act1(self.fc1(x)))))


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return CleanMLP()


def train_data(batches: int = 2000, seed: int = 2) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yields (features (BATCH, 64) float32, labels (BATCH,) int64) from a fixed random teacher."""
    tg = torch.Generator().manual_seed(5)
    w1 = torch.randn(DIMS[0], 32, generator=tg)
    w2 = torch.randn(32, DIMS[-1], generator=tg)
    mix = torch.randn(DIMS[0], DIMS[-1], generator=tg)
    g = torch.Generator().manual_seed(seed)
    for _ in range(batches):
        x = torch.randn(BATCH, DIMS[0], generator=g)
        yield x, (x @ mix + 0.5 * torch.relu(x @ w1) @ w2).argmax(1)


def example_inputs() -> tuple[torch.Tensor]:
    return (next(iter(train_data(batches=1)))[0],)


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.float(), target)


def make_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=2e-3)


if __name__ == "__main__":
    net = build_model()
    opt = make_optimizer(net.parameters())
    for step, (x, y) in enumerate(train_data(batches=400)):
        out = net(x)
        loss = loss_fn(out, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 80 == 0:
            acc = (out.argmax(1) == y).float().mean().item()
            print(f"step {step:4d}  loss {loss.item():.3f}  acc {acc:.2f}")
