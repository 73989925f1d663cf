"""A model built on meta is exported as its autocast forward would run: dtype-aware constants are the target's."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import ampaudit
from ampaudit.capture.export_capture import capture_export
from ampaudit.policy import Policy


class MaskFill(nn.Module):
    """Attention scores with masked positions filled: by the key's own dtype's min (``fill="key"``, as
    transformers' create_position_bias_mask), by the fp32 input's (``"input"``), or by a literal ``-1e9``."""

    def __init__(self, fill: str):
        super().__init__()
        self.fill = fill
        self.q, self.k = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x, mask):
        query, key = self.q(x), self.k(x)
        scores = query @ key.transpose(-1, -2)     # fp16 under fp16 autocast
        fill = {"key": lambda: torch.finfo(key.dtype).min, "input": lambda: torch.finfo(x.dtype).min,
                "literal": lambda: -1e9}[self.fill]()
        return torch.where(mask, scores, fill).softmax(-1)


def _check(fill: str, device: str):
    with torch.device(device):
        model = MaskFill(fill)
    x, mask = torch.randn(2, 8, 16, device=device), torch.ones(2, 8, 8, dtype=torch.bool, device=device)
    report = ampaudit.check(model, x, mask, capture_mode="export")
    assert report.capture == "export"
    return [f for f in report.findings if f.rule == "AMP401"]


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_finfo_of_an_autocast_tensor_is_the_low_dtypes_min(device):
    # Under fp16 autocast the key is fp16, so its finfo min (-65504) is one fp16 holds: no finding, on meta too.
    assert _check("key", device) == []


@pytest.mark.parametrize("fill", ["input", "literal"])
def test_a_constant_fp16_cannot_hold_still_fires_on_meta(fill):
    # The fp32 input's min (as inkling_text's fp32 key) and a literal -1e9 overflow fp16 in the fp16 scores.
    found = _check(fill, "meta")
    assert found and found[0].severity == "error" and "where" in found[0].message


def test_meta_export_puts_the_meta_weights_back():
    with torch.device("meta"):
        model = MaskFill("key")
    x, mask = torch.randn(2, 8, 16, device="meta"), torch.ones(2, 8, 8, dtype=torch.bool, device="meta")
    cap = capture_export(model, (x, mask), {}, policy=Policy.load("cuda", "float16"))
    assert all(p.is_meta for p in model.parameters()) and all(p.is_meta for p in cap.gm.parameters())
    where = next(n for n in cap.gm.graph.nodes if n.target is torch.ops.aten.where.ScalarOther)
    assert where.args[2] == torch.finfo(torch.float16).min
    assert not any(isinstance(v, torch.device) and v.type == "cpu"
                   for n in cap.gm.graph.nodes for v in (*n.args, *n.kwargs.values()))


class Attention(nn.Module):
    """Heads through scaled_dot_product_attention, whose CPU kernel lays its output out so that the
    ``.contiguous()`` after the transpose is a no-op in the export, while its meta kernel's layout needs it."""

    def __init__(self):
        super().__init__()
        self.qkv, self.out = nn.Linear(32, 96), nn.Linear(32, 32)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, 2, 16).permute(2, 0, 3, 1, 4)
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return self.out(o.transpose(1, 2).contiguous().view(b, n, 32))


def test_a_meta_models_shapes_propagate_past_views_the_export_strides_allowed():
    with torch.device("meta"):
        model = Attention()
    report = ampaudit.check(model, torch.randn(2, 12, 32, device="meta"), capture_mode="export")
    assert report.capture == "export" and not any("shapes unknown" in n for n in report.notes), report.notes
    assert any(f.rule == "AMP104" and "scaled_dot_product_attention" in f.message for f in report.findings)


class Rotary(nn.Module):
    """A non-persistent buffer (rotary frequencies): the exported program keeps it among its constants."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.register_buffer("inv_freq", torch.arange(16.0), persistent=False)

    def forward(self, x):
        return self.fc(x) * self.inv_freq


def test_meta_export_puts_non_persistent_buffers_back():
    with torch.device("meta"):
        model = Rotary()
    cap = capture_export(model, (torch.randn(2, 16, device="meta"),), {}, policy=Policy.load("cuda", "float16"))
    assert model.inv_freq.is_meta and all(t.is_meta for t in cap.gm.buffers())
    report = ampaudit.check(model, torch.randn(2, 16, device="meta"), capture_mode="export")
    assert not any("shapes unknown" in n for n in report.notes), report.notes
