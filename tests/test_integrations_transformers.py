"""AmpAuditCallback inside a real Hugging Face ``Trainer`` on a tiny GPT-2 built from a config (offline, CPU)."""
from __future__ import annotations

import importlib
import math
import os
import sys
import warnings

import pytest
import torch

from _integrations_env import import_or_skip
from ampaudit.integrations import MissingExtraError

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

transformers = import_or_skip("transformers", "transformers")
import_or_skip("accelerate", "transformers")
try:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments
except Exception as exc:  # noqa: BLE001  the lazy model import can fail the same way
    pytest.skip(f"transformers cannot import GPT-2 here: {type(exc).__name__}: {exc}", allow_module_level=True)

from ampaudit.integrations.transformers import AmpAuditCallback, args_dtype  # noqa: E402
from ampaudit.report.trace_summary import collect  # noqa: E402
from ampaudit.runtime.trace import read_trace  # noqa: E402

VOCAB = 64


class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        ids = torch.randint(0, VOCAB, (16,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


class Poison(TrainerCallback):
    """Makes one parameter's gradient inf on one step, so the scaler has a step to skip."""

    def __init__(self, param: torch.nn.Parameter, step: int):
        self.step, self.on = step, False
        param.register_hook(lambda g: g * float("inf") if self.on else g)

    def on_step_begin(self, args, state, control, **kwargs):
        self.on = state.global_step == self.step


class Boom(TrainerCallback):
    """Makes train() raise after its first step, the first time only."""

    def __init__(self):
        self.armed = True

    def on_step_end(self, args, state, control, **kwargs):
        if self.armed:
            self.armed = False
            raise RuntimeError("boom")


def _train(tmp_path, callback, *, steps: int = 4, accum: int = 2, scaler: bool = True, poison: int | None = None,
           extra: list | None = None):
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=VOCAB, n_positions=32,
                                       bos_token_id=0, eos_token_id=0))
    callbacks = [callback, *(extra or [])]
    if poison is not None:
        callbacks.insert(0, Poison(model.transformer.h[0].mlp.c_fc.weight, poison))
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=steps, per_device_train_batch_size=4,
                             gradient_accumulation_steps=accum, bf16=True, use_cpu=True, report_to=[],
                             save_strategy="no", logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=callbacks)
    if scaler:
        # accelerate gives CPU no fp16 scaler; a real GradScaler on the bf16 run exercises the same skip path
        # (accelerate's AcceleratedOptimizer drives scaler.step/update as it does for fp16 on CUDA).
        trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    return model, trainer


@pytest.mark.slow
def test_trainer_run_writes_steps_stats_divergence_and_skip_attribution(tmp_path):
    trace = tmp_path / "run.jsonl"
    callback = AmpAuditCallback(trace, every=2, divergence_every=3)
    model, trainer = _train(tmp_path, callback, poison=2)
    events, problems = read_trace(trace)
    assert problems == []
    meta = events[0]
    assert (meta["integration"], meta["dtype"], meta["gradient_accumulation_steps"]) == ("transformers", "bfloat16", 2)
    data = collect(events)
    assert [r.step for r in data.steps] == [0, 1, 2, 3]
    # the scaler's skip, attributed from the gradients as the backward left them (before the Trainer's clipping
    # turned every gradient into NaN)
    assert data.skipped_steps == [2]
    assert [(s["params"], s["modules"]) for s in data.skips] == [(["transformer.h.0.mlp.c_fc.weight"],
                                                                   ["transformer.h.0.mlp.c_fc"])]
    scales = {r.step: r.scale for r in data.steps}
    assert scales[3] == scales[2] / 2 == 512.0
    # the loss of the step (two micro-batches, each a share of it): near ln(64) for an untrained model
    assert all(3.0 < r.loss < 5.0 for r in data.steps)
    assert all(r.grad_norm is not None and math.isfinite(r.grad_norm) for r in data.steps if r.step != 2)
    assert {s["module"] for s in data.stats} >= {"transformer.h.0.attn.c_attn", "transformer.h.1.mlp.c_proj"}
    # divergence needs the watch to see autocast, which accelerate enters inside forward: nonzero error proves
    # the FP32 shadow really ran in FP32 and the real forward in bf16
    div = [d for d in data.divergence if d["scope"] == "global" and d["module"] == "transformer.h.0.attn.c_attn"]
    assert {d["step"] for d in div} == {0, 3} and all(d["rel_l2"] > 1e-4 for d in div)
    # everything is undone: accelerate's forward is back, no hook is left
    assert model.__dict__["forward"] is not model._original_forward
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


@pytest.mark.slow
def test_outputs_stay_fp32_and_no_scaler_means_no_skips(tmp_path):
    callback = AmpAuditCallback(every=1)
    model, trainer = _train(tmp_path, callback, steps=2, accum=1, scaler=False)
    data = collect(callback.events)
    assert [r.scale for r in data.steps] == [None, None] and data.skipped_steps == []
    # accelerate's autocast wrapper is back in place after training, and still returns fp32
    assert model.__dict__["forward"] is not model._original_forward
    with torch.no_grad():
        out = model(input_ids=torch.zeros(1, 8, dtype=torch.long))
    assert out.logits.dtype == torch.float32


@pytest.mark.slow
def test_a_train_that_raised_leaves_no_hooks_once_the_callback_is_used_again(tmp_path):
    # Hugging Face calls no callback when train() raises: the next on_train_begin takes the old hooks off.
    callback, boom = AmpAuditCallback(every=1), Boom()
    with pytest.raises(RuntimeError, match="boom"):
        _train(tmp_path, callback, steps=2, accum=1, scaler=False, extra=[boom])
    first = callback._model
    assert any(m._forward_hooks or m._forward_pre_hooks for m in first.modules())      # left behind
    _train(tmp_path, callback, steps=1, accum=1, scaler=False, extra=[boom])
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in first.modules())
    assert first.__dict__["forward"] is not first._original_forward                    # accelerate's wrapper back


def test_args_dtype():
    assert args_dtype(type("A", (), {"fp16": True, "bf16": False})()) is torch.float16
    assert args_dtype(type("A", (), {"fp16": False, "bf16": True})()) is torch.bfloat16
    assert args_dtype(type("A", (), {})()) is torch.float32


def test_missing_transformers_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)
    monkeypatch.delitem(sys.modules, "ampaudit.integrations.transformers", raising=False)
    with pytest.raises(MissingExtraError) as info:
        importlib.import_module("ampaudit.integrations.transformers")
    assert "needs the 'transformers' package" in str(info.value)
    assert info.value.hint == "pip install 'ampaudit[transformers]'"
