"""Meta-device propagation runs each op signature's meta kernel once, and gives the same shapes as running it."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ampaudit.analysis.amp_prop import AMP_KEY, AmpProp
from ampaudit.analysis.meta_memo import MetaMemo
from ampaudit.capture import capture_export
from ampaudit.policy import Policy

aten = torch.ops.aten


def _meta(*shape):
    return torch.empty(*shape, device="meta")


def test_same_signature_is_rebuilt_not_rerun():
    memo = MetaMemo()
    x, g = _meta(2, 3, 8, 8), _meta(2, 5, 5, 2)
    first = memo.call(aten.grid_sampler.default, (x, g, 0, 0, True), {})
    again = memo.call(aten.grid_sampler.default, (_meta(2, 3, 8, 8), _meta(2, 5, 5, 2), 0, 0, True), {})
    other = memo.call(aten.grid_sampler.default, (x, _meta(2, 4, 4, 2), 0, 0, True), {})
    assert len(memo._seen) == 2
    assert again is not first and again.shape == first.shape == (2, 3, 5, 5)
    assert again.stride() == first.stride() and again.dtype == first.dtype and again.is_meta
    assert other.shape == (2, 3, 4, 4)
    # A scalar argument is part of the signature: align_corners is not taken from the first call.
    memo.call(aten.grid_sampler.default, (x, g, 0, 0, False), {})
    assert len(memo._seen) == 3


def test_views_inplace_and_non_meta_calls_run_as_usual():
    memo = MetaMemo()
    x = _meta(4, 6)
    view = memo.call(aten.view.default, (x, [6, 4]), {})
    assert view._base is x                                # a view stays a view of its input
    assert memo.call(aten.add_.Tensor, (x, x), {}) is x     # in place returns its input
    cpu = torch.ones(3)
    assert torch.equal(memo.call(aten.mul.Tensor, (cpu, 2.0), {}), torch.full((3,), 2.0))
    assert memo._seen == {}


class Warp(nn.Module):
    """A grid_sample per refinement step on the same shapes, as RAFT's correlation lookup."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x, grid):
        h = self.conv(x)
        for _ in range(3):
            h = h + F.grid_sample(h, grid, align_corners=True).mean() * h
        return h


def _shapes(device):
    torch.manual_seed(0)
    with torch.device(device):
        model = Warp()
    x, grid = torch.rand(1, 3, 8, 8, device=device), torch.rand(1, 8, 8, 2, device=device) * 2 - 1
    cap = capture_export(model, (x, grid), {})
    AmpProp(cap.gm, Policy.load("cuda", "float16")).propagate(x, grid)
    return [(n.name, n.meta[AMP_KEY].shape, n.meta[AMP_KEY].dtype) for n in cap.gm.graph.nodes if AMP_KEY in n.meta]


def test_meta_propagation_gives_the_shapes_fake_propagation_gives():
    assert _shapes("meta") == _shapes("cpu")
