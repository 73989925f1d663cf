"""ampaudit.watch's per-module statistics hooks are on the modules for the sampled passes only: on every one of
them (no sampled pass missed) and on no other (none left behind on an unsampled pass)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from ampaudit.runtime.watch import watch


class Spy(nn.Module):
    """A linear layer that records, in its own forward, whether a forward hook is on it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.hooked: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.hooked.append(bool(self._forward_hooks) and bool(self.fc._forward_hooks))
        return torch.relu(self.fc(x))


def build() -> tuple[nn.Module, Spy]:
    torch.manual_seed(0)
    spy = Spy()
    return nn.Sequential(nn.Linear(4, 4), spy, nn.Linear(4, 1)), spy


def below_root_hooked(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if name and m._forward_hooks]


def test_hooks_are_on_every_sampled_pass_and_gone_after_each_pass():
    model, spy = build()
    with watch(model, every=9, stats_every=3, locate_first=False, dtype=torch.bfloat16) as w:
        for step in range(9):
            w.set_step(step)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(torch.randn(2, 4))
            out.float().sum().backward()
            assert below_root_hooked(model) == [], f"step {step}: a statistics hook outlived its pass"
        w.flush()
    assert spy.hooked == [step % 3 == 0 for step in range(9)]
    stats = {(e["module"], e["phase"]): e for e in w.events if e["event"] == "stats"}
    for module in ("0", "1", "1.fc", "2"):
        for phase in ("forward", "backward"):
            assert stats[(module, phase)]["passes"] == 3, (module, phase)          # passes 0, 3 and 6
            assert stats[(module, phase)]["counted_passes"] == 1, (module, phase)  # the first sampled pass
    assert all(not m._forward_hooks for m in model.modules())


def test_a_sampled_forward_without_backward_takes_its_hooks_off_when_it_returns():
    model, spy = build()
    with watch(model, every=4, stats_every=2, locate_first=False) as w:
        for step in range(4):
            with torch.no_grad():
                model(torch.randn(2, 4))
            assert below_root_hooked(model) == []
        w.flush()
    assert spy.hooked == [True, False, True, False]
    stats = {(e["module"], e["phase"]): e for e in w.events if e["event"] == "stats"}
    assert stats[("1.fc", "forward")]["passes"] == 2


def test_detaching_inside_a_sampled_pass_and_attaching_again_restores_its_hooks():
    model, spy = build()
    w = watch(model, every=2, stats_every=1, locate_first=False)
    out = model(torch.randn(2, 4))
    assert below_root_hooked(model) == ["0", "1", "1.fc", "2"]      # the pass is open: its backward is due
    w.set_hooks(False)
    assert all(not m._forward_hooks for m in model.modules())
    w.set_hooks(True)
    assert below_root_hooked(model) == ["0", "1", "1.fc", "2"]
    out.sum().backward()
    assert below_root_hooked(model) == []
    w.close()
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    stats = {(e["module"], e["phase"]): e for e in w.events if e["event"] == "stats"}
    assert stats[("1.fc", "backward")]["passes"] == 1


def test_close_takes_off_the_hooks_of_a_sampled_forward_that_raised():
    model, _ = build()
    w = watch(model, stats_every=1, locate_first=False, max_replays=0)
    with pytest.raises(RuntimeError):
        model(torch.randn(2, 5))                       # wrong width: the first Linear raises
    w.close()
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


class Spike(nn.Module):
    """Writes inf where its input passes 0.5: an overflow a user's forward hook may absorb."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.masked_fill(x > 0.5, float("inf"))


def _clamp(mod: nn.Module, args: tuple, out: torch.Tensor) -> None:
    out.clamp_(-1e4, 1e4)           # in place: what the next module receives, and returns nothing


def _watched_run(hook_registered: str | None) -> tuple[list[dict], list[dict]]:
    """``(stats of the spike's forward, nonfinite events)`` of 4 steps, 2 of them sampled, with the clamp
    registered ``"before"`` or ``"after"`` watch() (or not at all)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Spike(), nn.Linear(4, 1))
    x = torch.randn(8, 4)
    if hook_registered == "before":
        model[1].register_forward_hook(_clamp)
    with watch(model, every=4, stats_every=2, locate_first=False, dtype=torch.bfloat16) as w:
        if hook_registered == "after":
            model[1].register_forward_hook(_clamp)
        for step in range(4):
            w.set_step(step)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(x).float().sum()
            loss.backward()
    stats = [e for e in w.events if e["event"] == "stats" and e["module"] == "1" and e["phase"] == "forward"]
    return stats, [e for e in w.events if e["event"] == "nonfinite"]


def test_a_module_s_statistics_are_of_its_output_after_the_users_forward_hooks():
    """The statistics hooks go on for a sampled pass, after every hook the user put on the module (before or after
    watch()): they read the output the next module receives. A user's in-place clamp that absorbs an inf is seen
    on a sampled pass as the unsampled passes see it, finite, so a sampled pass raises no alarm the model's own
    forward does not pass on."""
    stats, nonfinite = _watched_run(None)
    assert stats and stats[0]["inf"] > 0 and nonfinite                 # the spike is seen without the clamp
    for order in ("before", "after"):
        stats, nonfinite = _watched_run(order)
        assert stats and stats[0]["inf"] == 0 and stats[0]["absmax"] <= 1e4, (order, stats)
        assert nonfinite == [], (order, nonfinite)


@pytest.mark.parametrize("order", ["before", "after"])
def test_replays_start_from_the_callers_arguments_whatever_pre_hooks_the_root_has(order):
    """The watch's own pre-hook is the root's first, so its FP32 shadow and its locator replay (which call the
    root, and so the user's pre-hooks, again) see the caller's input: a pre-hook registered before watch() that
    doubles the input is not applied twice (the shadow measured rel_l2 0.49 against low precision then)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    seen: list[float] = []

    def double(mod: nn.Module, args: tuple) -> tuple:
        seen.append(float(args[0].abs().max()))
        return (args[0] * 2,)

    if order == "before":
        model.register_forward_pre_hook(double)
    x = torch.full((8, 4), 0.5)
    # The global scope only: the local and composite scopes re-run a module on the inputs its call recorded.
    with watch(model, every=1, divergence_every=1, local_divergence_every=None, composite_divergence_every=None,
               dtype=torch.bfloat16) as w:
        if order == "after":
            model.register_forward_pre_hook(double)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(x).float().sum().backward()
    assert len(seen) >= 3 and set(seen) == {0.5}, seen      # the pass, the FP32 shadow, the first replay
    rel = [e["rel_l2"] for e in w.events if e["event"] == "divergence" and e["module"] == "" and e["scope"] == "global"]
    assert rel and rel[0] < 0.05, rel
