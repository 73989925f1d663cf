"""What the export capture and the audit around it skip for speed leaves the same graph and the same state.

The capture unlifts without export's input-guard submodule and recompiles only when it erased a node; a meta
export hands its graph to the unlifting uncompiled; a check without calibration puts the weights back once, and
pauses the cyclic garbage collector while it captures and propagates; an export under autocast generates the
code of the pieces export's autocast pass splits a forward's own autocast blocks into only where it is needed.
"""
from __future__ import annotations

import gc

import torch
from torch import nn

import ampaudit
import ampaudit.api as api
import ampaudit.runtime.replay_state as replay_state
from ampaudit.analysis.amp_prop import AMP_KEY
from ampaudit.capture.export_capture import _ASSERTS, capture_export, unlifted, unlifted_in_place
from ampaudit.policy import Policy


class Block(nn.Module):
    """Enough ops for a real graph: a linear, a norm, a reshape on the input's own size, a softmax."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 32)
        self.norm = nn.LayerNorm(32)
        self.register_buffer("scale", torch.full((32,), 0.5))

    def forward(self, x):
        b, t, _ = x.shape
        h = self.norm(self.proj(x)) * self.scale
        return h.view(b, t, 4, 8).softmax(-1).flatten(2)


def _ops(gm):
    return [(n.op, str(n.target)) for n in gm.graph.nodes]


def _kept(gm):
    # What capture_export keeps of ep.module()'s graph: no guard call, no unused export assertion.
    return [(n.op, str(n.target)) for n in gm.graph.nodes
            if n.users or not (n.op == "call_module" and "guard" in str(n.target)
                               or getattr(n.target, "_opname", "") in _ASSERTS)]


def test_the_capture_holds_exactly_the_nodes_of_the_guarded_module_less_its_guards():
    model, x = Block(), torch.randn(2, 5, 16)
    ep = torch.export.export(model, (x,), strict=False)
    guarded = ep.module()
    cap = capture_export(model, (x,), {})
    assert _ops(cap.gm) == _kept(guarded)
    assert not any("guard" in str(n.target) for n in cap.gm.graph.nodes)
    assert not any(name.startswith("_guards") for name, _ in cap.gm.named_children())
    # Its code is its graph's (whether or not anything was erased), and runs as the model does.
    assert cap.gm.code == cap.gm.graph.python_code("self").src
    torch.testing.assert_close(cap.gm(x), model(x))


def test_unlifted_has_the_guarded_modules_parameters_under_their_names():
    model, x = Block(), torch.randn(2, 5, 16)
    want = torch.export.export(model, (x,), strict=False).module()
    got = unlifted(torch.export.export(model, (x,), strict=False))
    assert dict(got.named_parameters()).keys() == dict(want.named_parameters()).keys()
    assert dict(got.named_buffers()).keys() == dict(want.named_buffers()).keys()
    assert [n for n in _ops(got) if "guard" not in n[1]] == [n for n in _ops(want) if "guard" not in n[1]]


class Stateful(nn.Module):
    """What the unlifting must put back: a BatchNorm that updates its statistics in training mode (buffer
    mutations), a non-persistent buffer, and a plain tensor attribute (a lifted constant)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.bn = nn.BatchNorm2d(8)
        self.register_buffer("shift", torch.full((8, 1, 1), 0.25), persistent=False)
        self.table = torch.linspace(0.0, 1.0, 8).view(8, 1, 1)

    def forward(self, x):
        return self.bn(self.conv(x)) * self.table + self.shift


def _nodes(gm):
    # What propagation and the rules read of each node: name, kind, target, arguments, origin meta.
    return [(n.name, n.op, str(n.target), str(n.args), str(n.kwargs), n.meta.get("nn_module_stack"),
             n.meta.get("stack_trace"), sorted(set(n.meta) - {"from_node"})) for n in gm.graph.nodes]


def test_the_in_place_unlifting_gives_the_graph_and_state_of_export_module():
    for model, x in ((Block(), torch.randn(2, 5, 16)), (Stateful().train(), torch.randn(2, 3, 8, 8)),
                     (Stateful().eval(), torch.randn(2, 3, 8, 8)), (OwnAutocast(), torch.randn(2, 8, 16))):
        want = torch.export.export(model, (x,), strict=False).module(check_guards=False)
        got = unlifted_in_place(torch.export.export(model, (x,), strict=False))
        assert _nodes(got) == [r for r in _nodes(want) if "guard" not in r[2]]
        for named in ("named_parameters", "named_buffers"):
            assert {k: v.shape for k, v in getattr(got, named)()} == {k: v.shape for k, v in getattr(want, named)()}
        torch.testing.assert_close(got(x), want(x))
        # Training mode: both moved their own running statistics the same way (the unlifted copy_ nodes ran).
        for (name, a), (_, b) in zip(got.named_buffers(), want.named_buffers()):
            torch.testing.assert_close(a, b, msg=name)


def test_a_meta_capture_compiles_its_meta_graph():
    # _export_meta rewrites the graph's CPU devices to meta and leaves the compiling to the unlifting.
    with torch.device("meta"):
        model = Block()
    x = torch.randn(2, 5, 16, device="meta")
    cap = capture_export(model, (x,), {}, policy=Policy.load("cuda", "float16"))
    assert cap.gm.code == cap.gm.graph.python_code("self").src
    assert "device(type='cpu')" not in cap.gm.code
    assert cap.gm(x).device.type == "meta"


def test_a_check_that_writes_no_weight_copies_and_compares_none(monkeypatch):
    """The audit's snapshot is copy-on-write: a weight nothing wrote still reads its own memory afterwards and is
    not compared bit for bit with its copy (that read every weight twice on a large model)."""
    model, x = Block().train(), torch.randn(2, 5, 16)
    compared = []
    real = replay_state._same_bits
    monkeypatch.setattr(replay_state, "_same_bits", lambda a, b: compared.append(a) or real(a, b))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ptrs = {k: v.const_data_ptr() for k, v in model.state_dict().items()}
    for calibrate in (False, True):
        ampaudit.check(model, x, device="cpu", dtype="bfloat16", calibrate=calibrate)
        assert compared == [], calibrate
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
        assert {k: v.const_data_ptr() for k, v in model.state_dict().items()} == ptrs


class GcSeen(Block):
    """Block whose forward notes whether the cyclic collector is on each time it runs (traced or calibrated)."""

    def __init__(self):
        super().__init__()
        self.seen: list[bool] = []

    def forward(self, x):
        self.seen.append(gc.isenabled())
        return super().forward(x)


def test_a_static_check_captures_with_the_cyclic_collector_paused_and_restores_it():
    for build in (lambda: GcSeen(), lambda: GcSeen().to("meta")):
        model = build()
        x = torch.randn(2, 5, 16, device=next(model.parameters()).device)
        assert gc.isenabled()
        report = ampaudit.check(model, x, device="cuda", dtype="bfloat16")
        assert report.capture in ("fx", "export") and model.seen and not any(model.seen)
        assert gc.isenabled()


def test_the_collector_stays_as_the_caller_left_it_and_runs_during_calibration():
    model, x = GcSeen(), torch.randn(2, 5, 16)
    gc.disable()
    try:
        ampaudit.check(model, x, device="cpu", dtype="bfloat16")
        assert not gc.isenabled()            # not switched on by the check
    finally:
        gc.enable()
    model.seen.clear()
    ampaudit.check(model, x, device="cpu", dtype="bfloat16", calibrate=True)
    assert model.seen and model.seen[-1]     # the calibration's real forwards run with the collector
    assert gc.isenabled()


class OwnAutocast(nn.Module):
    """A forward that turns autocast off around its attention, as timm's EfficientViT does."""

    def __init__(self):
        super().__init__()
        self.q = nn.Linear(16, 16)
        self.out = nn.Linear(16, 16)

    def forward(self, x):
        h = self.q(x)
        with torch.autocast(device_type=h.device.type, enabled=False):
            h = h.float()
            h = (h @ h.transpose(-1, -2)).softmax(-1) @ h
        return self.out(h)


def _typed(audit):
    return [(n.op, str(n.target), n.meta[AMP_KEY].dtype, n.meta[AMP_KEY].compute_dtype)
            for n in audit.capture.gm.graph.nodes if AMP_KEY in n.meta]


def test_an_own_autocast_block_is_captured_and_typed_as_with_eager_code_generation(monkeypatch):
    from torch.fx import graph as fx_graph
    from torch.fx._lazy_graph_module import _force_skip_lazy_graph_module

    made = []
    real = fx_graph.Graph.python_code
    monkeypatch.setattr(fx_graph.Graph, "python_code", lambda self, *a, **k: made.append(1) or real(self, *a, **k))
    for device in ("cpu", "meta"):
        model = OwnAutocast().to(device)
        x = torch.randn(2, 8, 16, device=device)
        made.clear()
        lazy = api.audit(model, x, device="cuda", dtype="bfloat16", capture_mode="export")
        lazy_made = len(made)
        made.clear()
        with _force_skip_lazy_graph_module():
            eager = api.audit(model, x, device="cuda", dtype="bfloat16", capture_mode="export")
        assert any("autocast" in str(n.target) for n in eager.capture.gm.graph.nodes)   # the block is there
        assert _typed(lazy) == _typed(eager)
        assert lazy.report.findings == eager.report.findings
        assert lazy_made < len(made)
        assert lazy.capture.gm.code == lazy.capture.gm.graph.python_code("self").src
