"""FP32 islands: every planted numerical fault is fixed under CPU fp16 autocast, FP32 outputs do not change,
checkpoints still load, islands merge only where it is cycle-safe, and untraceable models point to keep_fp32."""
from __future__ import annotations

import pytest
import torch
from conftest import ASSETS, PLANTED, SAMPLES

import ampaudit
from ampaudit.errors import CaptureError
from ampaudit.loading import load_target
from ampaudit.rewrite import fix
from ampaudit.rewrite.island_insert import ISLAND_KEY

FAULTS = ["mask_fill", "mask_fill_crash", "gelu_cube", "cumsum_pool", "bn_running_var"]


def _outputs(model, args, kwargs, autocast: bool):
    torch.manual_seed(0)
    with torch.no_grad():
        if autocast:
            with torch.autocast("cpu", dtype=torch.float16):
                return model(*args, **kwargs)
        return model(*args, **kwargs)


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref).abs().max() / ref.abs().max())


@pytest.mark.parametrize("name", FAULTS)
def test_planted_fault_fixed_and_fp32_unchanged(name):
    if not PLANTED.is_dir():
        pytest.skip("planted models not found")
    t = load_target(str(PLANTED / f"{name}.py"))
    before = {k: v.clone() for k, v in t.model.state_dict().items()}
    result = fix(t.model, *t.args, device="cpu", dtype="float16", verify=False, **t.kwargs)
    fixed = result.module
    # The input model is untouched, and its checkpoint loads into the fixed one under the same names.
    assert all(torch.equal(before[k], v) for k, v in t.model.state_dict().items())
    assert list(fixed.state_dict()) == list(t.model.state_dict())
    fixed.load_state_dict(t.model.state_dict(), strict=True)
    ref = _outputs(t.model, t.args, t.kwargs, autocast=False)
    out32 = _outputs(fixed, t.args, t.kwargs, autocast=False)
    assert torch.equal(out32, ref) or _rel(out32, ref) <= 1e-6
    out16 = _outputs(fixed, t.args, t.kwargs, autocast=True)
    assert torch.isfinite(out16).all()
    assert _rel(out16, ref) <= 1e-2
    if name == "bn_running_var":
        # Its fault needs a half model (running_var past 65504 in fp16): under autocast the BatchNorm keeps fp32
        # statistics, so there is nothing to island, and the buffer finding is reported, not rewritten.
        assert not result.report.islands
        assert any(f.rule == "AMP303" for f in result.report.before.findings)
    else:
        assert result.report.islands, "a planted fault must get at least one island"


def test_unfixed_model_really_fails_under_autocast():
    # The fault the previous test fixes is real: the original mask model gives NaN, the crash model raises.
    t = load_target(str(PLANTED / "mask_fill.py"))
    assert not torch.isfinite(_outputs(t.model, t.args, t.kwargs, autocast=True)).all()
    t = load_target(str(PLANTED / "mask_fill_crash.py"))
    with pytest.raises(RuntimeError):
        _outputs(t.model, t.args, t.kwargs, autocast=True)


def test_mask_consumers_join_the_constant_island_and_merge():
    t = load_target(str(SAMPLES / "char_transformer.py"))
    result = fix(t.model, *t.args, device="cpu", dtype="float16", verify=False)
    islands = result.report.islands
    assert [c.ops for c in islands] == [["mul", "add", "softmax"]] * 2
    # The softmax is there because the mask's -inf reaches it, not for itself: its kernel accumulates in fp32.
    assert islands[0].rules == ["AMP401"]
    # Two casts per merged island instead of an upcast and a cast back around each of the three ops.
    assert result.report.casts == 4 < result.report.casts_per_op
    assert torch.equal(_outputs(result.module, t.args, {}, False), _outputs(t.model, t.args, {}, False))


def test_islands_do_not_merge_across_a_cycle():
    t = load_target(str(ASSETS / "fix" / "two_exp.py"))
    result = fix(t.model, *t.args, device="cpu", dtype="float16", verify=True)
    assert [c.ops for c in result.report.islands] == [["exp"], ["exp"]]
    # Each island is contiguous in the rewritten graph: enter, casts, ops, exit with nothing foreign between.
    nodes = list(result.gm.graph.nodes)
    for i in range(len(result.report.islands)):
        pos = [k for k, n in enumerate(nodes) if n.meta.get(ISLAND_KEY) == i]
        assert pos == list(range(pos[0], pos[-1] + 1))
    v = result.report.verification
    assert v.fp32_bitwise and v.after.nonfinite == 0 and not v.remaining
    assert "unused_stat" in result.module.state_dict()


def test_fixed_module_runs_islands_in_fp32():
    t = load_target(str(PLANTED / "gelu_cube.py"))
    fixed = fix(t.model, *t.args, device="cpu", dtype="float16", verify=False).module
    seen = {}
    fixed.mlp.down.register_forward_pre_hook(lambda m, a: seen.update(down_in=a[0].dtype))
    fixed.mlp.up.register_forward_hook(lambda m, a, o: seen.update(up_out=o.dtype))
    _outputs(fixed, t.args, {}, autocast=True)
    # The GEMM before the island still runs in fp16; the island's result reaches the next GEMM in fp32.
    assert seen == {"up_out": torch.float16, "down_in": torch.float32}


def test_verification_reports_before_and_after():
    t = load_target(str(PLANTED / "mask_fill.py"))
    v = fix(t.model, *t.args, device="cpu", dtype="float16", **t.kwargs).report.verification
    assert v.fp32_bitwise and v.ok
    assert v.before.nonfinite > 0 and v.after.nonfinite == 0 and v.after.rel_err < 1e-2
    t = load_target(str(PLANTED / "mask_fill_crash.py"))
    v = fix(t.model, *t.args, device="cpu", dtype="float16", **t.kwargs).report.verification
    assert v.before.error and "RuntimeError" in v.before.error and v.after.error is None


def test_cuda_target_islands_also_turn_off_cpu_autocast():
    t = load_target(str(PLANTED / "mask_fill_crash.py"))
    result = fix(t.model, *t.args, device="cuda", dtype="float16", **t.kwargs)
    assert result.devices == ("cuda", "cpu")
    assert "torch.amp.autocast_mode._enter_autocast('cuda'" in result.gm.code
    assert result.report.verification.after.error is None


def test_untraceable_model_is_fixed_on_its_module_tree():
    t = load_target(str(ASSETS / "bad" / "untraceable.py"))       # data-dependent control flow: dispatch capture
    result = fix(t.model, *t.args, device="cpu", dtype="bfloat16")
    assert result.form == "modules" and result.gm is None and result.report.verification.fp32_bitwise
    assert "captured by dispatch" in result.report.to_text()


def test_a_model_no_capture_takes_points_to_keep_fp32(monkeypatch):
    import ampaudit.api

    def refuse(*args, **kwargs):
        raise CaptureError("no capture ran", hint="")
    monkeypatch.setattr(ampaudit.api, "capture_any", refuse)
    t = load_target(str(ASSETS / "bad" / "untraceable.py"))
    with pytest.raises(CaptureError) as info:
        fix(t.model, *t.args, device="cpu")
    assert "keep_fp32" in info.value.one_line() and "\n" not in info.value.one_line()


def test_top_level_names():
    t = load_target(str(PLANTED / "gelu_cube.py"))
    module, changes, report = ampaudit.fix(t.model, *t.args, device="cpu", verify=False)
    assert changes and report.islands and isinstance(module, torch.nn.Module)
    assert ampaudit.keep_fp32(t.model, ["mlp.act"]) is t.model


class _InPlaceAndDropout(torch.nn.Module):
    """An in-place write and a dropout between two flagged exps: neither may move, no island may span them."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.drop = torch.nn.Dropout(0.5)

    def forward(self, x):
        h = self.a(x)
        s = torch.exp(h)
        h.mul_(2.0)
        t = torch.exp(h + s)
        return self.drop(t) + h


def test_inplace_and_random_ops_are_barriers():
    torch.manual_seed(0)
    model, x = _InPlaceAndDropout().train(), torch.randn(4, 8)
    result = fix(model, x, device="cpu", dtype="float16", verify=False)
    assert len(result.report.islands) == 2
    names = [n.name for n in result.gm.graph.nodes]
    assert names.index("exp") < names.index("mul_") < names.index("exp_1")
    for autocast in (False, True):
        a, b = _outputs(model, (x,), {}, autocast), _outputs(result.module, (x,), {}, autocast)
        assert torch.isfinite(b).all()
        if not autocast:
            assert torch.equal(a, b)   # same dropout mask: random draws keep their order


def test_a_cumsum_difference_is_fixed_at_its_cumsum():
    # AMP206 is found on the subtraction, but the partial sums were rounded by the cumsum: the island holds it.
    from conftest import ROOT

    t = load_target(str(ROOT / "tests" / "planted" / "box_filter_cumsum.py"))
    result = fix(t.model, *t.args, device="cpu", dtype="bfloat16", **t.kwargs)
    assert any("cumsum" in c.ops for c in result.report.islands)
    v = result.report.verification
    assert v.fp32_bitwise and v.after.rel_err < 0.05 < v.before.rel_err and not v.remaining
