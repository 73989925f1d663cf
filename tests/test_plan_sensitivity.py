"""Where a layer's float8 error goes: the model's gradients with that layer alone in float8."""
from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

pytest.importorskip("torchao")

from ampaudit.planning.sensitivity import combined_sqnr, model_sensitivity  # noqa: E402


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.head = nn.Linear(32, 64), nn.Linear(64, 64), nn.Linear(64, 16)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        return self.head(self.drop(torch.relu(self.b(torch.relu(self.a(x))))))


def _batch():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(128, 32, generator=g),), {}, torch.randint(0, 16, (128,), generator=g)


def _grads(model, batch):
    (x,), _, y = batch
    torch.manual_seed(5)
    loss = nn.functional.cross_entropy(model(x), y)
    return torch.cat([g.double().flatten() for g in torch.autograd.grad(loss, list(model.parameters()))])


def test_the_model_is_left_as_it_was():
    torch.manual_seed(0)
    model = Net()
    before = copy.deepcopy(model.state_dict())
    rng = torch.get_rng_state()
    model_sensitivity(model, _batch(), ["a", "b", "head"], loss_fn=nn.functional.cross_entropy)
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert type(model.a) is nn.Linear and type(model.head) is nn.Linear
    assert torch.equal(torch.get_rng_state(), rng)


def test_layer_noises_add_up_to_the_all_float8_model():
    """The plan's predicted gradient SQNR for a set of float8 layers is the sum of their noises: check it against
    the model with all of them really in float8 (same dropout masks)."""
    from ampaudit.precision.fp8 import config, import_torchao

    torch.manual_seed(0)
    model = Net()
    batch = _batch()
    found = model_sensitivity(model, batch, ["a", "b", "head"], loss_fn=nn.functional.cross_entropy)
    assert all(10 < v["sqnr_db"] < 60 for v in found.values()), found
    predicted = combined_sqnr(v["noise"] for v in found.values())
    ref = _grads(model, batch)
    fp8 = copy.deepcopy(model)
    import_torchao().convert_to_float8_training(fp8, config=config("tensorwise"))
    got = _grads(fp8, batch)
    measured = 10 * math.log10(float(ref.square().sum() / (got - ref).square().sum()))
    assert abs(predicted - measured) < 1.5, (predicted, measured)
    assert combined_sqnr([]) == math.inf


def test_an_exact_layer_adds_no_noise_and_a_broken_one_all_of_it():
    from ampaudit.planning.sensitivity import _noise

    assert _noise(math.inf) == 0.0 and combined_sqnr([_noise(math.inf)]) == math.inf
    assert _noise(math.nan) == math.inf and _noise(-math.inf) == math.inf
    assert combined_sqnr([_noise(math.inf), _noise(30.0)]) == pytest.approx(30.0)
    # the plan's summary says what its table says: exact model gradients are inf dB, not -inf
    import ampaudit

    torch.manual_seed(0)
    plan = ampaudit.plan(nn.Sequential(nn.Linear(64, 64)), [((torch.randn(64, 64),), {})],
                         recipes="rowwise_with_gw_hp", speed_model="off")
    grads = plan.layers[0].metrics[plan.layers[0].choice]["model_grads"]["sqnr_db"]
    assert plan.summary()["predicted_grad_sqnr_db"]["plan"] == pytest.approx(grads)
