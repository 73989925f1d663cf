"""LossScaler: the policy on top of torch.amp.GradScaler (backoff, growth, hysteresis, clamps, halts, state)."""
import math

import pytest
import torch

from ampaudit.errors import TrainError, UsageError
from ampaudit.train.scaler import LossScaler, scaler_for


def _one_step(scaler: LossScaler, param: torch.nn.Parameter, opt: torch.optim.Optimizer, *, overflow: bool) -> bool:
    """A full scale -> backward -> unscale_ -> step -> update cycle; ``overflow`` makes the gradient inf."""
    loss = (param * (math.inf if overflow else 1.0)).sum()
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    stepped = scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)
    return stepped


@pytest.fixture
def setup():
    param = torch.nn.Parameter(torch.ones(3))
    return param, torch.optim.SGD([param], lr=0.1)


def test_overflow_skips_and_backs_off_clean_steps_grow(setup):
    param, opt = setup
    scaler = LossScaler(init_scale=1024.0, growth_interval=3)
    before = param.detach().clone()
    assert not _one_step(scaler, param, opt, overflow=True)
    assert torch.equal(param.detach(), before)            # skipped: weights untouched
    assert scaler.get_scale() == 512.0 and scaler.total_skips == 1
    for _ in range(3):
        assert _one_step(scaler, param, opt, overflow=False)
    assert scaler.get_scale() == 1024.0                   # grew after growth_interval clean steps
    assert not torch.equal(param.detach(), before)
    # the gradient the optimizer saw was unscaled: SGD moved each weight by lr * 1 per clean step
    assert torch.allclose(param.detach(), before - 0.3)


def test_min_and_max_clamp(setup):
    param, opt = setup
    scaler = LossScaler(init_scale=4.0, min_scale=2.0, max_scale=8.0, growth_interval=1, max_consecutive_skips=None)
    for _ in range(5):
        _one_step(scaler, param, opt, overflow=True)
    assert scaler.get_scale() == 2.0                      # plain GradScaler would be at 4 / 2**5
    for _ in range(5):
        _one_step(scaler, param, opt, overflow=False)
    assert scaler.get_scale() == 8.0


def test_hysteresis_tolerates_overflows_before_backing_off(setup):
    param, opt = setup
    scaler = LossScaler(init_scale=1024.0, hysteresis=3)
    _one_step(scaler, param, opt, overflow=True)
    _one_step(scaler, param, opt, overflow=True)
    assert scaler.get_scale() == 1024.0 and scaler.total_skips == 2
    _one_step(scaler, param, opt, overflow=True)
    assert scaler.get_scale() == 512.0


def test_halt_after_consecutive_skips_resets_on_clean_step(setup):
    param, opt = setup
    scaler = LossScaler(init_scale=4.0, max_consecutive_skips=3)
    _one_step(scaler, param, opt, overflow=True)
    _one_step(scaler, param, opt, overflow=True)
    _one_step(scaler, param, opt, overflow=False)
    _one_step(scaler, param, opt, overflow=True)
    _one_step(scaler, param, opt, overflow=True)
    assert scaler.halt_reason() is None
    _one_step(scaler, param, opt, overflow=True)
    reason = scaler.halt_reason()
    assert reason and "3 consecutive" in reason and "at its minimum" in reason


def test_halt_on_skip_fraction_in_window(setup):
    param, opt = setup
    scaler = LossScaler(init_scale=2.0 ** 20, max_consecutive_skips=None, skip_window=4, max_skip_fraction=0.5)
    for overflow in (True, False, True):
        _one_step(scaler, param, opt, overflow=overflow)
    assert scaler.halt_reason() is None                   # window not full yet
    _one_step(scaler, param, opt, overflow=False)
    assert "50% of the last 4" in scaler.halt_reason()


def test_static_scale_never_changes_but_still_skips(setup):
    param, opt = setup
    scaler = LossScaler(dynamic=False, init_scale=128.0, growth_interval=1)
    assert not _one_step(scaler, param, opt, overflow=True)
    assert _one_step(scaler, param, opt, overflow=False)
    assert scaler.get_scale() == 128.0


def test_disabled_scaler_passes_through(setup):
    param, opt = setup
    scaler = LossScaler(enabled=False)
    loss = param.sum()
    assert scaler.scale(loss) is loss
    assert _one_step(scaler, param, opt, overflow=False)
    assert scaler.get_scale() is None and scaler.halt_reason() is None


def test_state_dict_round_trip_keeps_every_tracker(setup):
    param, opt = setup
    scaler = LossScaler(init_scale=1024.0, hysteresis=2, growth_interval=10, skip_window=5)
    for overflow in (True, True, False, True, False, False):
        _one_step(scaler, param, opt, overflow=overflow)
    state = scaler.state_dict()
    other = LossScaler(init_scale=2.0 ** 16, hysteresis=2, growth_interval=10, skip_window=5)
    other.load_state_dict(state)
    assert other.state_dict() == state
    # 1024 -(2nd overflow)-> 512 -(3rd, tolerance used up until the next growth)-> 256
    assert other.get_scale() == 256.0 and other.growth_tracker == 2 and other.hysteresis_left == 0
    assert other.total_skips == 3 and list(other.window) == [True, False, True, False, False]
    # the restored scale is the one GradScaler multiplies the loss by (the transformers #34053 failure)
    assert other.scale(torch.tensor(1.0)).item() == 256.0
    torch.save(state, "/dev/null")  # plain data: picklable


def test_load_state_dict_refuses_enabled_mismatch():
    with pytest.raises(TrainError, match="loss scaling on"):
        LossScaler(enabled=False).load_state_dict(LossScaler().state_dict())


def test_scale_is_computed_in_fp32():
    # an fp16 loss of 2 times 65536 is inf in fp16; the scaler scales in fp32
    scaled = LossScaler().scale(torch.tensor(2.0, dtype=torch.float16))
    assert scaled.dtype == torch.float32 and scaled.item() == 131072.0


def test_double_unscale_is_a_clear_error(setup):
    param, opt = setup
    scaler = LossScaler()
    scaler.scale(param.sum()).backward()
    scaler.unscale_(opt)
    with pytest.raises(TrainError, match="already been called"):
        scaler.unscale_(opt)


@pytest.mark.parametrize("kwargs, needle", [
    ({"backoff_factor": 1.5}, "backoff_factor"), ({"hysteresis": 0}, "hysteresis"),
    ({"min_scale": 10.0, "max_scale": 1.0}, "min_scale"), ({"init_scale": math.nan}, "init_scale"),
    ({"max_skip_fraction": 2.0}, "max_skip_fraction"),
])
def test_bad_policy_is_a_usage_error(kwargs, needle):
    with pytest.raises(UsageError, match=needle):
        LossScaler(**kwargs)


def test_scaler_for_each_loss_scale_mode():
    assert scaler_for("auto", torch.float16).dynamic and scaler_for("auto", torch.float16).enabled
    assert not scaler_for("auto", torch.bfloat16).enabled      # bf16 trains without a scaler
    static = scaler_for("1024", torch.float16, hysteresis=2)
    assert static.enabled and not static.dynamic and static.get_scale() == 1024.0 and static.hysteresis == 2
    assert scaler_for("dynamic", torch.bfloat16, max_consecutive_skips=7).max_consecutive_skips == 7
    with pytest.raises(UsageError, match="bad loss scale"):
        scaler_for("lots", torch.float16)
