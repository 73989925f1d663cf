import torch


def build_model():
    raise ValueError("config missing hidden_size")


def example_inputs():
    return (torch.randn(2, 8),)
