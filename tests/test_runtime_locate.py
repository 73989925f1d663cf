"""First non-finite origin: planted fp16 faults name EXPECT's culprit, forward and backward."""
from __future__ import annotations


import pytest
import torch
import torch.nn as nn

from ampaudit.runtime.locate import locate_nonfinite, replay

from conftest import load_planted


@pytest.mark.parametrize("name", ["mask_fill", "gelu_cube", "cumsum_pool"])
def test_first_forward_origin_is_expected_culprit(name):
    planted = load_planted(name)
    model = planted.build_model()
    events = locate_nonfinite(model, planted.example_inputs(), {}, device_type="cpu", dtype=torch.float16)
    assert events, f"{name}: no non-finite origin found"
    first = events[0]
    assert first["module"] == planted.EXPECT["culprit"]
    assert first["phase"] == "forward" and first["cause"] == "op" and first["kind"] in ("inf", "nan")
    assert first["op"].startswith("aten.")
    assert first["source"] and first["source"].endswith(".py:" + first["source"].rsplit(":", 1)[1])
    assert f"{name}.py:" in first["source"]


def test_gelu_cube_origin_is_the_cube_even_though_module_output_is_finite():
    planted = load_planted("gelu_cube")
    model = planted.build_model()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        assert torch.isfinite(model(*planted.example_inputs())).all()   # silent: nothing escapes
    events = locate_nonfinite(model, planted.example_inputs(), {})
    assert events[0]["module"] == "mlp.act" and events[0]["op"] == "aten.pow"
    assert events[0]["source"].endswith("gelu_cube.py:8")


def test_raising_forward_is_reported_not_raised():
    planted = load_planted("mask_fill_crash")
    events = locate_nonfinite(planted.build_model(), planted.example_inputs(), {})
    assert len(events) == 1
    ev = events[0]
    assert ev["kind"] == "error" and ev["module"] == planted.EXPECT["culprit"]
    assert ev["op"] == "aten.masked_fill" and "overflow" in ev["message"]
    assert ev["source"].endswith("mask_fill_crash.py:12")


def test_clean_models_give_no_events():
    for name in ("tiny_grads", "misaligned_mlp"):
        planted = load_planted(name)
        assert locate_nonfinite(planted.build_model(), planted.example_inputs(), {}) == []


from _shared_models import BackwardOverflow as _BackwardOverflow


def test_backward_origin_names_module_whose_backward_overflows():
    torch.manual_seed(0)
    model = _BackwardOverflow()
    x = torch.randn(4, 8) * 1e-4
    upstream = [torch.full((4, 1), 1000.0)]
    events = replay(model, (x,), {}, dtype=torch.float16, upstream=upstream)
    backward = [e for e in events if e["phase"] == "backward"]
    assert not [e for e in events if e["phase"] == "forward"]
    assert backward and backward[0]["module"] == "boost" and backward[0]["cause"] == "op"
    assert backward[0]["source"] and backward[0]["source"].endswith("_shared_models.py:28")  # the x * 3000.0 line
    assert all(p.grad is None for p in model.parameters())       # replays never touch .grad


def test_replay_leaves_buffers_and_rng_untouched():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5)).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(8, 4)
    rng = torch.get_rng_state()
    replay(model, (x,), {}, dtype=torch.bfloat16)
    assert torch.equal(torch.get_rng_state(), rng)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_deliberate_inf_constants_are_not_origins():
    import torch
    from torch import nn

    from ampaudit.runtime.locate import locate_nonfinite

    class Masked(nn.Module):
        def forward(self, x):
            neg_inf = torch.scalar_tensor(float("-inf"), dtype=x.dtype)   # as transformers' sdpa masks do
            return torch.where(x > 0, x, neg_inf).clamp(min=-1.0)

    assert locate_nonfinite(Masked(), (torch.randn(4, 8),)) == []


class FloatMaskAttention(nn.Module):
    """doge's dynamic-mask attention in small: an fp32 additive mask of float32's min, which autocast's sdpa (or
    an explicit cast) turns into -inf in the low dtype: still the same mask, unless a row is fully masked."""

    def __init__(self, d: int = 16, masked_rows: int = 0, explicit: bool = False):
        super().__init__()
        self.qkv, self.masked_rows, self.explicit = nn.Linear(d, 3 * d), masked_rows, explicit

    def forward(self, x):
        t = x.shape[1]
        keep = torch.ones(t, t, dtype=torch.bool).tril()
        keep[: self.masked_rows] = False
        mask = torch.zeros(t, t, dtype=x.dtype).masked_fill(~keep, torch.finfo(x.dtype).min)
        q, k, v = self.qkv(x).unsqueeze(1).chunk(3, -1)
        if not self.explicit:
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        scores = q @ k.transpose(-2, -1)
        return torch.softmax(scores + mask.to(scores.dtype), -1) @ v


@pytest.mark.parametrize("explicit", [False, True])
def test_float32_min_mask_cast_to_low_precision_is_no_origin(explicit):
    events = locate_nonfinite(FloatMaskAttention(explicit=explicit), (torch.randn(1, 8, 16),), {},
                              device_type="cpu", dtype=torch.bfloat16)
    assert events == []


def test_fully_masked_row_of_a_cast_mask_is_reported_where_the_nan_appears():
    events = locate_nonfinite(FloatMaskAttention(masked_rows=2, explicit=True), (torch.randn(1, 8, 16),), {},
                              device_type="cpu", dtype=torch.bfloat16)
    assert [(e["op"], e["kind"]) for e in events][:1] == [("aten._softmax", "nan")]


def test_a_cast_that_overflows_an_ordinary_value_is_still_an_origin():
    class Cast(nn.Module):
        def forward(self, x):
            return (x + 3.0e38).to(torch.float16)      # finite in fp32, above fp16's max: a real overflow

    events = locate_nonfinite(Cast(), (torch.ones(4),), {}, device_type="cpu", dtype=torch.bfloat16)
    assert [(e["op"], e["kind"]) for e in events] == [("aten._to_copy", "inf")]


def test_an_overflow_that_moves_to_another_op_when_unscaled_is_not_the_scalers(monkeypatch):
    # The unscaled replay's own backward inf elsewhere keeps the first one a fault; an empty replay excuses it.
    from ampaudit.runtime import locate

    ev = {"phase": "backward", "kind": "inf", "module": "a", "op": "aten.mm", "fp32_too": False}
    moved = [{"phase": "backward", "kind": "inf", "module": "b", "op": "aten.mm"}]
    for replayed, expected in ((moved, False), ([], True)):
        monkeypatch.setattr(locate, "replay", lambda *a, _r=replayed, **k: list(_r))
        out = locate.judge_against_unscaled(nn.Linear(2, 2), [dict(ev)], (torch.ones(1, 2),), scale=1024.0,
                                            upstream=[torch.ones(1, 2)])
        assert out[0]["scaled_only"] is expected
