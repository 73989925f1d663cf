"""A small ResNet with BatchNorm on CIFAR-sized synthetic images (3x32x32, 10 classes).

What it shows: the usual vision stem and residual stages (conv-BN-ReLU, identity or 1x1 projection shortcuts,
global average pooling, a linear classifier). The images are seeded noise plus one of ten smooth class
templates, so the label rule is learnable and a few hundred steps reach high accuracy.

Run it:  ``ampaudit check samples/resnet_bn.py --device cuda --dtype float16``
         ``ampaudit train samples/resnet_bn.py --steps 200 --trace run.jsonl``

Findings it should produce (CUDA fp16 policy):
- ``alignment``: the first conv ``stem.0`` has 3 input channels (RGB), off the grid of 8; padding the input to
  4 (or 8) channels is the usual fix. The classifier ``fc`` has 10 outputs.
- ``normalization``: BatchNorm layers (``stem.1`` and ``stages.*.bn*``) must keep fp32 statistics when the model
  is cast to half (apex O2's ``keep_batchnorm_fp32``); under the CPU autocast policy batch_norm runs in the low
  dtype.
Everything else (channels 16/32/64, batch 32) is on the grid. It trains in FP32, bf16 and fp16 without
non-finite values.
"""
from __future__ import annotations

from typing import Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {"culprit": None, "families": ["alignment", "normalization"],
          "misaligned": {"stem.0": 3, "fc": 10}}

BATCH = 32
IMAGE = 32
CLASSES = 10
WIDTHS = (16, 32, 64)


class BasicBlock(nn.Module):
    """Two 3x3 conv-BN layers with a shortcut (1x1 conv + BN when the shape changes)."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNetBN(nn.Module):
    """images (batch, 3, 32, 32) float -> logits (batch, classes)."""

    def __init__(self, widths: tuple[int, ...] = WIDTHS, classes: int = CLASSES) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 3, 1, 1, bias=False), nn.BatchNorm2d(widths[0]),
                                  nn.ReLU())
        blocks, c_in = [], widths[0]
        for i, width in enumerate(widths):
            blocks.append(BasicBlock(c_in, width, stride=1 if i == 0 else 2))
            c_in = width
        self.stages = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c_in, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(x))
        return self.fc(torch.flatten(self.pool(x), 1))


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return ResNetBN()


def class_templates(seed: int = 7) -> torch.Tensor:
    """Ten smooth colour patterns (10, 3, 32, 32): random 4x4 patterns upsampled, unit RMS."""
    g = torch.Generator().manual_seed(seed)
    coarse = torch.randn(CLASSES, 3, 4, 4, generator=g)
    smooth = F.interpolate(coarse, size=(IMAGE, IMAGE), mode="bilinear", align_corners=False)
    return smooth / smooth.pow(2).mean((1, 2, 3), keepdim=True).sqrt()


def train_data(batches: int = 2000, seed: int = 2) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yields (images (BATCH, 3, 32, 32) float32, labels (BATCH,) int64): noise plus the label's template."""
    templates = class_templates()
    g = torch.Generator().manual_seed(seed)
    for _ in range(batches):
        labels = torch.randint(0, CLASSES, (BATCH,), generator=g)
        noise = torch.randn(BATCH, 3, IMAGE, IMAGE, generator=g)
        yield 0.15 * templates[labels] + noise, labels


def example_inputs() -> tuple[torch.Tensor]:
    return (next(iter(train_data(batches=1)))[0],)


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.float(), target)


def make_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=5e-4)


if __name__ == "__main__":
    net = build_model()
    opt = make_optimizer(net.parameters())
    for step, (x, y) in enumerate(train_data(batches=150)):
        out = net(x)
        loss = loss_fn(out, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 25 == 0:
            acc = (out.argmax(1) == y).float().mean().item()
            print(f"step {step:4d}  loss {loss.item():.3f}  acc {acc:.2f}")
