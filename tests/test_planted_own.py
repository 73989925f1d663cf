"""The planted models in tests/planted/ really fail as their docstrings say, and the static rules locate the ones a
static rule can prove.

Each model runs in FP32 and under CPU autocast of its target dtype (a CUDA target runs with the CPU dtype): FP32 must
be finite, forward and backward; the low-precision run must show the fault: a non-finite output or a relative error
above 10% (forward faults), or a finite output with a non-finite gradient (backward faults). Training faults (phase
"training": state updated in place that loses its updates) are trained in tests/test_train_swamping.py. A decision
fault (``EXPECT["decisions"]``: op and min_share) shows in the choices, not in the values: that share of the
culprit's decisions differs from FP32 (ampaudit.runtime.decision_record), whatever the output's error.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ampaudit

from conftest import load_module

OWN = Path(__file__).resolve().parent / "planted"
FILES = sorted(p for p in OWN.glob("*.py") if not p.name.startswith("_"))
FAMILIES = {"alignment", "sensitive-op", "normalization", "constant", "range", "nonfinite", "divergence"}


def _run(m, dtype, inputs, target=None):
    """The float32 output (and the parameters' gradients of loss_fn, when a target is given) of one run."""
    model = m.build_model()
    with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        out = model(*inputs)
    grads = []
    if target is not None:
        m.loss_fn(out, target).backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
    return out.detach().float(), grads


def _finite(*tensors) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors)


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_expect_is_complete(path):
    expect = load_module(path).EXPECT
    assert set(expect) >= {"culprit", "families", "target", "phase"}
    # A "training" fault (one that training dynamics make, not one forward) is named by a run's trace.
    assert set(expect["families"]) <= FAMILIES | ({"precursor"} if expect["phase"] == "training" else set())
    assert expect["target"]["device"] in ("cpu", "cuda") and expect["target"]["dtype"] in ("float16", "bfloat16")
    assert expect["phase"] in ("forward", "backward", "training")


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_fault_is_real_and_fp32_is_fine(path):
    m = load_module(path)
    if m.EXPECT["phase"] == "training":
        pytest.skip("a fault that shows only in training: tests/test_train_swamping.py and tests/test_train_precursors.py train them")
    dtype = getattr(torch, m.EXPECT["target"]["dtype"])
    inputs = tuple(m.example_inputs())
    ref, _ = _run(m, None, inputs)
    try:
        low, _ = _run(m, dtype, inputs)
    except RuntimeError:  # the forward raises under autocast (mixed dtypes an op does not take): the fault
        low = torch.full_like(ref, float("nan"))
    assert _finite(ref), "FP32 output is not finite"
    batch, target = next(iter(m.train_data()))
    batch = batch if isinstance(batch, tuple) else (batch,)
    _, ref_grads = _run(m, None, batch, target)
    assert _finite(*ref_grads), "FP32 gradients are not finite"
    if m.EXPECT["phase"] == "backward":
        _, low_grads = _run(m, dtype, batch, target)
        assert _finite(low), "a backward-only fault must leave the forward finite"
        assert not _finite(*low_grads), "the low-precision gradients are finite: the fault is not there"
    elif "decisions" in m.EXPECT:
        from ampaudit.runtime.decision_record import measure_decisions

        want = m.EXPECT["decisions"]
        rows = measure_decisions(m.build_model(), inputs, device_type="cpu", dtype=dtype)
        site = [r for r in rows if r["module"] == m.EXPECT["culprit"] and r["op"] == want["op"]]
        assert _finite(low) and site and site[0]["used"], rows
        assert site[0]["share_flipped"] >= want["min_share"], f"decisions flipped: {site[0]}"
    elif m.EXPECT.get("verdict") == "relative":
        # An outlier against the model, under the dtype's absolute line: the culprit alone, on the inputs the
        # FP32 run gives it, loses 8-32 unit roundoffs (a GEMM loses about one).
        error, u = _module_error(m, dtype, inputs), torch.finfo(dtype).eps / 2
        assert 8 * u <= error < 32 * u, f"the culprit's error {error:.4f} under {dtype} is not a relative outlier"
    else:
        error = float((low - ref).norm() / ref.norm()) if _finite(low) else float("inf")
        assert error > 0.10, f"relative error {error:.3f} under {dtype}: the fault is not there"


FIXED = [p for p in FILES if hasattr(load_module(p), "build_fixed_model")]


@pytest.mark.parametrize("path", FIXED, ids=lambda p: p.stem)
def test_fixed_twin_is_healthy(path):
    """A file's ``build_fixed_model`` (the published fix of its fault, bench/both_paths.py's healthy twin) runs
    under the target's autocast within 1% of FP32, forward and backward finite: the fix removes the fault."""
    m = load_module(path)
    dtype = getattr(torch, m.EXPECT["target"]["dtype"])
    fixed = type("Fixed", (), {"build_model": staticmethod(m.build_fixed_model), "loss_fn": staticmethod(m.loss_fn)})
    inputs = tuple(m.example_inputs())
    ref, _ = _run(fixed, None, inputs)
    low, _ = _run(fixed, dtype, inputs)
    assert _finite(low) and float((low - ref).norm() / ref.norm()) < 0.01
    batch, target = next(iter(m.train_data()))
    _, grads = _run(fixed, dtype, batch if isinstance(batch, tuple) else (batch,), target)
    assert _finite(*grads)


def _module_error(m, dtype, inputs) -> float:
    """Relative L2 of the culprit's output under autocast against FP32, both on the input of the FP32 run."""
    model = m.build_model()
    culprit = model.get_submodule(m.EXPECT["culprit"])
    seen = {}
    handle = culprit.register_forward_hook(lambda mod, args, out: seen.update(args=args, out=out))
    with torch.no_grad():
        model(*inputs)
        handle.remove()
        with torch.autocast("cpu", dtype=dtype):
            low = culprit(*(a.to(dtype) for a in seen["args"])).float()
    return float((low - seen["out"]).norm() / seen["out"].norm())


# The planted faults a static rule proves, with the rule that must locate them at warning or above.
STATIC = [
    ("rope_bf16_positions", "AMP404"),
    ("rope_matmul_autocast", "AMP404"),
    ("sinusoid_fp16_arange", "AMP404"),
    ("box_filter_cumsum", "AMP206"),
    ("normalize_zero_row", "AMP402"),
    ("segment_pool_index_add", "AMP207"),
    ("scatter_add_cpu", "AMP207"),
]
# Of those, the faults CUDA autocast has too: integers cast to the activation dtype are rounded on every device,
# and index_add_ is on no autocast list there either.
ON_CUDA_TOO = {"rope_bf16_positions", "rope_matmul_autocast", "sinusoid_fp16_arange", "segment_pool_index_add"}


@pytest.mark.parametrize("name, rule", STATIC)
def test_static_rule_locates_the_culprit(name, rule):
    m = load_module(OWN / f"{name}.py")
    target = m.EXPECT["target"]
    report = ampaudit.check(m.build_model(), *m.example_inputs(), **target)
    found = [f for f in report.findings if f.rule == rule and f.severity in ("warning", "error")]
    assert found and all(f.module == m.EXPECT["culprit"] for f in found), report.to_dict()["findings"]
    assert found[0].family in m.EXPECT["families"]


@pytest.mark.parametrize("name, rule", STATIC)
def test_static_rule_silent_when_cuda_keeps_it_fp32(name, rule):
    """On CUDA the same models differ: cumsum and norm have fp32 outputs there, so AMP206 and the default-eps
    AMP402 have nothing to say, and scatter_add is promoted; the rest fail there too."""
    m = load_module(OWN / f"{name}.py")
    report = ampaudit.check(m.build_model(), *m.example_inputs(), device="cuda", dtype=m.EXPECT["target"]["dtype"])
    hits = [f for f in report.findings if f.rule == rule and f.severity != "info"]
    assert bool(hits) == (name in ON_CUDA_TOO)


@pytest.mark.parametrize("name", [n for n, _ in STATIC])
def test_captures_agree_on_these_rules(name):
    m = load_module(OWN / f"{name}.py")
    mine = ("AMP206", "AMP207", "AMP402", "AMP403", "AMP404")

    def keys(mode):
        report = ampaudit.check(m.build_model(), *m.example_inputs(), **m.EXPECT["target"], capture_mode=mode)
        return sorted({(f.rule, f.severity, f.module, (f.location or {}).get("line"))
                       for f in report.findings if f.rule in mine})

    fx_keys = keys("fx")
    assert fx_keys and keys("export") == fx_keys and keys("dispatch") == fx_keys
