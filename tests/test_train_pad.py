"""train --pad: a misaligned Linear kept out of float8 for alignment alone is padded (zero rows/columns, hooks),
computes what it did, trains in float8, and its saved weights load into the user's unpadded model class."""
from __future__ import annotations

import copy
import importlib.util
import itertools
from pathlib import Path

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

pytest.importorskip("torchao")

import ampaudit  # noqa: E402
import ampaudit.cli.commands  # noqa: E402,F401  registers the commands
from ampaudit.cli.app import app  # noqa: E402
from ampaudit.planning.apply import apply_plan  # noqa: E402
from ampaudit.rewrite.pad import pad_linear  # noqa: E402

HEAD = Path(__file__).resolve().parent / "planted_fp8" / "misaligned_head.py"


def _head_module():
    spec = importlib.util.spec_from_file_location("_train_pad_misaligned_head", HEAD)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


mh = _head_module()


def _plan_of(model) -> dict:
    batches = [((x,), {}, y) for x, y in itertools.islice(mh.train_data(), 2)]
    return ampaudit.plan(model, batches, loss_fn=mh.loss_fn, speed_model="off").to_dict()


def test_padded_linear_computes_the_same_fp32_output_and_saves_unpadded_shapes():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(30, 70), nn.GELU(), nn.Linear(70, 10))
    x = torch.randn(3, 5, 30)
    before = model(x)
    state = copy.deepcopy(model.state_dict())
    padded = copy.deepcopy(model)
    changes = [pad_linear(padded[0], {"in_features": 32, "out_features": 80}, name="0"),
               pad_linear(padded[2], {"out_features": 16}, name="2")]
    assert padded[0].weight.shape == (80, 32) and padded[2].weight.shape == (16, 70)
    assert [c.dims for c in changes] == [{"in_features": (30, 32), "out_features": (70, 80)},
                                         {"out_features": (10, 16)}]
    with torch.no_grad():
        after = padded(x)
    assert after.shape == before.shape
    torch.testing.assert_close(after, before, rtol=0, atol=1e-6)   # zero columns: only the GEMM's K blocking moves
    saved = padded.state_dict()
    assert {k: tuple(v.shape) for k, v in saved.items()} == {k: tuple(v.shape) for k, v in state.items()}
    fresh = nn.Sequential(nn.Linear(30, 70), nn.GELU(), nn.Linear(70, 10))
    fresh.load_state_dict(saved)                                   # the user's unpadded class, strict
    assert all(torch.equal(fresh.state_dict()[k], state[k]) for k in state)
    again = copy.deepcopy(padded)
    again.load_state_dict(state)                                   # unpadded weights into the padded model
    assert again[0].weight.shape == (80, 32) and not again[0].weight[70:].any() and not again[0].weight[:, 30:].any()


def test_a_layer_kept_out_for_alignment_alone_is_padded_into_float8_with_the_same_fp8_numerics():
    from torchao.float8.float8_linear import Float8Linear

    model = mh.build_model()
    plan = _plan_of(model)
    head = next(layer for layer in plan["layers"] if layer["module"] == "lm_head")
    assert head["choice"] == "bfloat16" and head["float8_if_padded"] == {"out_features": 272}
    unpadded = copy.deepcopy(model)                 # what the CPU emulation runs without padding
    forced = copy.deepcopy(plan)
    next(la for la in forced["layers"] if la["module"] == "lm_head")["choice"] = "float8_tensorwise"
    apply_plan(unpadded, forced)
    padded = copy.deepcopy(model)
    chosen = apply_plan(padded, plan, pad=True)
    assert "lm_head" in chosen["float8"] and set(chosen["padded"]) == {"lm_head"}
    assert isinstance(padded.lm_head, Float8Linear) and padded.lm_head.weight.shape == (272, mh.DIM)
    assert "padded" not in apply_plan(copy.deepcopy(model), plan)      # without pad nothing is padded
    x, y = next(iter(mh.train_data()))
    out_u, out_p = unpadded(x), padded(x)
    assert torch.equal(out_p, out_u)                # zero rows leave the tensorwise amax and every other row alone
    mh.loss_fn(out_u, y).backward()
    mh.loss_fn(out_p, y).backward()
    assert torch.equal(padded.lm_head.weight.grad[:mh.VOCAB], unpadded.lm_head.weight.grad)
    assert not padded.lm_head.weight.grad[mh.VOCAB:].any()          # the padding gets no gradient: it stays zero


def test_padding_stays_zero_through_training():
    model = mh.build_model()
    apply_plan(model, _plan_of(model), pad=True)
    trainer = ampaudit.Trainer(model, mh.loss_fn, mh.train_data, dtype="bfloat16", handle_signals=False,
                               optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1))
    trainer.fit(steps=3)
    assert not model.lm_head.weight[mh.VOCAB:].any() and not model.lm_head.bias[mh.VOCAB:].any()
    assert model.lm_head.weight[:mh.VOCAB].abs().sum() > 0


def test_cli_train_plan_pad_saves_weights_the_unpadded_model_loads(tmp_path):
    plan, weights = tmp_path / "plan.json", tmp_path / "w.pt"
    runner = CliRunner()
    made = runner.invoke(app, ["plan", str(HEAD), "--speed-model", "off", "-o", str(plan)])
    assert made.exit_code == 0, made.output
    result = runner.invoke(app, ["train", str(HEAD), "--steps", "2", "--plan", str(plan), "--pad",
                                 "--save", str(weights)])
    assert result.exit_code == 0, result.output
    assert "3 float8 layer(s) (1 padded: lm_head Float8Linear: out_features 257->272" in result.output
    fresh = mh.build_model()
    init = copy.deepcopy(fresh.state_dict())
    fresh.load_state_dict(torch.load(weights))        # strict: same keys, the unpadded shapes
    assert not torch.equal(fresh.lm_head.weight, init["lm_head.weight"])    # trained
    without = runner.invoke(app, ["train", str(HEAD), "--steps", "1", "--plan", str(plan)])
    assert without.exit_code == 0 and "2 float8 layer(s), 0 float32" in without.output


def test_cli_pad_needs_a_float8_plan():
    result = CliRunner().invoke(app, ["train", str(HEAD), "--steps", "1", "--pad"])
    assert result.exit_code == 2 and "--pad pads the layers a float8 plan keeps out" in result.output
