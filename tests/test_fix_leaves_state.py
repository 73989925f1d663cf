"""``ampaudit.fix`` (the graph rewrite, the module-tree form, --pad, --calibrate), the source fix and
``ampaudit.plan`` leave the user's model bit for bit as it was, and the global RNGs where they were: each runs
the model's forward (a training-mode forward that moves an EMA teacher, BatchNorm statistics, a submodule's mode
and a requires_grad flag, and draws dropout masks) only inside ``replay_state.state_snapshot``."""
from __future__ import annotations

import copy
import random
import textwrap

import pytest
import torch
from torch import nn

import ampaudit
import ampaudit.loading
from ampaudit.sourcefix import fix_source


class Exp(nn.Module):
    def forward(self, x):
        return torch.exp(x)


class Stateful(nn.Module):
    """Every kind of state a forward can move (the EMA update through ``.data``, which no version counter sees),
    an exp for an fp32 island, a Linear 12 wide for --pad, and (``untraceable``) data-dependent control flow, so
    torch.fx cannot capture it and the fix is on the module tree."""

    def __init__(self, untraceable: bool = False):
        super().__init__()
        self.untraceable = untraceable
        self.student = nn.Linear(16, 12)
        self.teacher = nn.Linear(16, 12).requires_grad_(False)
        self.norm = nn.BatchNorm1d(12)
        self.drop = nn.Dropout(0.5)
        self.act = Exp()
        self.head = nn.Linear(12, 16)

    def forward(self, x):
        if self.training:
            with torch.no_grad():
                for t, s in zip(self.teacher.parameters(), self.student.parameters()):
                    t.data.mul_(0.5).add_(s.detach(), alpha=0.5)
            self.teacher.eval()
            self.student.bias.requires_grad_(False)
        if self.untraceable and x.sum() > 1e9:
            x = x * 0.5
        h = self.drop(self.norm(self.student(x))) + self.teacher(x)
        return self.head(self.act(h))


def user_state(model: nn.Module) -> dict:
    """Everything of ``model`` and the global RNGs a later training run would see."""
    return {"tensors": {k: v.detach().clone() for k, v in list(model.named_parameters()) + list(model.named_buffers())},
            "objects": {k: id(v) for k, v in list(model.named_parameters()) + list(model.named_buffers())},
            "flags": {k: p.requires_grad for k, p in model.named_parameters()},
            "grads": {k: None if p.grad is None else p.grad.clone() for k, p in model.named_parameters()},
            "modes": {k: m.training for k, m in model.named_modules()},
            "torch_rng": torch.get_rng_state(), "python_rng": random.getstate()}


def assert_same(before: dict, model: nn.Module) -> None:
    after = user_state(model)
    for name, value in before["tensors"].items():
        assert torch.equal(after["tensors"][name], value), name
    for key in ("objects", "flags", "modes", "python_rng"):
        assert after[key] == before[key], key
    assert all((g is None) == (after["grads"][k] is None) and (g is None or torch.equal(g, after["grads"][k]))
               for k, g in before["grads"].items())
    assert torch.equal(after["torch_rng"], before["torch_rng"])


def _model(untraceable: bool = False) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = Stateful(untraceable).train()
    model.head.weight.grad = torch.ones_like(model.head.weight)     # a .grad the user holds
    return model, torch.randn(4, 16)


@pytest.mark.parametrize("options", [{}, {"pad": True}, {"calibrate": True}], ids=["islands", "pad", "calibrate"])
@pytest.mark.parametrize("untraceable", [False, True], ids=["graph", "modules"])
def test_fix_leaves_the_users_model_and_the_rng_as_they_were(untraceable, options):
    model, x = _model(untraceable)
    before = user_state(model)
    result = ampaudit.fix(model, x, device="cpu", dtype="float16", **options)
    assert result.form == ("modules" if untraceable else "graph")
    assert result.report.verification is not None and result.report.islands
    assert bool(result.report.padding) == bool(options.get("pad"))
    assert_same(before, model)


def test_fix_verification_runs_each_forward_from_the_users_state():
    # Each of the four verification runs moves the EMA teacher; each must start from the teacher the user has,
    # or the autocast run's error against FP32 would include one EMA update (the module-tree form keeps the
    # forward, so the fixed copy moves its teacher the same way).
    from ampaudit.policy import Policy
    from ampaudit.rewrite.verify import compare, run

    model, x = _model(untraceable=True)
    ref, amp = copy.deepcopy(model), copy.deepcopy(model)
    policy = Policy.load("cpu", "float16")
    want = compare(run(amp, (x,), {}, device_type="cpu", policy=policy), run(ref, (x,), {}))[1]
    v = ampaudit.fix(model, x, device="cpu", dtype="float16").report.verification
    assert v.fp32_bitwise and v.fp32_max_abs == 0
    assert v.before.rel_err == want and v.after.rel_err <= want


def test_the_source_fix_leaves_the_loaded_model_and_the_rng_as_they_were(tmp_path, monkeypatch):
    path = tmp_path / "model.py"
    path.write_text(textwrap.dedent('''
        import torch, torch.nn as nn, torch.nn.functional as F

        class Attention(nn.Module):
            def __init__(self, d=32):
                super().__init__(); self.qkv = nn.Linear(d, 3 * d); self.out = nn.Linear(d, d)
                self.teacher = nn.Linear(d, d).requires_grad_(False); self.drop = nn.Dropout(0.5)
            def forward(self, x):
                if self.training:
                    with torch.no_grad():
                        self.teacher.weight.data.mul_(0.5).add_(self.out.weight.detach(), alpha=0.5)
                q, k, v = self.qkv(x).chunk(3, -1)
                scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
                return self.drop(self.out(F.softmax(scores, dim=-1) @ v)) + self.teacher(x)

        def build_model():
            torch.manual_seed(0); return Attention()

        def example_inputs():
            torch.manual_seed(1); return (torch.randn(2, 8, 32),)
    '''))
    loaded, load = [], ampaudit.loading.load_target

    def recording(*args, **kwargs):
        target = load(*args, **kwargs)
        if not loaded:
            loaded.append((target.model, user_state(target.model)))
        return target

    monkeypatch.setattr(ampaudit.loading, "load_target", recording)
    torch.manual_seed(7)
    rng = torch.get_rng_state()
    result = fix_source(str(path), device="cpu", dtype="float16", select=["AMP201"])
    assert result.plan.edits and result.verified
    model, before = loaded[0]
    before["torch_rng"], before["python_rng"] = torch.get_rng_state(), random.getstate()   # compared below
    assert_same(before, model)
    assert torch.equal(torch.get_rng_state(), rng)         # loading the file drew from it too: put back


def test_plan_leaves_the_users_model_and_the_rng_as_they_were():
    pytest.importorskip("torchao")
    model, x = _model()
    # The sensitivity run differentiates the parameters that require grad when it starts: a forward that turns
    # one off midway cannot be planned, so here the flag starts off (the other tests cover putting it back).
    model.student.bias.requires_grad_(False)
    before = user_state(model)
    plan = ampaudit.plan(model, [((x,), {})], recipes="tensorwise", speed_model="off")
    assert plan.layers
    assert_same(before, model)


@pytest.mark.parametrize("write", ["none", "data", "no_grad", "view", "numpy", "tied"])
def test_a_snapshot_copies_memory_only_for_what_is_written_and_restores_every_write(write):
    """state_snapshot's copies are copy-on-write: nothing is copied for a model nothing writes (the untouched
    weight still reads its own memory afterwards), and a write through any alias is put back bit for bit, tied
    weights staying one tensor."""
    from ampaudit.runtime.replay_state import state_snapshot

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    model[1].weight = model[0].weight                  # tied
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ptr = model[0].bias.const_data_ptr()
    restore = state_snapshot(model)
    w = model[0].weight
    # The snapshot shares the weights' memory until something writes (a copy-on-write clone)
    assert torch._C._is_cow_tensor(w) and torch._C._is_cow_tensor(model[0].bias)
    if write == "data":
        w.data.mul_(0.5)
    elif write == "no_grad":
        with torch.no_grad():
            model[0].bias.add_(1.0)
    elif write == "view":
        w.data.view(-1)[:4] = 3.0
    elif write == "numpy":
        model[0].bias.detach().numpy()[0] = 7.0
    elif write == "tied":
        model[1].weight.data.zero_()
    restore()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()), write
    assert model[1].weight is model[0].weight
    if write in ("none", "data", "view", "tied"):
        assert model[0].bias.const_data_ptr() == ptr     # never written: never copied
