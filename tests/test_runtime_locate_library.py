"""The line of a non-finite origin is the model's code: the user's own file, else an installed library's (a
transformers model's modeling file), never the line of the script that called the locator."""
from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

from ampaudit.runtime.locate import replay

LIBRARY = '''
import torch
from torch import nn


class Blow(nn.Module):
    def forward(self, x):
        y = x * 1e30
        return y * 1e30


class SqrtGap(nn.Module):
    def forward(self, x):
        return torch.sqrt(x - x.detach())


class Raises(nn.Module):
    def forward(self, x):
        raise RuntimeError("boom")


def helper(x):
    return x * 1e30
'''


@pytest.fixture
def library(installed_library):
    """tinylib, installed as transformers is (conftest.installed_library)."""
    return installed_library("tinylib", LIBRARY)


def test_a_library_models_forward_origin_is_its_own_line(library):
    events = replay(library.Blow(), (torch.ones(4),), autocast=False)
    assert events[0]["kind"] == "inf" and events[0]["source"].endswith("tinylib.py:9")


def test_a_library_models_backward_origin_is_its_own_line(library):
    x = torch.ones(4, requires_grad=True)
    model = nn.Sequential(nn.Linear(4, 4), library.SqrtGap())
    events = replay(model, (x,), autocast=False, loss=lambda out: out.sum())
    back = [e for e in events if e["phase"] == "backward"]
    assert back and back[0]["source"].endswith("tinylib.py:14")


def test_a_library_models_raise_is_its_own_line(library):
    events = replay(library.Raises(), (torch.ones(4),), autocast=False)
    assert events[0]["kind"] == "error" and events[0]["source"].endswith("tinylib.py:19")


class Own(nn.Module):
    def __init__(self, helper):
        super().__init__()
        self.helper = helper

    def forward(self, x):
        return self.helper(x) * 1e30    # the user's line, though the library's helper is innermost


def test_the_users_own_line_comes_before_a_library_helpers(library):
    events = replay(Own(library.helper), (torch.ones(4),), autocast=False)
    line = inspect.getsourcelines(Own.forward)[1] + 1
    assert events[0]["source"].endswith(f"test_runtime_locate_library.py:{line}")


def test_a_model_of_torch_modules_only_has_no_line_not_the_callers():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with torch.no_grad():
        model[0].weight.fill_(1e30)
    events = replay(model, (torch.full((1, 4), 1e30),), autocast=False)
    assert events and all(e["source"] is None for e in events)
