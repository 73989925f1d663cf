"""The planted float8 faults in tests/planted_fp8/ are real, and ``ampaudit.plan`` keeps each culprit out of float8
for the right reason while the Linears named in EXPECT get float8; a plan applied to training changes only the layers
it chose, and an FP8 run resumes bit-identically.

Each fault is checked with torchao's own Float8Linear (emulated on CPU) on the input and output gradient the layer
really gets in an FP32 run, independently of ampaudit's measurement; torchao's own filter is shown beside.
"""
from __future__ import annotations

import copy
import functools
import math

import pytest
import torch
from conftest import ASSETS, ROOT, load_module
from torch import nn

import ampaudit
from ampaudit.errors import UsageError
from ampaudit.precision import fp8

try:
    fp8.import_torchao()
except UsageError:
    pytest.skip("torchao is not installed (the fp8 extra)", allow_module_level=True)

from ampaudit.planning.apply import apply_plan
from ampaudit.precision.recipes import parse_recipes  # noqa: E402
from ampaudit.planning.choose import Budget  # noqa: E402
from ampaudit.train import Trainer  # noqa: E402
from ampaudit.train.checkpoint import LAST  # noqa: E402

OWN = ROOT / "tests" / "planted_fp8"
FILES = sorted(p for p in OWN.glob("*.py") if not p.name.startswith("_"))
# What a culprit's reason says, per EXPECT["reason"] (choose.py's wording).
REASONS = {"budget": "dB budget", "flushed": "flush to 0 in float8", "alignment": "not a multiple of 16"}
BUDGET = Budget.default()


@functools.cache
def _planted(stem: str):
    return load_module(OWN / f"{stem}.py")


def _batches(m, count: int = 1) -> list[tuple]:
    out = []
    for inputs, target in m.train_data():
        out.append(((inputs,), {}, target))
        if len(out) == count:
            break
    return out


@functools.cache
def _plan(stem: str, recipe: str, pad: bool = False):
    m = _planted(stem)
    return ampaudit.plan(m.build_model(), _batches(m), recipe=recipe, loss_fn=m.loss_fn, speed_model="off", pad=pad)


def _layers(plan) -> dict:
    return {layer.module: layer for layer in plan.layers}


def _sqnr(ref: torch.Tensor, got: torch.Tensor) -> float:
    noise = float((got.double() - ref.double()).square().sum())
    return math.inf if noise == 0 else 10 * math.log10(float(ref.double().square().sum()) / noise)


def _seen_by(m, model: nn.Module, name: str, batch: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """The input of Linear ``name`` and the gradient of ``m.loss_fn`` at its output, in one FP32 step."""
    (args, _, target) = batch
    got = {}

    def hook(mod, inputs, output):
        got["x"] = inputs[0].detach()
        output.register_hook(lambda g: got.__setitem__("go", g.detach()))

    handle = model.get_submodule(name).register_forward_hook(hook)
    try:
        m.loss_fn(model(*args), target).backward()
    finally:
        handle.remove()
    model.zero_grad(set_to_none=True)
    return got["x"], got["go"]


def _run(lin: nn.Linear, x: torch.Tensor, go: torch.Tensor, *, recipe: str | None = None,
         autocast: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """output, grad_input, grad_weight of ``lin`` (a copy; as torchao's Float8Linear for ``recipe``) on ``x``, ``go``."""
    layer = copy.deepcopy(lin)
    if recipe is not None:
        layer = fp8.import_torchao().convert_to_float8_training(nn.Sequential(layer), config=fp8.config(recipe))[0]
        assert type(layer).__name__ == "Float8Linear"
    x = x.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        y = layer(x)
    gi, gw = torch.autograd.grad(y, (x, layer.weight), go.to(y.dtype))
    return {"output": y.detach().float(), "grad_input": gi.float(), "grad_weight": gw.float()}


# -- EXPECT and the plan ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_expect_names_linears_of_the_model(path):
    m = _planted(path.stem)
    expect = m.EXPECT
    assert set(expect) == {"keep_out", "reason", "recipe", "fp8_ok"}
    assert expect["reason"] in REASONS and expect["recipe"] in fp8.RECIPES
    modules = dict(m.build_model().named_modules())
    for name in [expect["keep_out"], *expect["fp8_ok"]]:
        assert isinstance(modules.get(name), nn.Linear), name
    assert m.__doc__ and ("arXiv:" in m.__doc__ or "#" in m.__doc__)       # each cites its public source


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_plan_keeps_the_culprit_out_for_its_reason(path):
    m = _planted(path.stem)
    expect = m.EXPECT
    layers = _layers(_plan(path.stem, expect["recipe"]))
    culprit = layers[expect["keep_out"]]
    assert culprit.choice == "bfloat16", culprit.reasons
    assert culprit.reasons and all(REASONS[expect["reason"]] in r for r in culprit.reasons), culprit.reasons
    for name in expect["fp8_ok"]:
        assert layers[name].choice == parse_recipes(expect["recipe"])[0], (name, layers[name].reasons)
    assert set(layers) == {expect["keep_out"], *expect["fp8_ok"]}


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_torchaos_filter_beside_reads_shapes_only(path):
    # torchao's _auto_filter_for_recipe skips dims that are not multiples of 16 and, for speed, small GEMMs:
    # tensorwise converts a Linear only past K > 4096 or N > 1024. These models are small, so it converts none of
    # their Linears; given 8192 input features it would convert every aligned culprit, whatever its numbers.
    m = _planted(path.stem)
    expect = m.EXPECT
    layers = _layers(_plan(path.stem, expect["recipe"]))
    assert all(layer.torchao is False for layer in layers.values())
    culprit = layers[expect["keep_out"]]
    with torch.device("meta"):
        wide = nn.Linear(8192, culprit.out_features)
    keeps = fp8.import_torchao()._auto_filter_for_recipe(expect["recipe"], filter_fqns=[])(wide, culprit.module)
    assert keeps == (expect["reason"] != "alignment")


# -- the faults are real --------------------------------------------------------------------------------------------


def test_massive_activations_put_the_probe_below_budget_in_tensorwise_only():
    m = _planted("massive_activations")
    model = m.build_model()
    batch = _batches(m)[0]
    x, go = _seen_by(m, model, "probe", batch)
    others = x.clone()
    others[:, 0, list(m.MASSIVE_DIMS)] = 0
    assert x.abs().max() / others.abs().median() > 1e5           # the paper's "100,000 times larger"
    ref = _run(model.probe, x, go)
    ten = _run(model.probe, x, go, recipe="tensorwise")
    assert _sqnr(ref["output"], ten["output"]) < BUDGET.forward_db
    assert _sqnr(ref["output"], _run(model.probe, x, go, autocast=torch.bfloat16)["output"]) > 40
    # Rowwise scales the input per token for the output GEMM: the start token's scale is its own.
    assert _sqnr(ref["output"], _run(model.probe, x, go, recipe="rowwise")["output"]) > 25
    # The massive activations are the cause: without them the probe keeps float8's usual ~28 dB.
    clean_model = m.build_model()
    clean_model.massive.zero_()
    cx, cgo = _seen_by(m, clean_model, "probe", batch)
    assert _sqnr(_run(clean_model.probe, cx, cgo)["output"],
                 _run(clean_model.probe, cx, cgo, recipe="tensorwise")["output"]) > 25
    # The block's Linears read RMSNorm(h) and stay at float8's usual level.
    for name in m.EXPECT["fp8_ok"]:
        bx, bgo = _seen_by(m, model, name, batch)
        lin = model.get_submodule(name)
        assert _sqnr(_run(lin, bx, bgo)["output"], _run(lin, bx, bgo, recipe="tensorwise")["output"]) > 25, name


def test_grad_range_flushes_most_gradients_and_freezes_absent_tokens_rows():
    m = _planted("grad_range")
    model = m.build_model()
    x, go = _seen_by(m, model, "lm_head", _batches(m)[0])
    # Tensorwise casts grad_output with one scale, amax -> e5m2's max (torchao's _ToFloat8ConstrFunc).
    e5m2 = torch.finfo(torch.float8_e5m2)
    nonzero = go != 0
    cast = (go * (e5m2.max / go.abs().max())).to(torch.float8_e5m2).float()
    flushed = float((nonzero & (cast == 0)).sum() / nonzero.sum())
    assert flushed > 0.5
    assert math.log2(float(go.abs().max() / go[..., m.SEEN:].abs().max())) > math.log2(e5m2.max / 2.0 ** -16)
    ref = _run(model.lm_head, x, go)
    ten = _run(model.lm_head, x, go, recipe="tensorwise")
    bf16 = _run(model.lm_head, x, go, autocast=torch.bfloat16)
    absent = slice(m.SEEN, None)
    assert bool((ref["grad_weight"][absent].abs().sum(1) > 0).all())
    assert bool((bf16["grad_weight"][absent].abs().sum(1) > 0).all())      # bf16 has fp32's exponent range
    assert bool((ten["grad_weight"][absent] == 0).all())                    # every absent token's row frozen
    # The energy-weighted SQNR does not see it: the flushed values are tiny.
    assert _sqnr(ref["grad_weight"], ten["grad_weight"]) > BUDGET.backward_db
    # Rowwise scales grad_output per vocabulary column for grad_weight: those rows survive.
    row = _run(model.lm_head, x, go, recipe="rowwise")
    assert bool((row["grad_weight"][absent].abs().sum(1) > 0).all())
    assert _layers(_plan("grad_range", "rowwise"))["lm_head"].choice == "bfloat16"   # per token it flushes too


def test_misaligned_head_is_fine_in_float8_once_padded():
    from ampaudit.rewrite import fix

    m = _planted("misaligned_head")
    assert m.VOCAB % 16 and m.build_model().lm_head.out_features == m.VOCAB
    culprit = _layers(_plan("misaligned_head", "tensorwise"))["lm_head"]
    roles = culprit.metrics["float8_tensorwise"]
    assert roles["output"]["sqnr_db"] >= BUDGET.forward_db                  # its numbers are fine
    assert min(roles[r]["sqnr_db"] for r in ("grad_input", "grad_weight")) >= BUDGET.backward_db
    padded = _layers(_plan("misaligned_head", "tensorwise", pad=True))["lm_head"]
    assert padded.choice == "float8_tensorwise" and padded.padded == {"out_features": 272}
    # fix --pad really pads it: zero rows, the same logits, and the padded head plans as float8 without --pad.
    model = m.build_model()
    args = m.example_inputs()
    fixed = fix(model, *args, device="cuda", dtype="float8", pad=True).module
    assert fixed.get_submodule("lm_head").out_features == 272
    with torch.no_grad():
        assert torch.equal(fixed(*args), model(*args))


# -- a plan applied to training --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mlp():
    return load_module(ASSETS / "train_mlp.py")


@pytest.fixture(scope="module")
def mlp_plan(mlp):
    batches = _batches(mlp)
    # fc2 flagged as check would flag it, so the plan has a layer of each choice: fc1 float8, fc2 float32, head
    # bfloat16 (out_features 1).
    plan = ampaudit.plan(mlp.build_model(), batches, loss_fn=mlp.loss_fn, speed_model="off", recipes="tensorwise",
                         flagged={"fc2": "kept fp32 for this test"}).to_dict()
    assert [(layer["module"], layer["choice"]) for layer in plan["layers"]] == [
        ("fc1", "float8_tensorwise"), ("fc2", "float32"), ("head", "bfloat16")]
    return plan



def test_apply_plan_changes_only_the_chosen_layers(mlp, mlp_plan):
    plain, model = mlp.build_model(), mlp.build_model()
    assert apply_plan(model, mlp_plan) == {"float8": ["fc1"], "float32": ["fc2"]}
    assert type(model.fc1).__name__ == "Float8Linear"
    assert getattr(model.fc2, "_ampaudit_keep_fp32", False) and isinstance(model.fc2, nn.Linear)
    for name, mod in plain.named_modules():
        if name not in ("fc1", "fc2"):
            assert type(model.get_submodule(name)) is type(mod), name
    assert list(model.state_dict()) == list(plain.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), plain.state_dict().values()))
    x64 = torch.randn(16, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(model.head(x64), plain.head(x64))              # bf16 as before
        assert model.fc2(x64).dtype == torch.float32 and plain.fc2(x64).dtype == torch.bfloat16
        x16 = torch.randn(16, 16)
        assert not torch.equal(model.fc1(x16).float(), plain.fc1(x16).float())   # float8 now


def test_float8_run_resumes_bit_identically(mlp, mlp_plan, tmp_path):
    def trainer(plan=mlp_plan, **kwargs):
        model = mlp.build_model()
        if plan is not None:
            apply_plan(model, plan)
        return Trainer(model, mlp.loss_fn, mlp.train_data, optimizer=mlp.make_optimizer,
                       scheduler=mlp.make_scheduler, dtype="bfloat16", handle_signals=False, **kwargs)

    steps = 6
    whole = trainer()
    whole.fit(steps=steps)
    first = trainer(checkpoint_dir=tmp_path)
    first.fit(steps=steps // 2)
    # Dynamic scaling keeps no state: torchao adds nothing to the checkpoint, so nothing is missing from it.
    saved = torch.load(tmp_path / LAST, weights_only=True)
    assert list(saved["model"]) == list(mlp.build_model().state_dict())
    second = trainer(checkpoint_dir=tmp_path)
    second.fit(steps=steps, resume=True)
    assert second.step == steps
    for (name, a), b in zip(whole.model.state_dict().items(), second.model.state_dict().values()):
        assert torch.equal(a, b), name
    bf16 = trainer(plan=None)
    bf16.fit(steps=steps)
    assert not torch.equal(whole.model.fc1.weight, bf16.model.fc1.weight)   # float8 really trained fc1
