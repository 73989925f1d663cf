"""One "under the target": every stage that runs a forward under the target's autocast (export and dispatch
capture, the mixed-dtype probe, calibration, graph-fix and source-fix verification) enters
ampaudit.simulate.target_autocast, so a CUDA target on a CPU runs CUDA's policy through the simulation."""
from __future__ import annotations

import pytest
import torch
from conftest import SAMPLES
from torch import nn

from ampaudit.graph_meta import EXAMPLE_KEY
from ampaudit.policy import Policy
from ampaudit.simulate import PolicyUpcast, simulated, target_autocast

CUDA = Policy.load("cuda", "bfloat16")
CPU = Policy.load("cpu", "bfloat16")


class _ExpHead(nn.Module):
    """exp runs in fp32 under CUDA autocast; CPU autocast leaves it in bf16 after the lowered linear."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        y = torch.exp(self.fc(x))
        return y.to(y.dtype) * 2


class _MixedIndexAdd(nn.Module):
    """index_add_ of the linear's bf16 output into an fp32 tensor (on no autocast list, so it meets both dtypes):
    the mixed-dtype probe confirms it raises under the target's autocast."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return torch.zeros(4, 8).index_add_(0, torch.arange(4), self.fc(x))


def _entered(fn) -> int:
    before = PolicyUpcast.entered
    fn()
    return PolicyUpcast.entered - before


def _x():
    return torch.randn(4, 8)


def test_target_autocast_simulates_only_a_cuda_target_on_cpu():
    assert simulated(CUDA, "cpu") and not simulated(CPU, "cpu") and not simulated(CUDA, "cuda")
    fc = nn.Linear(8, 8)
    with target_autocast(CUDA, "cpu") as sim:
        assert isinstance(sim, PolicyUpcast) and torch.is_autocast_enabled("cpu")
        assert torch.get_autocast_dtype("cpu") is torch.bfloat16
        assert torch.exp(fc(_x())).dtype is torch.float32       # CUDA's policy: exp in fp32
    with target_autocast(CPU, "cpu") as sim:
        assert sim is None and torch.exp(fc(_x())).dtype is torch.bfloat16
    with target_autocast(CUDA, "meta") as sim:
        assert sim is None and not torch.is_autocast_enabled("cpu")
    with target_autocast(CUDA, "cpu", enter_autocast=False):
        assert not torch.is_autocast_enabled("cpu")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert torch.exp(fc(_x())).dtype is torch.float32


def test_nested_simulations_register_once():
    fc = nn.Linear(8, 8)
    with target_autocast(CUDA, "cpu") as outer, target_autocast(CUDA, "cpu") as inner:
        assert inner.notes is outer.notes and torch.exp(fc(_x())).dtype is torch.float32
    with target_autocast(CUDA, "cpu"):
        assert torch.exp(fc(_x())).dtype is torch.float32     # the registrations came back and went again
    assert PolicyUpcast.active is None


@pytest.mark.parametrize("mode", ["export", "dispatch"])
def test_capture_runs_under_the_simulation(mode):
    from ampaudit.capture import capture_any

    model = _ExpHead()
    caps = {}

    def run(policy):
        caps[policy.device] = capture_any(model, (_x(),), {}, mode=mode, policy=policy)

    assert _entered(lambda: run(CUDA)) >= 1
    assert _entered(lambda: run(CPU)) == 0
    if mode == "dispatch":
        # The recorded dtype of exp's output: CUDA's fp32, not CPU autocast's bf16; and exp is recorded as the
        # model called it, on the linear's output, not on the simulation's cast to fp32 (the policy types it).
        def exp_of(cap):
            return next(n for n in cap.gm.graph.nodes if "exp" in str(n.target))
        assert exp_of(caps["cuda"]).meta[EXAMPLE_KEY].dtype is torch.float32
        assert exp_of(caps["cpu"]).meta[EXAMPLE_KEY].dtype is torch.bfloat16
        assert [str(exp_of(c).args[0].target) for c in (caps["cuda"], caps["cpu"])] == ["aten.addmm.default"] * 2


def test_mixed_dtype_probe_runs_under_the_simulation():
    from ampaudit.api import audit

    found = {}

    def run(device):
        found[device] = audit(_MixedIndexAdd(), _x(), device=device, dtype="bfloat16", capture_mode="fx").report.findings

    assert _entered(lambda: run("cuda")) >= 1
    assert _entered(lambda: run("cpu")) == 0
    assert any(f.rule == "AMP207" for f in found["cuda"]) and any(f.rule == "AMP207" for f in found["cpu"])


def test_calibration_runs_under_the_simulation_on_the_models_device():
    from ampaudit.analysis.calibrate import calibrate

    batches = [((_x(),), {})]
    assert _entered(lambda: calibrate(_ExpHead(), batches, CUDA)) >= 3     # locate, compare, decisions
    assert _entered(lambda: calibrate(_ExpHead(), batches, CPU)) == 0


def test_graph_fix_verification_runs_under_the_simulation():
    from ampaudit.rewrite.verify import verify_outputs

    model = _ExpHead()
    got = {}

    def run(policy):
        got[policy.device] = verify_outputs(model, model, (_x(),), {}, device_type="cpu", policy=policy)

    assert _entered(lambda: run(CUDA)) == 2            # the original and the fixed model
    assert _entered(lambda: run(CPU)) == 0
    assert got["cuda"].target == "cuda" and "cuda's policy simulated" in got["cuda"].lines()[1]
    assert got["cpu"].target == "" and "simulated" not in got["cpu"].lines()[1]


@pytest.mark.slow
def test_fix_and_source_fix_verify_under_the_simulation(monkeypatch):
    """Through the public fix entry points: the verification of both kinds of fix is simulated."""
    import ampaudit.rewrite.api as rewrite_api
    import ampaudit.rewrite.verify as rewrite_verify
    from ampaudit.loading import load_target
    from ampaudit.sourcefix import fix_source

    real, seen = rewrite_verify.verify_outputs, []

    def counting(*args, **kwargs):
        before = PolicyUpcast.entered
        out = real(*args, **kwargs)
        seen.append((kwargs["policy"].device, PolicyUpcast.entered - before))
        return out

    monkeypatch.setattr(rewrite_api, "verify_outputs", counting)
    monkeypatch.setattr(rewrite_verify, "verify_outputs", counting)
    sample = str(SAMPLES / "char_transformer.py")
    loaded = load_target(sample)
    rewrite_api.fix(loaded.model, *loaded.args, device="cuda", dtype="bfloat16", **loaded.kwargs)
    fix_source(sample, device="cuda", dtype="bfloat16")
    assert seen and all(device == "cuda" and entered == 2 for device, entered in seen), seen
