"""The verdict on own errors that check --calibrate and ampaudit report share (ampaudit.runtime.attribution): the
absolute lines keep their severities, a relative outlier is a warning, a parent does not inherit a child's error."""
from __future__ import annotations

import math

import pytest
import torch

from ampaudit.policy import settings, unit_roundoff
from ampaudit.runtime.attribution import (crosses, culprits, fed_nonfinite, first_crossing, peer_median,
                                          zero_reference)

U = unit_roundoff(torch.bfloat16)


def _model(**special: float) -> dict[str, float]:
    """Own errors of a bf16 model: eight GEMMs near 0.3%, a container near 0.15%, one neutral module at 0."""
    own = {f"layers.{i}.fc": 0.0028 + 0.0001 * i for i in range(8)}
    own.update({"layers": 0.0015, "drop": 0.0, "": 0.002})
    own.update(special)
    return own


def test_a_healthy_model_has_no_culprit():
    assert culprits(_model(), torch.bfloat16) == []


def test_absolute_lines_keep_their_severities():
    found = culprits(_model(**{"layers.3.fc": 40 * U, "head": 200 * U}), "bfloat16")
    assert [(c.module, c.rule, c.severity, c.rank) for c in found] == [
        ("head", "absolute", "error", 1), ("layers.3.fc", "absolute", "warning", 2)]
    assert found[0].units == pytest.approx(200) and "32 u line" in found[0].why


def test_a_relative_outlier_is_a_warning_naming_its_ratio():
    # The example: 6.6% own error in bf16 (17 u, under the 12.5% line) where the GEMMs sit near 0.3%.
    found = culprits(_model(router=0.066), torch.bfloat16)
    assert [(c.module, c.rule, c.severity) for c in found] == [("router", "relative", "warning")]
    c = found[0]
    assert c.median == pytest.approx(0.0031) and c.ratio == pytest.approx(0.066 / c.median)
    assert c.peers == 11 and "median own error" in c.why and "bfloat16" in c.why


def test_the_floor_keeps_a_near_exact_model_from_calling_noise_an_outlier():
    # Modules all near 1e-5 (an fp32-ish model): 10x the median is still far under the dtype's floor.
    own = {f"m{i}": 1e-5 for i in range(10)} | {"odd": 2e-3}
    assert culprits(own, torch.bfloat16) == []
    floor = settings()["attribution"]["floor_u"] * U
    assert [c.module for c in culprits(own | {"odd": floor}, torch.bfloat16)] == ["odd"]


def test_too_few_peers_leave_only_the_absolute_line():
    own = {"a": 0.003, "b": 0.003, "odd": 0.08}
    assert peer_median(own) == (None, 3) and culprits(own, torch.bfloat16) == []


def test_a_parent_does_not_inherit_a_finite_child_error_but_an_overflow_is_the_childs():
    found = culprits(_model(**{"blk": 0.003, "blk.attn": 0.5}), torch.bfloat16)
    assert [c.module for c in found] == ["blk.attn"]
    both = culprits(_model(**{"blk": 0.3, "blk.attn": 0.5}), torch.bfloat16)
    assert [c.module for c in both] == ["blk.attn", "blk"]                 # two own faults: both named
    nan = culprits(_model(**{"blk": math.nan, "blk.attn": math.inf, "": math.nan}), torch.float16)
    assert [(c.module, c.rule, c.severity) for c in nan] == [("blk.attn", "nonfinite", "error")]


def test_inherited_values_name_the_innermost_flagged_module():
    found = culprits(_model(**{"blk": 0.5, "blk.attn": 0.4, "": 0.5}), torch.bfloat16, inherited=True)
    assert [c.module for c in found] == ["blk.attn"]


def test_first_crossing_is_the_first_measurement_past_the_culprits_line():
    found = culprits(_model(router=0.066), torch.bfloat16)
    line = found[0].line
    assert not crosses(found[0], line * 0.9) and crosses(found[0], line) and crosses(found[0], math.nan)
    events = [("layers.0.fc", 1, 0.5), ("router", 1, line / 2), ("router", 2, 0.07), ("router", 3, 0.09)]
    assert first_crossing(found, events) == {"module": "router", "step": 2, "rel_l2": 0.07, "rule": "relative"}
    assert first_crossing([], events) is None


def test_rounding_only_excuses_what_it_explains():
    # Normal-range rounding (<= 1 u each side) never excuses a flagged module; subnormal rounding does.
    u = 2.0 ** -8
    own = {f"m{i}": 0.8 * u for i in range(8)} | {"bad": 40 * u}
    assert [c.module for c in culprits(own, torch.bfloat16, rounding={"bad": 2 * u})] == ["bad"]
    assert culprits(own, torch.bfloat16, rounding={"bad": 25 * u}) == []


def test_a_non_finite_own_error_is_rounding_s_when_rounding_already_lost_everything():
    # resnet152 at random init in fp16: layer3.16.conv1's output overflows (its own inf, inputs finite); every
    # module after it is fed inf (its FP32 input rounded to fp16) and reads NaN: the overflow reaching it, not
    # its code. efficientnet's squeeze-excitation fc2 at absmax 2e-8: its exact answer is all zero in fp16
    # (output rounding loses 1.0) and its own error divides by that zero reference: inf, not its code either.
    u = 2.0 ** -11
    own = {f"m{i}": 0.8 * u for i in range(8)} | {"over": math.inf, "after": math.nan, "se.fc2": math.inf,
                                                   "log": math.inf}
    rounding = {"over": 2 * u, "after": math.inf, "se.fc2": 0.6 + 1.0, "log": 0.9 * 1.0 + u}
    found = culprits(own, torch.float16, rounding=rounding, fed_inf=["after"])
    assert [(c.module, c.rule) for c in found] == [("over", "nonfinite"), ("log", "nonfinite")]
    assert [c.module for c in culprits(own, torch.float16)] == ["after", "over", "se.fc2", "log"]   # unexcused
    assert settings()["attribution"]["rounding_total"] == 1.0
    # Only the inputs' inf excuses: an exact answer that is itself inf/NaN in FP32 (output rounding inf) does not.
    assert "after" in {c.module for c in culprits({**own, "after": math.inf}, torch.float16, rounding=rounding)}
    assert fed_nonfinite({"local_input_rel_l2": math.inf}) and not fed_nonfinite({"local_input_rel_l2": 0.5})
    assert not fed_nonfinite({"output_rel_l2": math.inf})


def test_an_all_zero_fp32_answer_is_no_reference_not_an_inf():
    # timm's csatv2 has LayerNorm(1) modules: FP32 gives exactly 0, bf16 a finite residue (1.2e-4), and the
    # relative L2 divides by the zero reference: inf, which read as "turns finite inputs into inf/NaN".
    assert zero_reference({"rel_l2": math.inf, "max_abs": 1.2e-4})
    assert zero_reference({"local_rel_l2": math.inf, "local_max_abs": 1.2e-4, "rel_l2": 0.1})
    assert not zero_reference({"rel_l2": math.inf, "max_abs": math.inf})      # an output that is itself inf
    assert not zero_reference({"rel_l2": math.nan, "max_abs": math.nan})
    assert not zero_reference({"rel_l2": 0.5, "max_abs": 1.0})


class _OneFeatureNorm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.norm, self.head = torch.nn.Linear(16, 16), torch.nn.LayerNorm(1), torch.nn.Linear(16, 4)

    def forward(self, x):
        h = self.fc(x)
        return self.head(h + self.norm(h.unsqueeze(-1)).squeeze(-1))


def test_a_one_feature_layernorm_is_named_by_neither_path():
    import ampaudit
    from ampaudit.report.trace_summary import collect, summarize

    torch.manual_seed(0)
    model, x = _OneFeatureNorm(), torch.randn(8, 16)
    with ampaudit.watch(model, every=1, divergence_every=1, dtype=torch.bfloat16, locate_first=False) as w:
        for step in range(2):
            w.set_step(step)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(x)
            out.float().mean().backward()
    own = [e for e in w.events if e["event"] == "divergence" and e["scope"] == "local" and e["module"] == "norm"]
    assert own and own[0]["rel_l2"] == math.inf and math.isfinite(own[0]["max_abs"])   # a zero reference
    assert [r for r in summarize(collect(w.events), [])["recommendations"] if "norm" in r.get("modules", [])] == []
    report = ampaudit.check(_OneFeatureNorm(), x, device="cpu", dtype="bfloat16", calibrate=True)
    assert not [f for f in report.findings if f.module == "norm" and f.severity in ("warning", "error")]
