"""Decisions flipped by precision (ampaudit.runtime.decisions, decision_record): the comparison of each kind against
hand-computed cases (FP32 ties are not flips, top-k compares sets, sort compares ranks, comparisons on the threshold
are ties), what counts as a decision (floating inputs only) and as used by the forward."""
from __future__ import annotations

import torch
import torch.nn as nn

from ampaudit.runtime.decision_record import measure_decisions
from ampaudit.runtime.decisions import SAMPLE, bind, decision_kinds, decision_of, flagged, flips, kept
from trace_events import ev


def _flips(op, out, low, **bound):
    kind = decision_kinds()[op]
    flipped, total = flips(kind, op, bound, out, kept(kind, low))
    return int(flipped), total


def test_argmax_ties_in_fp32_are_not_flips():
    values = torch.tensor([[1.0, 1.0, 0.0], [0.0, 2.0, 1.0]])
    ref = torch.tensor([0, 1])
    low = torch.tensor([1, 2])        # row 0: the other of two equal maxima; row 1: a smaller value
    assert _flips("argmax", ref, low, self=values, dim=1, keepdim=False) == (1, 2)


def test_argmax_without_dim_and_max_dim_indices():
    values = torch.tensor([[0.0, 3.0], [3.0, 1.0]])
    assert _flips("argmax", torch.tensor(1), torch.tensor(2), self=values, dim=None, keepdim=False) == (0, 1)
    assert _flips("argmax", torch.tensor(1), torch.tensor(3), self=values, dim=None, keepdim=False) == (1, 1)
    out = values.max(1, keepdim=True)
    assert _flips("max", out, torch.tensor([[0], [0]]), self=values, dim=1, keepdim=True) == (1, 2)


def test_topk_compares_sets_not_order_and_ignores_ties_at_the_boundary():
    values = torch.tensor([[3.0, 2.0, 1.0, 0.0], [3.0, 2.0, 2.0, 0.0], [3.0, 2.0, 1.0, 0.0]])
    out = values.topk(2, -1)                                   # indices [[0, 1], [0, 1], [0, 1]]
    low = torch.tensor([[1, 0],                                # same set, other order: no flip
                        [0, 2],                                # index 2 ties index 1 in FP32: no flip
                        [0, 2]])                               # 1.0 instead of 2.0: a flip
    assert _flips("topk", out, low, self=values, k=2, dim=-1, largest=True, sorted=True) == (1, 3)


def test_sort_counts_rank_changes_and_not_swaps_of_equal_values():
    values = torch.tensor([1.0, 3.0, 2.0, 3.0])
    out = values.sort(descending=True)                         # values [3, 3, 2, 1]
    low = torch.tensor([3, 1, 0, 2])                           # the two 3s swapped (no change), then 1 before 2
    assert _flips("sort", out, low, self=values, dim=-1, descending=True) == (2, 4)


def test_comparison_on_the_threshold_is_a_tie_but_eq_counts_every_difference():
    x = torch.tensor([0.5, 0.6, 0.4])
    ref = x > 0.5                                              # [F, T, F]
    low = torch.tensor([True, True, True])                     # 0.5 sits on the threshold; 0.4 flipped
    assert _flips("gt", ref, low, self=x, other=0.5) == (1, 3)
    a, b = torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.5])
    assert _flips("eq", a == b, torch.tensor([False, True]), self=a, other=b) == (2, 2)


def test_round_and_bucket_compare_results_with_nan_equal_to_nan():
    ref = torch.tensor([1.0, 2.0, float("nan")])
    low = torch.tensor([1.0, 3.0, float("nan")], dtype=torch.bfloat16)
    assert _flips("round", ref, low, self=ref) == (1, 3)
    x = torch.tensor([0.1, 0.9])
    edges = torch.tensor([0.5])
    assert _flips("bucketize", torch.bucketize(x, edges), torch.tensor([0, 0]), self=x, boundaries=edges) == (1, 2)


def test_large_elementwise_decisions_are_compared_on_an_even_sample():
    x = torch.linspace(-1, 1, 1 << 20).reshape(1024, 1024)
    ref = x > 0
    low = ref.clone()
    low[:, ::10] = ~low[:, ::10]                               # every 10th column flipped: 10% of the elements
    assert kept("compare", low).numel() <= SAMPLE
    flipped, total = _flips("gt", ref, low, self=x, other=0.0)
    assert total <= SAMPLE and abs(flipped / total - 0.1) < 0.01
    small = torch.tensor([[0.2, -0.3]])
    assert _flips("gt", small > 0, torch.tensor([[True, True]]), self=small, other=0.0) == (1, 2)


def test_only_floating_inputs_make_decisions():
    ints = torch.arange(4)
    assert decision_of("compare", "gt", {"self": ints, "other": 2}, ints > 2) is None
    assert decision_of("index", "max", {"self": ints.float()}, ints.float().max()) is None   # a value, not a choice
    f = torch.tensor([[1.0, 2.0]])
    assert decision_of("index", "max", {"self": f, "dim": 1}, f.max(1)).tolist() == [1]
    assert decision_of("compare", "lt", {"self": ints, "other": torch.tensor(1.5)}, ints < 1.5) is not None


def test_bind_fills_schema_defaults():
    b = bind(torch.ops.aten.topk.default, (torch.zeros(3), 2), {})
    assert b["dim"] == -1 and b["largest"] is True and b["k"] == 2


def test_flagged_needs_use_share_and_count():
    row = {"used": True, "flipped": 10, "share_flipped": 0.05}
    assert flagged(row, (0.01, 4))
    assert not flagged({**row, "used": False}, (0.01, 4))
    assert not flagged({**row, "flipped": 3}, (0.01, 4))
    assert not flagged({**row, "share_flipped": 0.005}, (0.01, 4))


class _Argmax(nn.Module):
    """A bf16 classifier head: its argmax is returned, or (use=True) gathers from a table."""

    def __init__(self, use: bool):
        super().__init__()
        torch.manual_seed(0)
        self.head, self.use = nn.Linear(64, 32), use
        self.table = nn.Parameter(torch.randn(32, 4))

    def forward(self, x):
        pred = self.head(x).argmax(-1)
        if self.use:
            return self.table[pred.view(-1)]         # followed through the view, used by the index
        return pred.view(-1)                          # a view of it is only returned


def test_a_returned_decision_is_measured_but_not_used():
    x = torch.randn(256, 64, generator=torch.Generator().manual_seed(1))
    (row,) = measure_decisions(_Argmax(False), (x,), device_type="cpu", dtype=torch.bfloat16)
    assert row["op"] == "argmax" and row["module"] == "" and not row["used"] and row["decisions"] == 256
    assert row["source"].endswith("test_decisions.py:" + str(_Argmax.forward.__code__.co_firstlineno + 1))
    (row,) = measure_decisions(_Argmax(True), (x,), device_type="cpu", dtype=torch.bfloat16)
    assert row["used"]


class _Counted(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.forwards = nn.Linear(8, 8), 0

    def forward(self, x):
        self.forwards += 1
        t = torch.arange(x.shape[0])
        return self.fc(x).masked_fill((t[:, None] > t[None, :])[..., :8], 0.0)   # an integer comparison only


def test_a_model_without_float_decisions_costs_one_forward():
    m = _Counted()
    assert measure_decisions(m, (torch.randn(8, 8),), device_type="cpu", dtype=torch.bfloat16) == []
    assert m.forwards == 1


class _Noisy(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.bn, self.drop = nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.5)

    def forward(self, x):
        h = self.drop(self.bn(self.fc(x)))
        return h * (h > 0.1)                          # a float mask, used: both forwards run


def test_rng_and_buffers_are_left_as_they_were_and_both_runs_share_dropout():
    m = _Noisy().train()
    x = torch.randn(16, 8)
    before, state = m.bn.running_mean.clone(), torch.get_rng_state()
    (row,) = measure_decisions(m, (x,), device_type="cpu", dtype=torch.bfloat16)
    assert torch.equal(m.bn.running_mean, before) and torch.equal(torch.get_rng_state(), state)
    # Same dropout masks in both runs: what dropout zeroed is exactly 0 in both, so only kept values can flip.
    assert row["used"] and row["flipped"] <= 0.1 * row["decisions"]


def test_bind_maps_keyword_only_arguments_by_name():
    b = bind(torch.ops.aten.sort.stable, (torch.zeros(3),), {"stable": True, "descending": True})
    assert b["stable"] is True and b["descending"] is True and b["dim"] == -1


class _InPlaceQuant(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(32, 64)

    def forward(self, x):
        h = self.fc(x)
        q = (h * 100.0).round_()                      # in place, on a bf16 product under autocast
        return q / 100.0


def test_in_place_rounding_is_a_decision_too():
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(3))
    (row,) = measure_decisions(_InPlaceQuant(), (x,), device_type="cpu", dtype=torch.bfloat16)
    assert row["op"] == "round_" and row["kind"] == "round" and row["used"] and row["share_flipped"] > 0.05


def test_calibration_sums_decisions_over_batches():
    from ampaudit.analysis.calibrate import merge_decisions

    into: list[dict] = []
    row = {"module": "r", "op": "topk", "source": "m.py:3", "kind": "topk", "what": "w", "decisions": 100,
           "flipped": 1, "share_flipped": 0.01, "used": False, "calls": 1}
    merge_decisions(into, [row])
    merge_decisions(into, [{**row, "flipped": 5, "share_flipped": 0.05, "used": True}])
    assert len(into) == 1 and into[0]["decisions"] == 200 and into[0]["flipped"] == 6
    assert into[0]["share_flipped"] == 0.03 and into[0]["used"] and into[0]["calls"] == 2
    assert row["decisions"] == 100                   # the first batch's row is not modified


def test_report_reads_malformed_and_older_decision_events_without_raising():
    from ampaudit.report.trace_summary import summarize

    meta = ev("meta", version=2, dtype="bfloat16")
    good = ev("decision", 4, module="moe.router", op="topk", source="m.py:9", kind="topk", decisions=512,
              flipped=18, share_flipped=0.035, used=True, calls=1)
    bad = [{"event": "decision", "step": 5, "module": 3, "decisions": "inf", "flipped": None, "share_flipped": "x"},
           {"event": "decision"}]
    s = summarize([meta, ev("step", 1, loss=1.0), good, *bad])
    assert [r["module"] for r in s["decisions"]["flagged"]] == ["moe.router"]
    assert s["decisions"]["sites"] == 2 and not s["unknown_events"]
    (rec,) = [r for r in s["recommendations"] if r["kind"] == "decisions"]
    assert "3.5% of the 512 decisions of moe.router (topk at m.py:9)" in rec["message"]
    assert rec["code"] == 'ampaudit.keep_fp32(model, ["moe.router"])'
    quiet = summarize([meta, {**good, "used": False}, {**good, "module": "b", "flipped": 3, "share_flipped": 0.5}])
    assert not quiet["decisions"]["flagged"] and not [r for r in quiet["recommendations"] if r["kind"] == "decisions"]


def test_console_section_says_which_sites_are_used():
    import io

    from rich.console import Console

    from ampaudit.report.trace_decisions import render_decisions

    base = {"step": 2, "source": "m.py:3", "kind": "index", "what": "rows pick another index", "decisions": 100,
            "checks": 1}
    dec = {"sites": 3,
           "flagged": [{**base, "module": "router", "op": "topk", "flipped": 9, "share_flipped": 0.09, "used": True}],
           "quiet": [{**base, "module": "mask", "op": "gt", "flipped": 0, "share_flipped": 0.0, "used": True},
                     {**base, "module": "", "op": "argmax", "flipped": 3, "share_flipped": 0.03, "used": False}]}
    out = io.StringIO()
    render_decisions(dec, Console(file=out, width=200))
    text = out.getvalue()
    assert "9.0% of 100: router (topk at m.py:3)" in text and "1 used site(s) below the line (at most 0.0%" in text
    assert "1 site(s) only returned, not used by the forward (at most 3.0% flipped): <top> (argmax" in text
