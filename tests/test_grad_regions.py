"""A ``torch.no_grad()`` block of the forward, which torch.export keeps as one ``wrap_with_set_grad_enabled`` call,
is audited op by op (ampaudit/capture/grad_regions.py), and the ops after it keep their shapes."""
from __future__ import annotations

import torch
from torch import nn

import ampaudit
from ampaudit.capture.export_capture import capture_export


class Indexer(nn.Module):
    """A sparse-attention indexer's shape: scores of its own projections, their softmax and top-k."""

    def __init__(self):
        super().__init__()
        self.wq = nn.Linear(64, 64)
        self.wk = nn.Linear(64, 64)

    def forward(self, x):
        scores = torch.matmul(self.wq(x), self.wk(x).transpose(-1, -2))
        return torch.softmax(scores.to(x.dtype), dim=-1).topk(4, dim=-1).indices


class PicksUnderNoGrad(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(64, 64)
        self.idx = Indexer()
        self.out = nn.Linear(64, 64)

    def forward(self, x):
        h = self.proj(x)
        with torch.no_grad():
            picked = self.idx(h)
        g = torch.gather(h, 1, picked[..., :1].expand(-1, -1, 64))
        return self.out(torch.softmax(g, dim=-1))


def test_the_export_graph_holds_the_no_grad_block_s_ops_not_one_call():
    cap = capture_export(PicksUnderNoGrad(), (torch.randn(2, 16, 64),), {})
    targets = [n.target for n in cap.gm.graph.nodes if n.op == "call_function"]
    assert not any("wrap_with_set_grad_enabled" in str(t) for t in targets)
    assert sum(t is torch.ops.aten.topk.default for t in targets) == 1
    [topk] = [n for n in cap.gm.graph.nodes if n.target is torch.ops.aten.topk.default]
    assert "idx" in str(topk.meta.get("nn_module_stack"))     # the block's module path is kept


def test_ops_inside_and_after_a_no_grad_block_are_audited():
    report = ampaudit.check(PicksUnderNoGrad(), torch.randn(2, 16, 64), capture_mode="export")
    assert report.capture == "export"
    assert not [n for n in report.notes if "shapes unknown" in n], report.notes
    softmaxes = sorted(f.module for f in report.findings if f.rule == "AMP201")
    assert softmaxes == ["", "idx"]          # the indexer's own softmax, and the model's after the block
