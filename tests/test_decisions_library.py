"""The line of a decision site (AMP702, the watch's ``decision`` events) is the model's code: the user's own file,
else an installed library's (a transformers router in its modeling file), never the line of the script that
called check or the measurement (as for non-finite origins: tests/test_runtime_locate_library.py)."""
from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

import ampaudit
from ampaudit.runtime.decision_record import measure_decisions

LIBRARY = '''
import torch
from torch import nn


class Router(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(64, 128)

    def forward(self, x):
        logits = self.gate(x)
        return logits.gather(-1, logits.topk(64, -1).indices)


def route(x):
    return x.topk(2, -1).indices
'''


@pytest.fixture
def library(installed_library):
    return installed_library("tinyrouter", LIBRARY)


def test_a_library_models_decision_is_its_own_line(library):
    torch.manual_seed(0)
    rows = measure_decisions(library.Router(), (torch.randn(512, 64),), {})
    assert [r["op"] for r in rows] == ["topk"] and rows[0]["source"].endswith("tinyrouter.py:13")


def test_a_library_models_decision_finding_names_its_line_not_the_callers(library):
    torch.manual_seed(0)
    report = ampaudit.check(library.Router(), torch.randn(512, 64), device="cpu", dtype="bfloat16",
                            calibrate=True, select=["AMP702"])
    found = [f for f in report.findings if f.rule == "AMP702"]
    assert found and all(f.details["source"].endswith("tinyrouter.py:13") for f in found)
    # The message names the file alone (the where column and the location carry the path below site-packages).
    assert all("topk at tinyrouter.py:13 differ" in f.message and "site-packages" not in f.message for f in found)


class Own(nn.Module):
    def __init__(self, route):
        super().__init__()
        self.gate, self.route = nn.Linear(64, 16), route

    def forward(self, x):
        return self.route(self.gate(x)), self.gate(x).argmax(-1)   # the user's line for argmax


def test_the_users_own_line_comes_before_a_library_helpers(library):
    torch.manual_seed(0)
    rows = {r["op"]: r["source"] for r in measure_decisions(Own(library.route), (torch.randn(512, 64),), {})}
    line = inspect.getsourcelines(Own.forward)[1] + 1
    assert rows["topk"].endswith(f"test_decisions_library.py:{line}")      # the user's call of the helper
    assert rows["argmax"].endswith(f"test_decisions_library.py:{line}")
