"""bench/runtime_corpus.py's core: a watched bf16 training run on one tiny model and the report's warnings by kind
(no model zoo needed)."""
from __future__ import annotations

import json
import sys

import torch
from torch import nn

from conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))

import runtime_corpus as rc  # noqa: E402
from ampaudit.report.trace_summary import summarize_trace  # noqa: E402
from ampaudit.runtime.replay_state import float_tensors  # noqa: E402


class TinyLM(nn.Module):
    """Embedding, one attention block, a head; a dict output like a transformers ModelOutput."""

    def __init__(self, overflow: bool = False):
        super().__init__()
        self.emb = nn.Embedding(64, 16)
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.head = nn.Linear(16, 64)
        self.overflow = overflow

    def forward(self, input_ids):
        x = self.emb(input_ids)
        x = x + self.attn(x, x, x, need_weights=False)[0]
        logits = self.head(x)
        if self.overflow:           # past bf16's (and FP32's) range: the report must say non-finite
            logits = logits * 1e38 * 1e10
        return {"logits": logits, "ids": input_ids}


def _run(tmp_path, model):
    torch.manual_seed(0)
    trace = tmp_path / "run.jsonl"
    rc.train_watched(model, (), {"input_ids": torch.randint(0, 64, (2, 8))}, trace, 3)
    return trace, rc.count_warnings(summarize_trace(trace))


def test_healthy_tiny_model_trains_watched_and_reports_no_warning(tmp_path):
    trace, found = _run(tmp_path, TinyLM())
    events = [json.loads(line) for line in trace.read_text().splitlines()]
    # Every part ran: the FP32 shadow with own errors, the statistics and the precursors.
    kinds = {(e["event"], e.get("scope")) for e in events}
    assert {("divergence", "local"), ("divergence", "global"), ("stats", None), ("precursor", None)} <= kinds
    assert found == {"counts": dict.fromkeys(rc.KINDS, 0), "warnings": []}


def test_overflowing_model_is_counted_as_nonfinite(tmp_path):
    _trace, found = _run(tmp_path, TinyLM(overflow=True))
    assert found["counts"]["nonfinite"] >= 1
    assert any(w["kind"] == "nonfinite" for w in found["warnings"])


def test_keep_fp32_is_split_by_its_evidence():
    culprit = {"module": "mlp.fc", "rel_l2": 0.2, "rule": "absolute", "line": 0.125, "why": "own error 0.2"}
    summary = {"divergence": {"culprits": [culprit]}, "recommendations": [
        {"kind": "keep_fp32", "severity": "warning", "modules": ["mlp.fc", "head"],
         "message": "keep in fp32: mlp.fc (own rel_l2 0.2 vs FP32: own error 0.2), head (forward headroom 0.50 bits "
                    "at step 1)."},
        {"kind": "precursor", "severity": "warning", "signal": "attn_logit", "message": "attention logits grow"},
        {"kind": "bf16", "severity": "info", "message": "an info is not counted"}]}
    found = rc.count_warnings(summary)
    assert found["counts"] == {**dict.fromkeys(rc.KINDS, 0), "own_error": 1, "range": 1, "precursors": 1}
    assert [(w["kind"], w["module"]) for w in found["warnings"]] == [
        ("own_error", "mlp.fc"), ("range", "head"), ("precursors", "attn_logit")]
    assert found["warnings"][1]["what"] == "forward headroom 0.50 bits at step 1"


def test_loss_is_the_mean_of_the_float_outputs_that_need_grad():
    w = torch.ones(3, requires_grad=True)
    out = {"a": w * 2, "b": (w * 4, torch.arange(3)), "c": None}
    assert rc.loss_of(out).item() == 6.0
    assert len(float_tensors(out)) == 2                      # the watch's own reading of outputs


def test_batched_grows_one_sample_inputs_and_keeps_the_first():
    x, ids = torch.randn(1, 3, 8, 8) * 5 + 2, torch.tensor([[1, 2, 3]])
    (bx, bids), kw = rc.batched(((x, ids), {"mask": torch.ones(1, 3, dtype=torch.bool), "n": 4}), 3)
    assert bx.shape == (3, 3, 8, 8) and torch.equal(bx[0], x[0]) and not torch.equal(bx[1], x[0])
    assert abs(bx[1:].std().item() - x.std().item()) < 0.5 * x.std().item()     # fresh samples, the same spread
    assert torch.equal(bids, ids.repeat(3, 1)) and kw["mask"].shape == (3, 3) and kw["n"] == 4
    # A training-mode BatchNorm over a pooled 1 x 1 map (DeepLab's ASPP) refuses one sample and takes these.
    bn = nn.BatchNorm2d(3).train()
    bn(nn.functional.adaptive_avg_pool2d(bx, 1))
    assert rc.batched((x,), 1)[0] is x
