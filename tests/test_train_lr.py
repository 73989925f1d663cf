"""LR scaling to the effective batch and linear warmup: the step-by-step LR in the trace, with a scheduler, across
skipped steps and across a resume."""
import math

import pytest
import torch
from conftest import ASSETS, load_module
from typer.testing import CliRunner

import ampaudit.cli.commands  # noqa: F401  registers the commands
from ampaudit.cli.app import app
from ampaudit.errors import UsageError
from ampaudit.runtime.trace import read_trace
from ampaudit.train import Trainer
from ampaudit.train.lr import batch_size, lr_factor, warmup_factor

MLP = ASSETS / "train_mlp.py"
BASE_LR, STEP_SIZE, GAMMA = 1e-2, 7, 0.9     # train_mlp's make_optimizer and make_scheduler


@pytest.fixture(scope="module")
def mlp():
    return load_module(MLP)


def _lrs(trace):
    events, problems = read_trace(trace)
    assert not problems
    return events, [(e["step"], e["lr"], e["skipped"]) for e in events if e["event"] == "step"]


def _scheduled(taken: int, factor: float = 1.0) -> float:
    # StepLR as torch computes it, counted in steps the optimizer took.
    return BASE_LR * factor * GAMMA ** (taken // STEP_SIZE)


def test_rules_and_batch_size():
    assert lr_factor("linear", 128, 32) == 4.0 and lr_factor("sqrt", 128, 32) == 2.0
    assert [warmup_factor(k, 4) for k in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert warmup_factor(0, 0) == 1.0
    assert batch_size((torch.zeros(5, 3), torch.zeros(5))) == 5
    assert batch_size(({"ids": torch.zeros(7, 2, dtype=torch.long)}, None)) == 7


def test_warmup_wraps_the_scheduler_step_by_step(mlp, tmp_path):
    trace = tmp_path / "run.jsonl"
    Trainer(mlp.build_model(), mlp.loss_fn, mlp.train_data, optimizer=mlp.make_optimizer,
            scheduler=mlp.make_scheduler, dtype="bfloat16", warmup_steps=10, trace=trace,
            handle_signals=False).fit(steps=20)
    events, rows = _lrs(trace)
    assert len(rows) == 20 and not any(skipped for *_, skipped in rows)
    for step, lr, _ in rows:
        expected = _scheduled(step - 1) * min(1.0, step / 10)
        assert lr == pytest.approx(expected, rel=1e-12), step
    assert rows[0][1] == pytest.approx(BASE_LR / 10)        # linear from 0: the first step runs at 1/N
    assert events[0]["lr_policy"]["warmup_steps"] == 10


@pytest.mark.parametrize("rule, factor", [("linear", 4.0), ("sqrt", 2.0)])
def test_scaled_lr_follows_the_effective_batch(mlp, tmp_path, rule, factor):
    # train_mlp yields batches of 16; accum 2 makes the effective batch 32, against a base of 8.
    trace = tmp_path / "run.jsonl"
    trainer = Trainer(mlp.build_model(), mlp.loss_fn, mlp.train_data, optimizer=mlp.make_optimizer,
                      scheduler=mlp.make_scheduler, dtype="bfloat16", accum=2, scale_lr=rule, base_batch=8,
                      warmup_steps=3, trace=trace, handle_signals=False)
    assert trainer.scheduler.base_lrs == [pytest.approx(BASE_LR * factor)]
    trainer.fit(steps=9)
    events, rows = _lrs(trace)
    assert [lr for _, lr, _ in rows] == pytest.approx(
        [_scheduled(s - 1, factor) * min(1.0, s / 3) for s, _, _ in rows], rel=1e-12)
    policy = events[0]["lr_policy"]
    assert (policy["micro_batch"], policy["effective_batch"], policy["factor"]) == (16, 32, pytest.approx(factor))


def test_a_skipped_step_does_not_advance_the_warmup(mlp, tmp_path):
    trace = tmp_path / "run.jsonl"
    # 2**40 overflows fp16 gradients: the first steps are skipped while the scale backs off.
    Trainer(mlp.build_model(), mlp.loss_fn, mlp.train_data, optimizer=mlp.make_optimizer, dtype="float16",
            warmup_steps=5, scaler_options={"init_scale": 2.0 ** 40}, trace=trace, handle_signals=False).fit(steps=12)
    _, rows = _lrs(trace)
    skipped = [s for s, _, sk in rows if sk]
    assert skipped and skipped[0] == 1
    taken = 0
    for step, lr, was_skipped in rows:
        assert lr == pytest.approx(BASE_LR * min(1.0, (taken + 1) / 5), rel=1e-12), step
        taken += not was_skipped
    assert taken < 12


def test_warmup_and_scaled_lr_survive_resume(mlp, tmp_path):
    settings = dict(optimizer=mlp.make_optimizer, scheduler=mlp.make_scheduler, dtype="float16", accum=2,
                    warmup_steps=8, scale_lr="sqrt", base_batch=8, handle_signals=False)
    whole = Trainer(mlp.build_model(), mlp.loss_fn, mlp.train_data, trace=tmp_path / "whole.jsonl", **settings)
    whole.fit(steps=14)
    ckpt, split = tmp_path / "ckpt", tmp_path / "split.jsonl"
    Trainer(mlp.build_model(), mlp.loss_fn, mlp.train_data, trace=split, checkpoint_dir=ckpt,
            **settings).fit(steps=5)
    second = Trainer(mlp.build_model(), mlp.loss_fn, mlp.train_data, trace=split, checkpoint_dir=ckpt, **settings)
    second.fit(steps=14, resume=True)
    _, whole_rows = _lrs(tmp_path / "whole.jsonl")
    _, split_rows = _lrs(split)
    assert [s for s, _, _ in split_rows] == list(range(1, 15))
    assert split_rows == whole_rows                      # every step's LR, mid-warmup resume included
    assert whole_rows[4][1] < whole_rows[7][1] == pytest.approx(_scheduled(7, math.sqrt(4)))
    for (name, a), b in zip(whole.model.state_dict().items(), second.model.state_dict().values()):
        assert torch.equal(a, b), name


def test_bad_lr_options_are_usage_errors(mlp):
    with pytest.raises(UsageError, match="needs base_batch"):
        Trainer(mlp.build_model(), mlp.loss_fn, mlp.train_data, scale_lr="sqrt", handle_signals=False)
    with pytest.raises(UsageError, match="linear or sqrt"):
        Trainer(mlp.build_model(), mlp.loss_fn, mlp.train_data, scale_lr="cube", base_batch=4,
                handle_signals=False)


def test_cli_flags(tmp_path):
    trace = tmp_path / "run.jsonl"
    runner = CliRunner(env={"COLUMNS": "160"})
    r = runner.invoke(app, ["train", str(MLP), "--steps", "4", "--dtype", "bfloat16", "--warmup-steps", "4",
                            "--scale-lr", "linear", "--base-batch", "32", "--trace", str(trace)])
    assert r.exit_code == 0, r.output
    events, rows = _lrs(trace)
    # micro-batch 16 x accum 1 against 32: half the tuned LR, ramped over 4 steps
    assert [lr for _, lr, _ in rows] == pytest.approx([_scheduled(s - 1, 0.5) * s / 4 for s in range(1, 5)])
    r = runner.invoke(app, ["train", str(MLP), "--steps", "2", "--scale-lr", "linear"])
    assert r.exit_code == 2 and "--base-batch" in r.output and "Traceback" not in r.output
