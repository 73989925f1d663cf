"""Divergence checks in watch: which checks carry the grad and local scopes, the shortcuts that keep a
check cheap (autocast-neutral modules, batched metric sums, the shadow after backward) and what they keep."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from ampaudit.errors import UsageError
from ampaudit.runtime import divergence
from ampaudit.runtime.metric_batch import MetricBatch, metric_sums
from ampaudit.runtime.watch import watch


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Dropout(0.1), nn.LayerNorm(32), nn.Linear(32, 4))


def _loop(model: nn.Module, steps: int, **kw) -> tuple[list[dict], list[float]]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    with watch(model, every=100, dtype=torch.bfloat16, stats=False, **kw) as w:
        for step in range(steps):
            w.set_step(step)
            x = torch.randn(8, 16)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(x)
            loss = out.float().pow(2).mean()
            losses.append(loss.item())
            opt.zero_grad()
            loss.backward()
            opt.step()
    return w.divergence, losses


def _steps(events: list[dict], scope: str) -> set[int]:
    return {e["step"] for e in events if e["scope"] == scope}


def test_defaults_compare_gradients_on_every_eighth_check_and_local_on_every_second():
    div, _ = _loop(_model(), 17, divergence_every=1)
    assert _steps(div, "global") == set(range(17))
    assert _steps(div, "grad") == {0, 8, 16}
    assert _steps(div, "local") == set(range(0, 17, 2))
    params = {e["param"] for e in div if e["scope"] == "grad" and e["step"] == 8}
    assert params == {"0.weight", "0.bias", "3.weight", "3.bias", "4.weight", "4.bias"}


def test_schedules_count_checks_not_steps_and_can_be_changed_or_turned_off():
    div, _ = _loop(_model(), 10, divergence_every=3, grad_divergence_every=2, local_divergence_every=1)
    assert _steps(div, "global") == {0, 3, 6, 9}
    assert _steps(div, "grad") == {0, 6}                 # checks 0 and 2
    assert _steps(div, "local") == {0, 3, 6, 9}
    div, _ = _loop(_model(), 3, divergence_every=1, grad_divergence_every=None, local_divergence_every=None)
    assert {e["scope"] for e in div} == {"global"} and _steps(div, "global") == {0, 1, 2}


def test_every_check_with_schedules_of_one():
    div, _ = _loop(_model(), 3, divergence_every=1, grad_divergence_every=1, local_divergence_every=1)
    for scope in ("global", "local", "grad"):
        assert _steps(div, scope) == {0, 1, 2}, scope


def test_bad_schedules_are_usage_errors():
    for bad in (0, -1, 1.5, "4"):
        with pytest.raises(UsageError):
            watch(nn.Linear(2, 2), divergence_every=1, grad_divergence_every=bad)
        with pytest.raises(UsageError):
            watch(nn.Linear(2, 2), divergence_every=1, local_divergence_every=bad)


def test_the_watch_leaves_the_training_run_unchanged():
    # Same losses with and without divergence checks: the shadow and the local re-runs restore the RNG
    # (dropout masks), buffers and parameters, whichever checks carry which scopes.
    _, watched = _loop(_model(), 6, divergence_every=1, grad_divergence_every=2, local_divergence_every=1)
    _, plain = _loop(_model(), 6)                        # _model() reseeds: same data, same masks
    assert watched == plain and len(plain) == 6


def test_autocast_neutral_modules_get_the_local_result_a_rerun_would_give(monkeypatch):
    # GELU, Dropout and LayerNorm fed fp32 (first in line) stay fp32 under autocast: zero own error, no re-run.
    def first_in_line():
        torch.manual_seed(0)
        return nn.Sequential(nn.GELU(), nn.Dropout(0.1), nn.LayerNorm(16), nn.Linear(16, 4))

    div, _ = _loop(first_in_line(), 1, divergence_every=1)
    shortcut = {e["module"]: e for e in div if e["scope"] == "local"}
    assert set(shortcut) == {"", "0", "1", "2", "3"}        # the root's own code too (check 0 has composites)
    for name in ("0", "1", "2"):
        assert shortcut[name]["rel_l2"] == 0.0 and shortcut[name]["max_abs"] == 0.0
        assert shortcut[name]["cosine"] == 1.0 and shortcut[name]["sqnr_db"] == math.inf
    monkeypatch.setattr(divergence, "AUTOCAST_NEUTRAL", frozenset())
    div, _ = _loop(first_in_line(), 1, divergence_every=1)
    rerun = {e["module"]: e for e in div if e["scope"] == "local"}
    for name in ("0", "1", "2"):
        assert rerun[name]["rel_l2"] == 0.0 and rerun[name]["max_abs"] == 0.0, rerun[name]
    assert rerun["3"]["rel_l2"] > 0 and shortcut["3"]["rel_l2"] == pytest.approx(rerun["3"]["rel_l2"])


def test_neutral_modules_fed_low_precision_are_rerun_on_their_real_input_dtype():
    # After the Linear, GELU/Dropout/LayerNorm receive bf16 and compute in bf16: their own error is measured on
    # that input (FP32 values rounded to bf16), so it is the input's rounding, not zero, and never above 2 u.
    div, _ = _loop(_model(), 1, divergence_every=1)
    local = {e["module"]: e for e in div if e["scope"] == "local"}
    u = torch.finfo(torch.bfloat16).eps / 2
    for name in ("1", "2", "3"):
        assert 0 < local[name]["rel_l2"] < 4 * u, local[name]


def test_a_subclass_of_a_neutral_module_is_rerun():
    class Scaled(nn.GELU):
        def forward(self, x):
            return super().forward(x @ torch.eye(x.shape[-1], device=x.device))   # a matmul autocast lowers

    model = nn.Sequential(nn.Linear(16, 32), Scaled())
    div, _ = _loop(model, 1, divergence_every=1)
    local = {e["module"]: e for e in div if e["scope"] == "local"}
    assert local["1"]["rel_l2"] > 0


def test_shadow_is_skipped_when_the_weights_change_before_the_pass_ends():
    model = _model()
    with watch(model, every=100, dtype=torch.bfloat16, stats=False, divergence_every=1) as w:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(torch.randn(8, 16))                     # a forward with no backward ...
        with torch.no_grad():
            model[0].weight.add_(1.0)                     # ... then the weights change
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(torch.randn(8, 16))
    assert _steps(w.divergence, "global") == {1}


def test_metric_batch_matches_pairwise_sums_including_nan():
    torch.manual_seed(0)
    pairs = []
    for n in (7, 40000, 3000):
        b = torch.randn(n)
        pairs.append(((b + 0.01 * torch.randn(n)).bfloat16(), b))
    batch = MetricBatch(16384)
    idx = [batch.add([p]) for p in pairs] + [batch.add(pairs)]
    bad = (torch.tensor([1.0, math.nan, 2.0]), torch.tensor([1.0, 2.0, 2.0]))
    idx.append(batch.add([bad]))
    assert batch.add([(torch.zeros(0), torch.zeros(0))]) is None
    rows = batch.rows()
    for i, p in zip(idx, [[p] for p in pairs] + [pairs]):
        assert torch.allclose(rows[i], metric_sums(p), rtol=1e-4), (rows[i], metric_sums(p))
    nan_row = rows[idx[-1]].tolist()
    assert math.isnan(nan_row[0]) and nan_row[1] == 9.0      # |b|^2 stays finite
    assert batch.rows() is None                               # cleared


def test_metric_batch_reduces_full_groups_as_they_come():
    # Rows are reduced GROUP at a time while a check runs, so a check never holds more than one group of
    # differences; the rows still come back in the order they were added.
    from ampaudit.runtime.metric_batch import GROUP
    torch.manual_seed(0)
    batch = MetricBatch(1024)
    # Three lengths, interleaved: rows of one length are reduced together, yet come back in order.
    pairs = [(torch.randn(n), torch.randn(n)) for n in [5, 9, 700] * (GROUP + 1)]
    for i, p in enumerate(pairs):
        assert batch.add([p]) == i
        assert all(len(g[0]) < GROUP for g in batch._pending.values())   # a full group is reduced at once
    assert len(batch) == len(pairs)
    rows = batch.rows()
    assert rows.shape == (len(pairs), 5)
    for row, p in zip(rows, pairs):
        assert torch.allclose(row, metric_sums([p]), rtol=1e-4, atol=1e-3)   # a.b of unrelated vectors is small
    assert len(batch) == 0 and batch.rows() is None


def test_every_scope_on_a_batchnorm_model_leaves_training_as_it_was():
    # BatchNorm's FP32 graph saves its running stats: they are put back only after the FP32 backward (earlier,
    # the version bump made that backward raise inside the user's loss.backward()).
    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))

    plain, watched = build(), build()
    torch.manual_seed(1)
    batches = [torch.randn(8, 16) for _ in range(4)]
    for model, kw in ((plain, None), (watched, {"divergence_every": 1, "grad_divergence_every": 1,
                                                "local_divergence_every": 1})):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        w = watch(model, dtype=torch.bfloat16, stats=False, **kw) if kw else None
        for x in batches:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(x).float().pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        if w is not None:
            w.close()
    assert _steps(w.divergence, "grad") == {0, 1, 2, 3}
    assert {e["param"] for e in w.divergence if e["scope"] == "grad"} >= {"1.weight", "1.bias"}
    for (name, a), (_, b) in zip(plain.state_dict().items(), watched.state_dict().items()):
        assert torch.equal(a, b), name                    # weights and running stats: the shadow left no trace


def test_a_failing_check_warns_and_training_goes_on(monkeypatch):
    from ampaudit.runtime.divergence import DivergenceProbe
    from ampaudit.runtime.schedule import DivergenceCheckWarning

    def boom(self, *args, **kwargs):
        raise RuntimeError("the FP32 forward failed")

    monkeypatch.setattr(DivergenceProbe, "shadow", boom)
    with pytest.warns(DivergenceCheckWarning, match=r"step \d+ failed .*FP32 forward failed"):
        div, losses = _loop(_model(), 3, divergence_every=2)
    assert div == [] and len(losses) == 3


def test_the_autocast_neutral_table_lists_real_modules_autocast_never_lowers():
    from ampaudit.policy import Policy, op_names
    names = op_names()["autocast_neutral"]["modules"]
    assert len(divergence.AUTOCAST_NEUTRAL) == len(names)            # every name is an nn module class
    mapped = op_names()["modules"]
    for device in ("cpu", "cuda"):
        policy = Policy.load(device, "float16")
        lowered = [n for n in names if n in mapped and policy.category(mapped[n]) == "lower"]
        assert not lowered, (device, lowered)
    assert nn.Linear not in divergence.AUTOCAST_NEUTRAL and nn.LayerNorm in divergence.AUTOCAST_NEUTRAL


def test_samples_of_a_view_start_where_the_view_does():
    # q, k and v split from one qkv output are views with a storage offset: a strided sample must read
    # their own elements, in the order a flattened copy has them.
    from ampaudit.runtime.metric_batch import sample, sample_copy
    base = torch.arange(40.0)
    view = base[10:30]
    assert view.storage_offset() == 10 and view.is_contiguous()
    expected = view.reshape(-1)[::4].clone()
    assert torch.equal(sample(view, 5), expected) and torch.equal(sample_copy(view, 5), expected)
    strided = base.view(8, 5).t()                          # not contiguous: the flattened order is the view's
    assert torch.equal(sample_copy(strided, 10), strided.reshape(-1)[::4])
    copy = sample_copy(view, 5)
    view.zero_()                                           # a copy: later in-place changes do not reach it
    assert torch.equal(copy, expected) and copy.sum() > 0
