"""keep_fp32: named modules of an eager model compute in fp32 under autocast; nothing else changes."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from ampaudit.errors import UsageError
from ampaudit.precision.keep_fp32 import keep_fp32


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, x):
        return self.norm(self.fc(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _dtypes(model, x):
    seen = {}
    hooks = [m.register_forward_hook(lambda m, a, o, n=n: seen.update({n: o.dtype}))
             for n, m in model.named_modules() if n]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        model(x)
    for h in hooks:
        h.remove()
    return seen


def test_named_module_runs_in_fp32_under_autocast():
    torch.manual_seed(0)
    model, x = Net(), torch.randn(4, 8)
    keys = list(model.state_dict())
    ref = model(x)
    assert keep_fp32(model, ["blocks.1"]) is model
    seen = _dtypes(model, x)
    assert seen["blocks.0.fc"] == torch.bfloat16      # untouched modules still autocast
    assert seen["blocks.1.fc"] == torch.float32       # the kept block's GEMM runs in fp32
    assert seen["blocks.1"] == torch.float32
    assert seen["head"] == torch.bfloat16             # autocast resumes after it
    assert list(model.state_dict()) == keys
    assert torch.equal(model(x), ref)                 # without autocast nothing changes


def test_patterns_globs_and_classes():
    model = Net()
    keep_fp32(model, ["blocks.*.fc", nn.LayerNorm])
    seen = _dtypes(model, torch.randn(2, 8))
    assert seen["blocks.0.fc"] == seen["blocks.1.fc"] == torch.float32
    assert seen["blocks.0.norm"] == torch.float32 and seen["head"] == torch.bfloat16
    keep_fp32(model, "blocks.0.fc")                   # again: idempotent
    assert type(model.blocks[0].fc).__mro__.count(nn.Linear) == 1


def test_unmatched_pattern_is_a_usage_error():
    with pytest.raises(UsageError) as info:
        keep_fp32(Net(), ["encoder.attn"])
    assert "matches no module" in info.value.one_line() and "blocks" in info.value.one_line()


def test_keep_fp32_serves_models_fix_cannot_trace():
    from conftest import ASSETS

    from ampaudit.loading import load_target

    t = load_target(str(ASSETS / "bad" / "untraceable.py"))
    keep_fp32(t.model, ["fc"])
    x = torch.randn(2, 8).abs()          # positive sum: the data-dependent branch runs fc
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        assert t.model(x).dtype == torch.float32
