"""A model file whose loss is so large that every gradient overflows in fp16 at any loss scale: the trainer must
halt with exit code 3, a checkpoint and a diagnosis naming the modules."""
import torch
import torch.nn as nn


def build_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def train_data():
    g = torch.Generator().manual_seed(0)
    for _ in range(1000):
        yield torch.randn(4, 8, generator=g), torch.zeros(4, 1)


def loss_fn(output, target):
    return (output.float() - target).pow(2).mean() * 1e38
