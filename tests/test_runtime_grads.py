"""One attribution of non-finite gradients for watch, callbacks and the trainer."""
import torch
from torch import nn

from ampaudit.runtime.grads import from_flags, nonfinite_grads


def test_params_in_order_modules_sorted_and_one_read():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    model(torch.randn(3, 2)).sum().backward()
    model[1].bias.grad[0] = float("inf")
    model[0].weight.grad[0, 0] = float("nan")
    assert nonfinite_grads(model.named_parameters()) == {"params": ["0.weight", "1.bias"], "modules": ["0", "1"]}
    assert from_flags(["w", "fc.b"], torch.tensor([True, True])) == {"params": ["w", "fc.b"], "modules": ["", "fc"]}
    assert nonfinite_grads(nn.Linear(2, 2).named_parameters()) == {"params": [], "modules": []}
