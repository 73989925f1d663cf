"""GEMM work per node, from the propagated shapes: what weights an alignment finding."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from ampaudit.analysis.gemm_cost import gemm_macs, gemm_share
from ampaudit.api import audit


class Mixed(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(8, 16, 3, padding=1)
        self.fc = nn.Linear(16, 30)

    def forward(self, x):
        h = self.conv(x).mean((2, 3))                 # (2, 16)
        q = self.fc(h)                                # (2, 30)
        return q.unsqueeze(-1) @ q.unsqueeze(1)       # (2, 30, 30): a batched GEMM with K = 1


def test_macs_of_conv_linear_and_matmul_and_shares_sum_to_one():
    aud = audit(Mixed(), torch.randn(2, 8, 10, 10), device="cuda")
    gm, root = aud.capture.gm, aud.capture.root
    macs = {n.meta["amp"].op: gemm_macs(n, root) for n in gm.graph.nodes if n.op != "placeholder"
            and gemm_macs(n, root) is not None}
    assert macs["conv2d"] == 2 * 16 * 10 * 10 * 8 * 9
    assert macs["linear"] == 2 * 16 * 30
    assert macs["matmul"] == 2 * 30 * 30 * 1
    shares = [gemm_share(gm, root, n) for n in gm.graph.nodes if gemm_macs(n, root) is not None]
    assert sum(shares) == pytest.approx(1.0)
