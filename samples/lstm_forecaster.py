"""An LSTM forecaster on a synthetic daily price series (windows of 48 days -> the next day's value).

What it shows: a two-layer ``nn.LSTM`` with a hidden size of 50 (a common hand-picked value) and a linear
read-out, trained with MSE. The series is a seeded geometric random walk times a weekly and a yearly
seasonal factor; the model sees three features per day (standardised log price, and the sine and cosine of
the weekly phase) and predicts the next standardised log price.

Run it:  ``ampaudit check samples/lstm_forecaster.py --device cuda --dtype float16``
         ``ampaudit train samples/lstm_forecaster.py --steps 200 --trace run.jsonl``

Findings it should produce (CUDA fp16 policy):
- ``alignment``: cuDNN runs an LSTM on Tensor Cores only when the hidden size and the minibatch are multiples
  of 8: ``lstm`` has hidden 50 (and input 3); the read-out ``head`` has K=50 and a single output.
Batch 32 is on the grid. It trains in FP32 and bf16 (and fp16 on CUDA) without non-finite values; CPU fp16
autocast fails inside oneDNN ("could not create a primitive descriptor for the LSTM forward propagation
primitive") on CPUs without native fp16 support.
"""
from __future__ import annotations

import functools
import math
from typing import Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {"culprit": None, "families": ["alignment"], "misaligned": {"lstm": 50, "head": 50},
          # CPU autocast sends nn.LSTM to oneDNN, which has no fp16 LSTM kernel on most CPUs.
          "cpu_fp16_unsupported": "oneDNN has no fp16 LSTM kernel on this CPU"}

DAYS = 4000         # length of the synthetic series
WINDOW = 48         # days of history per example
FEATURES = 3
HIDDEN = 50
LAYERS = 2
BATCH = 32


@functools.lru_cache(maxsize=1)
def price_series(seed: int = 11) -> torch.Tensor:
    """(DAYS,) float32 prices: geometric random walk (drift 2e-4, vol 1%) times weekly and yearly seasonality."""
    g = torch.Generator().manual_seed(seed)
    day = torch.arange(DAYS, dtype=torch.float64)
    log_walk = torch.cumsum(2e-4 + 0.01 * torch.randn(DAYS, generator=g, dtype=torch.float64), 0)
    seasonal = 0.03 * torch.sin(2 * math.pi * day / 7) + 0.08 * torch.sin(2 * math.pi * day / 365.25)
    return (100.0 * torch.exp(log_walk + seasonal)).float()


@functools.lru_cache(maxsize=1)
def feature_matrix() -> tuple[torch.Tensor, torch.Tensor]:
    """(DAYS, FEATURES) inputs and (DAYS,) standardised log price (the regression target)."""
    log_price = price_series().log()
    z = (log_price - log_price.mean()) / log_price.std()
    phase = 2 * math.pi * torch.arange(DAYS, dtype=torch.float32) / 7
    return torch.stack([z, torch.sin(phase), torch.cos(phase)], dim=1), z


class LSTMForecaster(nn.Module):
    """windows (batch, WINDOW, FEATURES) float -> next value (batch, 1)."""

    def __init__(self, features: int = FEATURES, hidden: int = HIDDEN, layers: int = LAYERS) -> None:
        super().__init__()
        self.lstm = nn.LSTM(features, hidden, num_layers=layers, batch_first=True)
        self.head = nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.lstm(x)[0]
        return self.head(out[:, -1])


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return LSTMForecaster()


def train_data(batches: int = 2000, seed: int = 2) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yields (windows (BATCH, WINDOW, FEATURES) float32, next values (BATCH, 1) float32)."""
    inputs, z = feature_matrix()
    g = torch.Generator().manual_seed(seed)
    offsets = torch.arange(WINDOW)
    for _ in range(batches):
        starts = torch.randint(0, DAYS - WINDOW - 1, (BATCH, 1), generator=g)
        yield inputs[starts + offsets], z[starts[:, 0] + WINDOW].unsqueeze(1)


def example_inputs() -> tuple[torch.Tensor]:
    return (next(iter(train_data(batches=1)))[0],)


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output.float(), target)


def make_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=3e-3)


if __name__ == "__main__":
    net = build_model()
    opt = make_optimizer(net.parameters())
    for step, (x, y) in enumerate(train_data(batches=200)):
        loss = loss_fn(net(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 40 == 0:
            print(f"step {step:4d}  mse {loss.item():.4f}")
