"""One unwrap for every wrapper training puts around a model."""
from __future__ import annotations

import torch
from torch import nn

from ampaudit.wrappers import unwrap


def test_unwrap_peels_data_parallel_and_compile_nested():
    inner = nn.Linear(4, 4)
    assert unwrap(inner) is inner
    assert unwrap(nn.DataParallel(inner)) is inner
    compiled = torch.compile(nn.DataParallel(inner), backend="eager")
    assert unwrap(compiled) is inner


def test_a_module_with_a_module_attribute_is_not_a_wrapper():
    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.module = nn.Linear(2, 2)

    h = Holder()
    assert unwrap(h) is h
