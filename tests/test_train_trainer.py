"""Trainer: loss scaling on tiny_grads, skipped steps and halts, O2 masters, clipping, accumulation, scheduler."""
import json
import math

import pytest
import torch
from conftest import ASSETS, load_module

from ampaudit.errors import TrainError, TrainingHalted, UsageError
from ampaudit.runtime.trace import read_trace
from ampaudit.train import LossScaler, Trainer


@pytest.fixture(scope="module")
def mlp():
    return load_module(ASSETS / "train_mlp.py")


def _steps(path):
    events, problems = read_trace(path)
    assert not problems
    return [e for e in events if e["event"] == "step"], events


def test_tiny_grads_needs_loss_scaling(planted, tmp_path):
    tg = planted("tiny_grads")
    runs = {}
    for mode in ("dynamic", "none"):
        trace = tmp_path / f"{mode}.jsonl"
        result = Trainer(tg.build_model(), tg.loss_fn, tg.train_data, dtype="float16", loss_scale=mode,
                         lr=1e-3, trace=trace).fit(steps=120)
        steps, events = _steps(trace)
        assert events[0]["event"] == "meta" and events[0]["source"] == "train" and len(steps) == 120
        runs[mode] = (result, steps)
    scaled, flushed = runs["dynamic"], runs["none"]
    first = sum(scaled[0].losses[:10]) / 10
    # with the scaler the loss falls by well over half; without it, it does not move at all
    assert sum(scaled[0].losses[-10:]) / 10 < 0.5 * first
    assert sum(flushed[0].losses[-10:]) / 10 > 0.9 * first
    # the trace shows why: without scaling the gradients flush to zero in fp16
    zero = sum(1 for s in flushed[1] if s["grad_norm"] == 0.0)
    assert zero > 0.5 * len(flushed[1]) and all(s["scale"] is None for s in flushed[1])
    assert all(s["grad_norm"] > 0 and s["scale"] == 65536.0 for s in scaled[1])
    # and the watch hooks --trace turns on show where: every backward value of the hidden layers is zero
    def body_grads(mode):
        events, _ = read_trace(tmp_path / f"{mode}.jsonl")
        return [e for e in events if e["event"] == "stats" and e["phase"] == "backward"
                and e["module"].startswith("body")]
    assert body_grads("none") and all(e["zeros"] == e["numel"] for e in body_grads("none"))
    assert body_grads("dynamic") and all(e["zeros"] < e["numel"] for e in body_grads("dynamic"))


class InjectInf:
    """Backward hook that turns a parameter's gradient to inf on chosen optimizer steps."""

    def __init__(self, trainer: Trainer, bad_steps: set[int]):
        self.trainer, self.bad = trainer, bad_steps

    def __call__(self, grad):
        return grad * math.inf if self.trainer.step + 1 in self.bad else grad


def test_injected_inf_steps_are_skipped_and_scale_backs_off(mlp, tmp_path):
    model = mlp.build_model(dropout=0.0)
    trainer = Trainer(model, mlp.loss_fn, mlp.train_data, optimizer=mlp.make_optimizer, scheduler=mlp.make_scheduler,
                      dtype="float16", trace=tmp_path / "t.jsonl")
    model.fc2.weight.register_hook(InjectInf(trainer, {3, 4}))
    trainer.fit(steps=2)
    weights = {k: v.clone() for k, v in model.state_dict().items() if "running" not in k and "num_batches" not in k}
    sched_epoch = trainer.scheduler.last_epoch
    trainer.fit(steps=4)
    for name, before in weights.items():
        assert torch.equal(model.state_dict()[name], before), name   # skipped steps leave weights untouched
    assert trainer.scheduler.last_epoch == sched_epoch                # and do not advance the LR schedule
    assert trainer.scaler.get_scale() == 2.0 ** 14 and trainer.scaler.total_skips == 2
    trainer.fit(steps=5)
    assert not torch.equal(model.fc2.weight, weights["fc2.weight"])
    steps, events = _steps(tmp_path / "t.jsonl")
    assert [s["skipped"] for s in steps] == [False, False, True, True, False]
    skips = [e for e in events if e["event"] == "skip"]
    assert [e["step"] for e in skips] == [3, 4] and "fc2.weight" in skips[0]["params"]
    assert "fc2" in skips[0]["modules"]


def test_consecutive_skips_halt_with_checkpoint_and_diagnosis(mlp, tmp_path):
    model = mlp.build_model(dropout=0.0)
    ckpt = tmp_path / "ckpt"
    trainer = Trainer(model, mlp.loss_fn, mlp.train_data, dtype="float16", max_consecutive_skips=4,
                      checkpoint_dir=ckpt, trace=tmp_path / "t.jsonl")
    model.fc1.weight.register_hook(InjectInf(trainer, set(range(3, 100))))
    with pytest.raises(TrainingHalted) as info:
        trainer.fit(steps=50)
    assert info.value.exit_code == 3
    assert "halted at step 6" in info.value.message and "fc1" in info.value.message
    assert (ckpt / "halted.pt").is_file()
    state = torch.load(ckpt / "halted.pt", weights_only=True)
    assert state["step"] == 6 and state["scaler"]["consecutive_skips"] == 4
    diagnosis = json.loads((ckpt / "halt.json").read_text())
    assert diagnosis["overflowing_modules"][0] == {"module": "fc1", "skipped_steps": 4}
    assert [h["skipped"] for h in diagnosis["scale_history"]] == [False, False, True, True, True, True]
    _, events = _steps(tmp_path / "t.jsonl")
    assert [e for e in events if e["event"] == "halt"][0]["reason"].startswith("4 consecutive")
    # the watch's last statistics come before the halt, which ends the trace
    assert events[-1]["event"] == "halt" and any(e["event"] == "stats" for e in events)


def test_o2_keeps_fp32_masters_and_batchnorm(mlp):
    model = mlp.build_model(dropout=0.0)
    trainer = Trainer(model, mlp.loss_fn, mlp.train_data, optimizer=mlp.make_optimizer, dtype="float16",
                      opt_level="O2")
    assert model.fc1.weight.dtype == torch.float16 and model.bn.weight.dtype == torch.float32
    assert model.bn.running_var.dtype == torch.float32
    opt_params = [p for g in trainer.optimizer.param_groups for p in g["params"]]
    assert all(p.dtype == torch.float32 for p in opt_params)
    assert not any(p is model.fc1.weight for p in opt_params)
    result = trainer.fit(steps=30)
    assert result.losses[-1] < result.losses[0]
    # the model holds the masters rounded to fp16
    for (name, master), p in zip(trainer.masters.named_parameters(), trainer.masters.model_params):
        assert torch.equal(p, master.to(p.dtype)), name


def test_fp16_weights_without_masters_are_refused(mlp):
    with pytest.raises(TrainError, match="no FP32 master weights"):
        Trainer(mlp.build_model().half(), mlp.loss_fn, mlp.train_data, dtype="float16", opt_level="O1")


def test_bf16_trains_without_a_scaler(mlp):
    trainer = Trainer(mlp.build_model(), mlp.loss_fn, mlp.train_data, dtype="bfloat16")
    assert not trainer.scaler.enabled
    result = trainer.fit(steps=3)
    assert result.scale is None and result.steps == 3


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def test_accumulation_equals_one_big_batch(mlp):
    # fp32 so the comparison is tight: 2 micro-batches of 16 == 1 batch of 32 with a mean loss (no BatchNorm:
    # its batch statistics differ between 16 and 32 rows)
    accum = Trainer(mlp.build_model(dropout=0.0, batchnorm=False), mlp.loss_fn, lambda: mlp.train_data(batch=16), optimizer=_sgd,
                    dtype="float32", accum=2)
    accum.fit(steps=3)
    big = Trainer(mlp.build_model(dropout=0.0, batchnorm=False), mlp.loss_fn, lambda: mlp.train_data(batch=32), optimizer=_sgd,
                  dtype="float32")
    # batch=32 draws the generator differently; feed it the concatenated pairs instead
    pairs = list(mlp.train_data(batch=16, batches=6))
    big._stream._factory = lambda: [(torch.cat([pairs[i][0], pairs[i + 1][0]]),
                                     torch.cat([pairs[i][1], pairs[i + 1][1]])) for i in range(0, 6, 2)]
    big.fit(steps=3)
    for (name, a), b in zip(accum.model.named_parameters(), big.model.parameters()):
        assert torch.allclose(a, b, atol=1e-5), name


def test_clip_once_at_boundary_after_unscale(mlp, tmp_path, monkeypatch):
    calls = []
    real = torch.nn.utils.clip_grads_with_norm_

    def counting(params, max_norm, total_norm, **kw):
        params = list(params)
        calls.append(float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params]))))
        assert float(total_norm) == pytest.approx(calls[-1], rel=1e-5)    # the norm it clips with is the grads'
        return real(params, max_norm, total_norm, **kw)

    monkeypatch.setattr(torch.nn.utils, "clip_grads_with_norm_", counting)
    trainer = Trainer(mlp.build_model(), mlp.loss_fn, mlp.train_data, dtype="float16", accum=4, clip_norm=0.05,
                      trace=tmp_path / "t.jsonl")
    trainer.fit(steps=3)
    steps, _ = _steps(tmp_path / "t.jsonl")
    assert len(calls) == 3                                   # once per optimizer step, not per micro-batch
    for norm, step in zip(calls, steps):
        assert norm < 100                                    # unscaled: a scaled norm would be ~65536x larger
        assert step["grad_norm"] == pytest.approx(norm, rel=1e-5) and step["clipped"] is True


@pytest.mark.parametrize("kwargs", [{"clip_norm": 0.01, "clip_mode": "layer"}, {"clip_value": 1e-4}])
def test_per_layer_and_value_clipping(mlp, tmp_path, kwargs):
    trainer = Trainer(mlp.build_model(dropout=0.0), mlp.loss_fn, mlp.train_data, optimizer=_sgd,
                      dtype="bfloat16", trace=tmp_path / "t.jsonl", **kwargs)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.fit(steps=1)
    steps, _ = _steps(tmp_path / "t.jsonl")
    assert steps[0]["clipped"] is True and steps[0]["grad_norm"] > 0.01
    moved: dict[str, list[torch.Tensor]] = {}
    for name, p in trainer.model.named_parameters():
        # SGD with lr 0.1: the step divided by the lr is the clipped gradient (fp32 rounding: 2% slack)
        moved.setdefault(name.rpartition(".")[0], []).append((p.detach() - before[name]).flatten() / 0.1)
    for layer, parts in moved.items():
        grad = torch.cat(parts)
        if "clip_value" in kwargs:
            assert grad.abs().max() <= 1e-4 * 1.02, layer
        else:
            assert torch.linalg.vector_norm(grad) <= 0.01 * 1.02, layer
            assert torch.linalg.vector_norm(grad) >= 0.01 * 0.98, layer   # every layer here exceeds 0.01


def test_epochs_drop_the_partial_window(mlp):
    # 64 batches, accum 5: 12 full windows per epoch-stream of 128 batches -> 25 steps over two epochs
    result = Trainer(mlp.build_model(), mlp.loss_fn, mlp.train_data, dtype="bfloat16", accum=5).fit(epochs=2)
    assert result.steps == 25 and result.stopped == "epochs"


@pytest.mark.parametrize("kwargs, error", [
    ({"accum": 0}, UsageError), ({"clip_norm": 1.0, "clip_value": 1.0}, UsageError),
    ({"dtype": "int8"}, UsageError), ({"opt_level": "O3"}, UsageError), ({"loss_scale": "huge"}, UsageError),
    ({"opt_level": "O2", "dtype": "float32"}, UsageError), ({"clip_norm": -1.0}, UsageError),
])
def test_bad_settings_are_one_line_errors(mlp, kwargs, error):
    with pytest.raises(error):
        Trainer(mlp.build_model(), mlp.loss_fn, mlp.train_data, **kwargs)


def test_bad_data_and_loss_are_train_errors(mlp):
    with pytest.raises(TrainError, match="yielded no batches"):
        Trainer(mlp.build_model(), mlp.loss_fn, lambda: iter(())).fit(steps=1)
    with pytest.raises(TrainError, match="pairs"):
        Trainer(mlp.build_model(), mlp.loss_fn, lambda: [torch.randn(4, 16)]).fit(steps=1)
    with pytest.raises(TrainError, match="scalar"):
        Trainer(mlp.build_model(), lambda o, t: (o - t) ** 2, mlp.train_data).fit(steps=1)
    with pytest.raises(TrainError, match="one-shot"):
        Trainer(mlp.build_model(), mlp.loss_fn, mlp.train_data())


def test_custom_loss_scaler_instance_is_used(mlp):
    scaler = LossScaler(init_scale=256.0, growth_interval=2)
    trainer = Trainer(mlp.build_model(), mlp.loss_fn, mlp.train_data, dtype="float16", loss_scale=scaler)
    trainer.fit(steps=4)
    assert trainer.scaler is scaler and scaler.get_scale() == 1024.0


def test_no_sync_on_every_micro_batch_but_the_boundary(mlp, monkeypatch):
    from ampaudit.train import ddp

    calls = []
    real = ddp.no_sync

    def recording(model, skip):
        calls.append(skip)
        return real(model, skip)

    monkeypatch.setattr(ddp, "no_sync", recording)
    Trainer(mlp.build_model(), mlp.loss_fn, mlp.train_data, dtype="bfloat16", accum=4).fit(steps=2)
    assert calls == [True, True, True, False] * 2


def test_forward_errors_and_bad_devices_are_train_errors(mlp):
    def wrong():   # 7 features; the model takes 16
        return [(torch.randn(4, 7), torch.randn(4, 1))]

    with pytest.raises(TrainError, match="forward or loss_fn failed at step 1"):
        Trainer(mlp.build_model(), mlp.loss_fn, wrong, dtype="bfloat16").fit(steps=1)
    with pytest.raises(UsageError, match="unknown device"):
        Trainer(mlp.build_model(), mlp.loss_fn, mlp.train_data, device="tpu9")
