"""A composite's own error is its own code's: the submodules it calls run in FP32 in its re-run, so a parent does not
inherit a child's fault, a child does not hide its parent's, and values it passes on untouched reach the next child
unrounded. The watch measures composites on a share of its checks, a nesting depth at a time after the first."""
from __future__ import annotations

import torch
import torch.nn as nn

from ampaudit.runtime.compare import compare_to_fp32
from ampaudit.runtime.watch import watch

U = torch.finfo(torch.bfloat16).eps / 2


class Offset(nn.Module):
    """(x + 300) - 300: unlisted ops, in bf16 only because bf16 arrives, 8 bits at 300."""

    def forward(self, x):
        return (x + 300.0) - 300.0


class Holder(nn.Module):
    """A composite without code of its own around a faulty child."""

    def __init__(self):
        super().__init__(); self.a, self.bad, self.b = nn.Linear(16, 16), Offset(), nn.Linear(16, 16)

    def forward(self, x):
        return self.b(self.bad(self.a(x)))


class OwnFault(nn.Module):
    """A composite whose own code between its healthy children is the fault."""

    def __init__(self):
        super().__init__(); self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        return self.b((self.a(x) + 300.0) - 300.0)


class Centre(nn.Module):
    """Subtracts the mean of an input with a large offset: sensitive to how its input was rounded."""

    def forward(self, x):
        return x - x.mean(-1, keepdim=True)


class Chain(nn.Module):
    """Passes one child's output straight to the next: no code of its own."""

    def __init__(self):
        super().__init__(); self.inp, self.centre = nn.Linear(16, 16), Centre()
        with torch.no_grad():
            self.inp.bias.fill_(50.0)

    def forward(self, x):
        return self.centre(self.inp(x))


def _own(model: nn.Module) -> dict[str, float]:
    torch.manual_seed(1)
    rows = compare_to_fp32(model, (torch.randn(64, 16),), dtype=torch.bfloat16)
    return {r["module"]: r.get("local_rel_l2") for r in rows}


def test_a_parent_does_not_inherit_its_childs_fault():
    torch.manual_seed(0)
    own = _own(Holder())
    assert own["bad"] > 32 * U                       # the child's own fault
    assert own[""] < 2 * U                           # the composite only hands on its last child's rounding
    assert own["a"] < 2 * U and own["b"] < 2 * U


def test_a_composites_own_code_is_charged_to_it_not_to_its_children():
    torch.manual_seed(0)
    own = _own(OwnFault())
    assert own[""] > 32 * U
    assert own["a"] < 2 * U and own["b"] < 2 * U


def test_a_value_passed_on_untouched_reaches_the_next_child_unrounded():
    # centre's sensitivity to the rounding of its input is its own error (it is fed rounded inputs in its own
    # re-run); the composite that wires inp to centre adds nothing.
    torch.manual_seed(0)
    own = _own(Chain())
    assert own["centre"] > 8 * U and own[""] < 2 * U


def _local_modules_per_step(model: nn.Module, steps: int, **kw) -> dict[int, set[str]]:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with watch(model, dtype=torch.bfloat16, stats=False, divergence_every=1, local_divergence_every=1, **kw) as w:
        for step in range(steps):
            w.set_step(step)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(torch.randn(8, 16))
            out.float().square().mean().backward()
            opt.step()
            opt.zero_grad()
    found: dict[int, set[str]] = {}
    for e in w.divergence:
        if e["scope"] == "local":
            found.setdefault(e["step"], set()).add(e["module"])
    return found


def test_watch_measures_every_composite_first_then_one_depth_per_check():
    torch.manual_seed(0)
    model = nn.Sequential(Holder(), nn.Sequential(nn.Linear(16, 16), nn.ReLU()))
    leaves = {"0.a", "0.bad", "0.b", "1.0", "1.1"}
    seen = _local_modules_per_step(model, 4, composite_divergence_every=1)
    assert seen[0] == leaves | {"", "0", "1"}
    assert seen[1] == leaves | {""} and seen[2] == leaves | {"0", "1"} and seen[3] == leaves | {""}
    # Off: leaves only, as before composites had an own error.
    assert _local_modules_per_step(model, 1, composite_divergence_every=None)[0] == leaves


class Picky(nn.Module):
    """Raises on its fourth call: the real forward, the FP32 shadow and its own re-run pass, the re-run of the
    composite around it does not."""

    def __init__(self):
        super().__init__(); self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls == 4:
            raise RuntimeError("a state this module cannot be called in")
        return x * 2


class HoldsPicky(nn.Module):
    def __init__(self):
        super().__init__(); self.lin, self.picky = nn.Linear(16, 16), Picky()

    def forward(self, x):
        # `+ 0` is its own code: picky's input in the re-run is not the shadow's, so it is called, not served
        # from the shadow (ampaudit/runtime/shadow_calls.py).
        return self.picky(self.lin(x) + 0)


def test_a_composite_whose_rerun_raises_costs_its_own_error_only():
    from ampaudit.notes import collect

    torch.manual_seed(0)
    with collect() as notes:
        own = _own(HoldsPicky())
    assert own["lin"] < 2 * U and own["picky"] < 2 * U and own[""] is None      # the composite's alone is lost
    assert any("own error of the top module skipped" in n for n in notes), notes
    assert not torch.is_autocast_enabled("cpu")                                # its FP32 region was closed


class _PassOn(nn.Module):
    def forward(self, x):
        return x * 1.0


def test_a_pass_through_fed_fp16_subnormals_has_no_own_error():
    # Activations of ~1e-6 (a random-init net's tail: halonet50ts's head) sit in fp16's subnormals, where
    # storing a value loses digits whoever stores it; a module that only hands them on must not read as a
    # culprit (the first Linear, whose weights themselves round to subnormals, keeps its error).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), _PassOn(), nn.Identity(), nn.Linear(32, 32))
    with torch.no_grad():
        model[0].weight.mul_(1e-5)
        model[0].bias.mul_(1e-5)
    rows = {r["module"]: r for r in compare_to_fp32(model, (torch.randn(8, 32),), dtype=torch.float16,
                                                     device_type="cpu")}
    assert rows["1"]["rel_l2"] > 2 ** -10 * 8             # the values it receives are off by > 8 u ...
    assert rows["1"]["local_rel_l2"] == 0.0 and rows["2"]["local_rel_l2"] == 0.0   # ... not by its doing
    assert rows["0"]["local_rel_l2"] > 2 ** -10 * 8


def test_rounding_around_a_module_fed_subnormals_excuses_its_own_error():
    # A Linear fed fp16-subnormal activations loses digits on its inputs before its GEMM runs: its own error is
    # the dtype's range (AMP503's), and what rounding alone loses around it says so.
    from ampaudit.runtime.attribution import culprits, rounding_around

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 256), nn.Linear(256, 256), nn.Linear(256, 256), nn.Linear(256, 256),
                          nn.Linear(256, 256), nn.Linear(256, 8))
    with torch.no_grad():
        model[0].weight.mul_(1e-6)               # outputs ~5e-7: deep in fp16's subnormals
        model[1].weight.mul_(1e5)                # ... which the next Linear brings back to ~0.03
        model[0].bias.zero_()
        model[1].bias.zero_()
    rows = {r["module"]: r for r in compare_to_fp32(model, (torch.randn(8, 32),), dtype=torch.float16,
                                                     device_type="cpu")}
    u = 2.0 ** -11
    fed = rows["1"]
    assert fed["local_rel_l2"] > 8 * u and fed["local_input_rel_l2"] > 8 * u    # subnormal inputs, rounded
    own = {n: r["local_rel_l2"] for n, r in rows.items()}
    flagged = {c.module for c in culprits(own, torch.float16)}
    excused = {c.module for c in culprits(own, torch.float16, rounding={n: rounding_around(r) for n, r in rows.items()})}
    assert "1" in flagged and "1" not in excused
